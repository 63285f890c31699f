"""Continuous rollouts of the GRPO app: prompts -> groups of scored episodes -> the buffer."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Any

from apps.grpo.roles import Roles, call_role


class Rollouts:
    """Continuous rollouts: ``concurrency`` workers, each turning one prompt into one group.

    Backpressure: a worker starts a new prompt only while fewer than ``max_buffered`` groups are
    in flight or waiting in the buffer, so rollouts stay about ``max_policy_age`` batches ahead
    of training instead of producing groups that would be evicted as stale.

    Messages to the dataset and the buffer are coalesced: prompts are fetched ``concurrency`` at
    a time, and finished groups go to the buffer together (whatever finished while the last
    ``add_many`` was in flight), so these light roles cost a few messages a step, not two per
    group.
    """

    def __init__(self, roles: Roles, group_size: int, concurrency: int, max_buffered: int) -> None:
        self.roles = roles
        self.group_size = group_size
        self.concurrency = concurrency
        self.max_buffered = max_buffered
        self.outstanding = 0  # groups in flight or in the buffer
        self.groups_added = 0
        self.room = asyncio.Condition()
        self.added = asyncio.Event()
        self._ids = itertools.count()
        self._prompts: collections.deque[Any] = collections.deque()
        self._fetching = asyncio.Lock()
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._storing = False

    def start(self) -> list[asyncio.Task]:
        """Start the workers; the caller owns (and cancels) the returned tasks."""
        return [asyncio.create_task(self._worker(i), name=f"rollout-{i}") for i in range(self.concurrency)]

    async def taken(self, n: int) -> None:
        """Training took ``n`` groups out of the buffer (or they were evicted)."""
        async with self.room:
            self.outstanding -= n
            self.room.notify_all()

    async def _worker(self, index: int) -> None:
        while True:
            async with self.room:
                await self.room.wait_for(lambda: self.outstanding < self.max_buffered)
                self.outstanding += 1
            await self._store(await self.one_group())

    async def _next_prompt(self) -> Any:
        async with self._fetching:
            if not self._prompts:
                self._prompts.extend(
                    await call_role("dataset", self.roles.dataset.sample_many.call_one(self.concurrency))
                )
            return self._prompts.popleft()

    async def _store(self, group: Any) -> None:
        """Add ``group`` to the buffer; the first waiter sends everyone's groups in one message."""
        done = asyncio.get_running_loop().create_future()
        self._pending.append((group, done))
        if self._storing:
            return await done
        self._storing = True
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await call_role("buffer", self.roles.buffer.add_many.call_one([g for g, _ in batch]))
                except BaseException as exc:
                    # Everyone waiting shares the fate of the message (the leader re-raises).
                    for _, fut in batch + self._pending:
                        if fut is done or fut.done():
                            continue
                        if isinstance(exc, asyncio.CancelledError):
                            fut.cancel()
                        else:
                            fut.set_exception(exc)
                    self._pending = []
                    done.cancel()
                    raise
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(None)
                self.groups_added += len(batch)
                self.added.set()
        finally:
            self._storing = False
        await done

    async def one_group(self) -> Any:
        """Prompt -> completions -> rewards and reference logprobs -> scored episodes."""
        import torch

        from forge.actors import prompt_key
        from forge.losses import group_advantages
        from forge.observability import record_metric
        from forge.types import Episode, EpisodeBatch

        roles = self.roles
        prompt = await self._next_prompt()
        t0 = time.perf_counter()
        group = await call_role("policy", roles.policy.generate.route(prompt, key=prompt_key(prompt)))
        t1 = time.perf_counter()
        completions = group.completions
        rewards, ref_logprobs = await asyncio.gather(
            call_role("reward", roles.reward.score.route_many([(prompt, c.text) for c in completions])),
            call_role(
                "reference", roles.reference.logprobs.route_many([(c.prompt_ids, c.token_ids) for c in completions])
            ),
        )
        record_metric("rollout/generate_latency_s", t1 - t0)
        record_metric("rollout/score_latency_s", time.perf_counter() - t1)
        advantages = group_advantages(torch.tensor(rewards, dtype=torch.float32))
        group_id = f"{prompt.prompt_id}#{next(self._ids)}"
        return EpisodeBatch.pack(
            [
                Episode(
                    group_id=group_id,
                    prompt_ids=c.prompt_ids,
                    response_ids=c.token_ids,
                    behaviour_logprobs=c.logprobs,
                    ref_logprobs=ref,
                    reward=float(r),
                    advantage=float(a),
                    policy_version=c.policy_version,
                )
                for c, r, a, ref in zip(completions, rewards, advantages.tolist(), ref_logprobs)
            ]
        )
