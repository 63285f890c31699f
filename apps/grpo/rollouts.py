"""Continuous rollouts of the GRPO app: prompts -> groups of scored episodes -> the buffer.

This is the scheduling around the algorithm: how many prompts are in flight, backpressure,
dynamic sampling and the buffer's writes. What turns one prompt into one scored group is a group
maker (``apps.grpo.groups``), held here or by each rollout worker."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from apps.common.launch import Roles
from apps.common.roles import RoleFailed, call_role
from apps.grpo.group_orders import GroupOrder
from apps.grpo.groups import GroupMaker, GroupSettings, group_maker, make_with_retries
from forge.checks import check_int
from forge.controller import Batcher, Batching
from forge.losses import rewards_uniform as uniform
from forge.observability import record_metric
from forge.types import EpisodeBatch, Groups, Prompt

if TYPE_CHECKING:
    from apps.grpo.config import GRPOConfig
    from forge.controller import ServiceInterface

logger = logging.getLogger("forge.grpo")


@dataclass
class RolloutCounts:
    """Where every group the rollouts started went; ``lost`` is 0 unless one vanished."""

    started: int = 0
    """Groups begun (one prompt each)."""
    regenerated: int = 0
    """Tries that a dying policy, reference or reward replica cut short; the group was generated
    again from the same prompt, with the same ``group_id``."""
    stored: int = 0
    """Groups the buffer stored."""
    refused: int = 0
    """Groups the buffer refused as duplicates of a ``group_id`` it already had."""
    dropped_uniform: int = 0
    """Groups whose rewards were all equal, dropped before the buffer by dynamic sampling
    (``rollout.dynamic_sampling``); they took no buffer slot and no trainer compute."""
    in_flight: int = 0
    """Groups begun and not yet stored, refused or dropped (at the end of a run: cut off by its end)."""

    @property
    def lost(self) -> int:
        return self.started - self.stored - self.refused - self.dropped_uniform - self.in_flight


def rewards_uniform(group: EpisodeBatch) -> bool:
    """Whether every episode of ``group`` has the same reward (``forge.losses.rewards_uniform``):
    such a group costs trainer compute and dilutes the batch but teaches nothing."""
    return uniform(group.rewards)


class DynamicSampling:
    """Which finished groups go to the buffer, and what each step's groups looked like.

    DAPO's dynamic sampling: with ``enabled``, a group whose rewards are all equal is dropped
    instead of stored, so a step trains only on groups that teach something, at the cost of
    generating more groups per step. At most ``max_dropped_per_step`` groups are dropped per
    step (from one ``end_step`` to the next); past that, uniform groups are kept and a warning
    is logged once for the step, so that a task where nearly every group is uniform still
    trains (on zero-advantage groups) instead of generating forever.

    Off or on, it counts the groups finished in each step and those whose rewards were all
    equal (``zero_std_fraction``): what dynamic sampling would drop.
    """

    def __init__(self, enabled: bool = False, max_dropped_per_step: int = 0) -> None:
        check_int("max_dropped_per_step", max_dropped_per_step, 0)
        self.enabled = enabled
        self.max_dropped_per_step = max_dropped_per_step
        self.finished = 0  # groups finished since the last end_step
        self.uniform = 0  # of them, those whose rewards were all equal
        self.dropped = 0  # of those, the ones dropped
        self._warned = False

    @classmethod
    def from_config(cls, cfg: GRPOConfig) -> DynamicSampling:
        """``rollout.dynamic_sampling`` and its bound; an unset bound is ``4 * prompts_per_step``."""
        bound = cfg.rollout.max_dropped_per_step
        return cls(cfg.rollout.dynamic_sampling, 4 * cfg.prompts_per_step if bound is None else bound)

    def keep(self, group: EpisodeBatch) -> bool:
        """Count one finished group; False if it is to be dropped rather than stored."""
        self.finished += 1
        if not rewards_uniform(group):
            return True
        self.uniform += 1
        if not self.enabled:
            return True
        if self.dropped < self.max_dropped_per_step:
            self.dropped += 1
            return False
        if not self._warned:
            self._warned = True
            logger.warning(
                "dynamic sampling: %d groups with all-equal rewards were dropped this step, the most "
                "rollout.max_dropped_per_step allows; the step's further uniform groups are kept (they train "
                "with zero advantages). So many uniform groups: the task may be too hard or too easy for the "
                "policy",
                self.dropped,
            )
        return True

    def end_step(self) -> dict[str, float]:
        """The step's metrics, then a fresh count and drop budget for the next step.

        ``zero_std_fraction``: of the groups finished since the last step, the fraction whose
        rewards were all equal (NaN, logged as null, if none finished); ``dropped_uniform_groups``:
        how many of them dynamic sampling dropped.
        """
        fraction = self.uniform / self.finished if self.finished else math.nan
        metrics = {"zero_std_fraction": fraction, "dropped_uniform_groups": float(self.dropped)}
        self.finished = self.uniform = self.dropped = 0
        self._warned = False
        return metrics


def _retrieved(task: asyncio.Task) -> None:
    """Mark a shielded task's outcome as seen: when the step that awaited it was cancelled, its
    error (a buffer stopped at shutdown) is not news, and asyncio would log it at exit."""
    if not task.cancelled():
        task.exception()


class Rollouts:
    """Continuous rollouts: ``concurrency`` tasks, each turning one prompt at a time into one
    group with ``maker`` (or, with ``workers``, through a rollout worker).

    Backpressure: a worker starts a new prompt only while fewer than ``max_buffered`` groups are
    in flight or waiting in the buffer, so rollouts stay about ``max_policy_age`` batches ahead
    of training instead of producing groups that would be evicted as stale.

    Messages to the dataset and the buffer are coalesced: prompts are fetched ``concurrency`` at
    a time, and finished groups go to the buffer through a forge ``Batcher`` with one slot, so
    whatever finished while the last ``add_many`` was in flight goes in the next one. These
    light roles cost a few messages a step, not two per group.

    A group whose policy, reference or reward call fails because a replica died or was
    restarting (``RoleFailed.recoverable``) is generated again from the same prompt; any other
    failure ends the run.

    Each finished group passes ``sampling`` (``DynamicSampling``) before the buffer: a group it
    drops frees its backpressure slot at once and is counted in ``counts.dropped_uniform``.
    """

    def __init__(
        self,
        roles: Roles,
        maker: GroupMaker | None,
        concurrency: int,
        max_buffered: int,
        *,
        sampling: DynamicSampling | None = None,
        workers: ServiceInterface | None = None,
    ) -> None:
        if maker is None and workers is None:
            raise ValueError("rollouts need a group maker, or the rollout workers' service that holds one")
        self.roles = roles
        self.maker = maker
        """Makes each group here (``apps.grpo.groups``); None with rollout workers, which hold their own."""
        self.workers = workers
        """The rollout workers' service (``rollout.workers``), which makes the groups; None: here."""
        self.concurrency = concurrency
        self.max_buffered = max_buffered
        self.outstanding = 0  # groups in flight or in the buffer
        self.counts = RolloutCounts()
        self.sampling = sampling if sampling is not None else DynamicSampling()
        self.buffer_stats: Any = None  # the buffer's counters (BufferStats) at the last sample
        self.room = asyncio.Condition()
        self.added = asyncio.Event()
        self._ids = itertools.count()
        self._prompts: collections.deque[Any] = collections.deque()
        self._fetching = asyncio.Lock()
        # One slot: while an add_many is in flight the next batch forms; no wait once it is free.
        writes = Batching(max_size=1 << 20, max_wait_s=0.0, max_concurrent_batches=1)
        self._writes = Batcher(writes, self._add_many, name="grpo-buffer-writes")

    @classmethod
    def from_config(cls, cfg: GRPOConfig, roles: Roles, model_path: str) -> Rollouts:
        """The run's rollouts: its group maker here, or its rollout workers' (``roles.rollout``)."""
        maker = None if roles.rollout is not None else group_maker(roles, GroupSettings.from_config(cfg, model_path))
        return cls(
            roles,
            maker,
            cfg.rollout_concurrency,
            cfg.max_buffered_groups,
            sampling=DynamicSampling.from_config(cfg),
            workers=roles.rollout,
        )

    @property
    def groups_added(self) -> int:
        return self.counts.stored

    def start(self) -> list[asyncio.Task]:
        """Start the workers; the caller owns (and cancels) the returned tasks."""
        return [asyncio.create_task(self._worker(i), name=f"rollout-{i}") for i in range(self.concurrency)]

    async def close(self) -> None:
        """Stop the buffer writer; call after cancelling the workers."""
        await self._writes.close()

    async def take_batch(self, num_groups: int, version: int) -> list[EpisodeBatch]:
        """``num_groups`` groups from the buffer fresh enough for policy ``version``; waits for
        the rollouts if it holds too few. Every group the buffer hands over or evicts frees its
        backpressure slot."""
        while True:
            self.added.clear()
            # Shielded: a step cancelled meanwhile (its trainer died) still gives back the slots of
            # the groups the buffer handed over or evicted, or the rollouts would stall for good.
            taking = asyncio.ensure_future(self._take(num_groups, version))
            taking.add_done_callback(_retrieved)  # its error, if its step was cancelled, is the run's to see
            sample = await asyncio.shield(taking)
            if sample.groups is not None:
                return sample.groups
            await self.added.wait()

    async def _take(self, num_groups: int, version: int) -> Any:
        """One ``sample`` from the buffer, its books closed: the slots of what left it freed."""
        sample = await call_role("buffer", self.roles.buffer.sample.call_one(num_groups, version))
        self.buffer_stats = sample.stats
        record_metric("buffer/evicted_groups", sample.evicted, "sum")
        taken = sample.evicted + (len(sample.groups) if sample.groups is not None else 0)
        if taken:
            await self._free(taken)
        return sample

    def end_step(self, batch: list[EpisodeBatch]) -> dict[str, float]:
        """Close a training step's books: how informative its groups were, and a fresh count and
        drop budget for the next step (``DynamicSampling.end_step``).

        ``zero_std_fraction``: of the groups finished since the last step, the fraction whose rewards
        were all equal, on or off dynamic sampling (what it drops, or would); ``dropped_uniform_groups``:
        how many of them it dropped; ``batch_zero_std_groups``: the groups of this step's batch whose
        rewards were all equal (0 with dynamic sampling unless ``rollout.max_dropped_per_step`` was reached).
        """
        return {
            **self.sampling.end_step(),
            "batch_zero_std_groups": float(sum(rewards_uniform(group) for group in batch)),
        }

    def group_counts(self) -> dict[str, float]:
        """Where every group went so far (cumulative): started, generated again after a replica
        died, stored, dropped by dynamic sampling, trained, dropped by the buffer, still in flight;
        ``groups/lost`` and ``groups/unaccounted`` are 0 unless a group vanished (the rollouts' and
        the buffer's books)."""
        c, b = self.counts, self.buffer_stats
        counts = {
            "groups/started": c.started,
            "groups/regenerated": c.regenerated,
            "groups/stored": c.stored,
            "groups/dropped_uniform": c.dropped_uniform,
            "groups/in_flight": c.in_flight,
            "groups/lost": c.lost,
        }
        if b is not None:
            counts.update(
                {
                    "groups/trained": b.sampled,
                    "groups/dropped_stale": b.dropped_stale,
                    "groups/dropped_full": b.dropped_full,
                    # Each refusal is in both books (the buffer's and the rollouts'): count it once.
                    "groups/duplicates": c.refused,
                    "groups/buffered": b.size,
                    "groups/unaccounted": b.added - b.sampled - b.evicted - b.size,
                }
            )
        return {k: float(v) for k, v in counts.items()}

    async def _free(self, n: int) -> None:
        """``n`` groups left the books of what is in flight or buffered: room for ``n`` more."""
        async with self.room:
            self.outstanding -= n
            self.room.notify_all()

    async def _worker(self, index: int) -> None:
        while True:
            async with self.room:
                await self.room.wait_for(lambda: self.outstanding < self.max_buffered)
                self.outstanding += 1
            self.counts.started += 1
            self.counts.in_flight += 1
            try:
                group = await self._produce()
                kept = self.sampling.keep(group)
                stored = await self._writes.enqueue(group) if kept else False
            finally:
                self.counts.in_flight -= 1
            if stored:
                self.counts.stored += 1
                self.added.set()
                continue
            if kept:
                self.counts.refused += 1
            else:
                self.counts.dropped_uniform += 1
            await self._free(1)  # a refused or dropped group frees its slot

    async def _add_many(self, groups: list[Any], key: Any) -> list[bool]:
        """The buffer writer's executor: one message for every group that finished meanwhile."""
        return await call_role("buffer", self.roles.buffer.add_many.call_one(Groups.pack(groups)))

    async def _produce(self) -> Any:
        """The next prompt's group: made here or, with ``rollout.workers``, by a worker."""
        prompt = await self._next_prompt()
        group, regenerated = await self.make_group(prompt, f"{prompt.prompt_id}#{next(self._ids)}")
        self.counts.regenerated += regenerated
        return group

    async def make_group(self, prompt: Prompt, group_id: str) -> tuple[EpisodeBatch, int]:
        """One prompt's group, and how many times it was made again (same prompt, same id) after a
        replica's death: by the maker here, or by a rollout worker (``from_worker``)."""
        make = self.maker.make if self.workers is None and self.maker is not None else self.from_worker
        return await make_with_retries(make, prompt, group_id)

    async def from_worker(self, prompt: Prompt, group_id: str) -> EpisodeBatch:
        """The group made by a rollout worker (``apps.grpo.rollout_workers``): one request per
        group here, every policy, reward and reference request in the worker's process."""
        assert self.workers is not None
        made = await call_role("rollout", self.workers.groups.route(GroupOrder(prompt, group_id)))
        self.counts.regenerated += made.regenerated  # tries the worker made after a replica's death
        if made.error is not None:
            raise RoleFailed("rollout", made.error)
        return made.group

    async def _next_prompt(self) -> Prompt:
        async with self._fetching:
            if not self._prompts:
                self._prompts.extend(
                    await call_role("dataset", self.roles.dataset.sample_many.call_one(self.concurrency))
                )
            return self._prompts.popleft()
