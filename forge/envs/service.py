"""``EnvActor``: environments as a service, with ``reset`` and ``step`` prebatched across trajectories.

Each replica holds the episodes of the sessions routed to it (``EnvSessionRouter``: a session
always reaches the same replica). A batch of steps runs its episodes' ``step`` coroutines
concurrently, each under ``step_timeout_s``; one episode that raises, hangs or returns a
malformed step fails its own slot with an ``EnvError`` and the batch-mates are served. The
replica tokenises text observations once, with the policy's tokenizer, so the trajectory gets
token ids and never re-tokenises its history.

    env = await EnvActor.options(num_replicas=2, router=EnvSessionRouter).as_service(
        EnvConfig("forge.envs.toy:ReverseWithFeedback", tokenizer_path=model_path))
    first = await env.reset.route(ResetRequest(session, prompt), key=SessionKey(session))
    reply = await env.step.route(StepRequest(session, action), key=SessionKey(session))
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from forge.controller import Batching, ForgeActor, endpoint
from forge.envs.base import (
    Action,
    EnvError,
    Environment,
    UnknownSession,
    check_observation,
    check_step,
    load_environment,
)
from forge.observability import record_metric
from forge.types import Prompt

__all__ = ["EnvActor", "EnvConfig", "EnvReply", "ResetRequest", "StepRequest"]

logger = logging.getLogger("forge.envs")


@dataclass(frozen=True)
class ResetRequest:
    session: str
    prompt: Prompt


@dataclass(frozen=True)
class StepRequest:
    session: str
    action: Action


@dataclass
class EnvReply:
    """An observation as token ids, plus the step's reward and whether the episode is over."""

    observation_ids: torch.Tensor  # int64 [O]
    reward: float = 0.0
    done: bool = False


@dataclass
class EnvConfig:
    """What an env replica is made from."""

    env_cls: str
    """The environment, ``package.module:Class``."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of its constructor (one instance per episode)."""
    tokenizer_path: str | None = None
    """Folder of the policy's tokenizer, which turns text observations into ids."""
    step_timeout_s: float = 30.0
    """Longest one ``reset`` or ``step`` may take before its trajectory fails."""

    def __post_init__(self) -> None:
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 seconds, got {self.step_timeout_s!r}")


class EnvActor(ForgeActor):
    """Hosts episodes of the environment class ``config.env_cls`` (``package.module:Class``)."""

    def __init__(self, config: EnvConfig) -> None:
        self.env_spec = config.env_cls
        self.options = dict(config.options)
        self.tokenizer_path = config.tokenizer_path
        self.step_timeout_s = float(config.step_timeout_s)
        self.env_cls: type[Environment] | None = None
        self.tokenizer: Any = None
        self.episodes: dict[str, Environment] = {}

    @endpoint
    async def setup(self) -> None:
        self.env_cls = load_environment(self.env_spec)
        if self.tokenizer_path is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)

    @endpoint(batch=Batching(max_size=512, max_wait_s=0.002))
    async def reset(self, requests: list[ResetRequest]) -> list[EnvReply | Exception]:
        """Start one episode per request; each reply holds its first observation (the prompt)."""
        return list(await asyncio.gather(*(self._reset_one(r) for r in requests)))

    @endpoint(batch=Batching(max_size=512, max_wait_s=0.002))
    async def step(self, requests: list[StepRequest]) -> list[EnvReply | Exception]:
        """Apply each request's action to its episode; a failing episode fails alone."""
        record_metric("env/step_batch", len(requests))
        return list(await asyncio.gather(*(self._step_one(r) for r in requests)))

    @endpoint
    async def close(self, sessions: list[str]) -> int:
        """End these sessions' episodes (unknown ones are ignored); returns how many were held."""
        closed = 0
        for session in sessions:
            env = self.episodes.pop(session, None)
            if env is not None:
                closed += 1
                await self._close(session, env)
        return closed

    @endpoint
    async def num_episodes(self) -> int:
        """Episodes this replica holds (a trajectory that ended must not leave one behind)."""
        return len(self.episodes)

    async def _reset_one(self, request: ResetRequest) -> EnvReply | Exception:
        where = f"environment {self.env_spec} session {request.session!r} reset"
        try:
            if request.session in self.episodes:
                raise EnvError(f"{where}: the session already has an episode")
            env = self.env_cls(**self.options)  # type: ignore[misc]
            observation = await asyncio.wait_for(env.reset(request.prompt), self.step_timeout_s)
            ids = self._tokens(check_observation(observation, where), where)
            if ids.numel() == 0:
                raise EnvError(f"{where}: the first observation is empty; the policy needs a prompt")
        except Exception as exc:
            return self._failed(where, exc)
        self.episodes[request.session] = env
        return EnvReply(ids)

    async def _step_one(self, request: StepRequest) -> EnvReply | Exception:
        where = f"environment {self.env_spec} session {request.session!r} turn {request.action.turn}"
        env = self.episodes.get(request.session)
        if env is None:
            return UnknownSession(
                f"{where}: no episode for this session here (never reset, ended, or its replica restarted)"
            )
        try:
            result = check_step(await asyncio.wait_for(env.step(request.action), self.step_timeout_s), where)
            ids = self._tokens(result.observation, where)
        except Exception as exc:
            self.episodes.pop(request.session, None)
            await self._close(request.session, env)
            return self._failed(where, exc)
        if result.done:
            self.episodes.pop(request.session, None)
            await self._close(request.session, env)
        return EnvReply(ids, result.reward, result.done)

    def _tokens(self, observation: Any, where: str) -> torch.Tensor:
        if isinstance(observation, str):
            if self.tokenizer is None:
                raise EnvError(f"{where}: a text observation needs the service's tokenizer_path")
            ids = self.tokenizer(observation, add_special_tokens=False).input_ids
        else:
            ids = observation
        return torch.tensor(ids, dtype=torch.long)

    def _failed(self, where: str, exc: BaseException) -> EnvError:
        if isinstance(exc, EnvError):
            error = exc
        elif isinstance(exc, asyncio.TimeoutError):
            error = EnvError(f"{where}: no answer within step_timeout_s={self.step_timeout_s}")
        else:
            error = EnvError(f"{where}: the environment raised {type(exc).__name__}: {exc}")
        logger.warning("%s", error)
        record_metric("env/errors", 1, "sum")
        return error

    async def _close(self, session: str, env: Environment) -> None:
        try:
            await asyncio.wait_for(env.close(), self.step_timeout_s)
        except Exception as exc:  # a failing close must not fail the step that ended the episode
            logger.warning("environment %s session %r: close raised %r", self.env_spec, session, exc)
