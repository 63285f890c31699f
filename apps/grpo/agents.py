"""Agent rollouts of the GRPO app: a group is ``group_size`` episodes of a user's agent, each
talking to the policy through forge's OpenAI front door (``rollout.agent``).

The agent is ``async def fn(client, prompt) -> float``: ``client`` is an ``openai.AsyncOpenAI``
bound to one session of the policy service (its ``X-Session-ID``), ``prompt`` the task's
``Prompt``; it asks for completions as it likes (chat or plain, one turn or many, tools in
between) and returns the episode's reward. The front door runs in this process on a loopback
port with a key of its own (``forge.serving.server``), so the requests are real HTTP requests,
and every one of them is one routed, prebatched call to the policy service.

forge records every completion the session was served (``forge.serving.recording``): the prompt's
ids, where a turn continues the last one, are that turn's history exactly, then the text the
agent added, tokenised once as the chat template wrote it; the sampled ids with their behaviour
logprobs and versions. The trajectory is built from those ids, so the trainer scores the tokens
the policy sampled, and the loss trains those only. A recorded session samples at the run's
``policy.temperature`` whatever the agent asks, with ``n = 1``.

An agent that raises, never calls the model, returns no number, or runs past
``rollout.agent_timeout_s`` fails its episode alone, named in a warning; the group trains on the
others (``apps.grpo.trajectory_groups``). A policy replica that dies under a request fails the
whole group, to be made again.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from apps.common.launch import Roles
from apps.common.roles import RoleFailed
from apps.grpo.trajectory_groups import TrajectoryFailed, failed, play_group, score_group
from forge.describe import describe
from forge.plugins import import_object
from forge.serving.recording import Recorder, trajectories
from forge.serving.server import RunningServer
from forge.types import EpisodeBatch, Prompt

__all__ = ["AgentFn", "AgentGroups", "AgentSettings", "load_agent"]

AgentFn = Callable[[Any, Prompt], Awaitable[float]]

logger = logging.getLogger("forge.grpo")


@dataclass(frozen=True)
class AgentSettings:
    """What an agent group maker needs of the run (a rollout worker gets it, not the config)."""

    agent: str
    """``package.module:fn``."""
    timeout_s: float
    model_path: str
    max_model_len: int
    max_tokens: int
    """``max_tokens`` of a request that sets none."""
    temperature: float


def load_agent(spec: str) -> AgentFn:
    """The agent function ``spec`` names; a ``ValueError`` naming it if it is not an ``async def``."""
    fn = import_object(spec, "rollout.agent", "function")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.agent {spec!r} must be an 'async def fn(client, prompt) -> float', got {fn!r}")
    return fn


class AgentGroups:
    """A group maker (``apps.grpo.groups``) whose episodes are runs of ``settings.agent``."""

    def __init__(self, roles: Roles, group_size: int, settings: AgentSettings) -> None:
        from transformers import AutoTokenizer

        from forge.serving import FrontSettings, make_app

        self.roles = roles
        self.group_size = group_size
        self.settings = settings
        self.agent = load_agent(settings.agent)
        self.recorder = Recorder(settings.temperature)
        self._key = secrets.token_urlsafe(24)  # the port is local, but other users of the host are not the run's
        front = FrontSettings(
            model_name="policy",
            max_model_len=settings.max_model_len,
            default_max_tokens=settings.max_tokens,
            api_key=self._key,
            max_concurrent=1 << 20,  # the rollouts' own backpressure bounds what is in flight
            request_timeout_s=settings.timeout_s,
        )
        self.app = make_app(roles.policy, AutoTokenizer.from_pretrained(settings.model_path), front, self.recorder)
        self.server: RunningServer | None = None
        self._client: Any = None
        self._starting = asyncio.Lock()
        self._sessions = itertools.count()

    async def make(self, prompt: Prompt, group_id: str) -> EpisodeBatch:
        """``group_size`` agent episodes of ``prompt`` -> reference logprobs -> scored episodes."""
        t0 = time.perf_counter()
        await self._serving()
        runs, _ = await play_group(lambda: self.episode(prompt, group_id), self.group_size, group_id, "agent")
        return await score_group(self.roles, group_id, runs, t0)

    async def _serving(self) -> None:
        """The front door on a loopback port, started with the first group."""
        async with self._starting:
            if self.server is None:
                import openai

                from forge.serving.server import start_server

                self.server = await start_server(self.app, "127.0.0.1", 0, own_signals=False)
                self._client = openai.AsyncOpenAI(
                    base_url=self.server.base_url, api_key=self._key, max_retries=0, timeout=self.settings.timeout_s
                )
                logger.info("agents reach the policy at %s", self.server.base_url)

    async def aclose(self) -> None:
        """Stop the front door (a maker that served nothing has none)."""
        if self._client is not None:
            await self._client.close()
        if self.server is not None:
            await self.server.stop()
            self.server = None

    def client(self, session: str) -> Any:
        """An ``openai.AsyncOpenAI`` whose every request is one turn of ``session``."""
        return self._client.with_options(default_headers={"X-Session-ID": session})

    async def episode(self, prompt: Prompt, group_id: str) -> list[Any]:
        """One run of the agent: its trajectories, ending with the reward it returned."""
        session = f"{group_id}/agent-{next(self._sessions)}"
        record = self.recorder.open(session)
        try:
            try:
                reward = await asyncio.wait_for(self.agent(self.client(session), prompt), self.settings.timeout_s)
            except asyncio.TimeoutError:
                raise failed(
                    TrajectoryFailed(
                        f"session {session}: the agent did not finish within "
                        f"rollout.agent_timeout_s={self.settings.timeout_s:g}"
                    )
                ) from None
            except Exception as exc:
                if record.failure is not None and RoleFailed("policy", record.failure).recoverable:
                    # A replica died under one of its requests: the group is made again.
                    raise RoleFailed("policy", record.failure) from exc
                raise failed(
                    TrajectoryFailed(f"session {session}: the agent raised {describe(exc, limit=600, typed=True)}")
                ) from exc
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise failed(
                    TrajectoryFailed(f"session {session}: the agent returned {reward!r}; it must return a finite float")
                )
            if not record.turns:
                raise failed(TrajectoryFailed(f"session {session}: the agent never called the model"))
            return trajectories(record, group_id, float(reward))
        finally:
            self.recorder.close(session)
