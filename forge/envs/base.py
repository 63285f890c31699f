"""The environment API: ``reset(prompt) -> observation`` and ``step(action) -> StepResult``.

An ``Environment`` is one episode's world: the env service makes one per trajectory, calls
``reset`` once with the task's ``Prompt`` and ``step`` once per policy turn with what the policy
sampled. Both are ``async`` so an environment may wait on I/O (a sandbox, a web call) without
holding up the other trajectories batched with it.

An observation is text, which the env service tokenises once (never the history again), or
token ids, which are used as they are. Whatever the environment returns is appended to the
trajectory after the policy's tokens and left out of the loss.

A user's environment is named in the config as ``package.module:Class`` (``load_environment``);
its constructor takes the config's ``env.options`` as keyword arguments.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from forge.types import Prompt

__all__ = [
    "Action",
    "EnvError",
    "Environment",
    "Observation",
    "StepResult",
    "UnknownSession",
    "check_observation",
    "check_step",
]

Observation = str | Sequence[int]
"""Text (tokenised by the env service) or token ids (used as they are)."""


class EnvError(ValueError):
    """An environment raised, returned a malformed step, or was asked about a session it does
    not hold. Fails that one trajectory; the message names the session and what was wrong."""


class UnknownSession(EnvError):
    """The env replica asked to step a session holds no episode for it. A caller that reset
    the session there and has not ended it knows what that means: the replica restarted (its
    episodes died with its process, and the service resent the step to the new one), so the
    trajectory is to be played again, not blamed on the environment."""


@dataclass(frozen=True)
class Action:
    """What the policy sampled this turn, as token ids and as text (decoded once, for the env)."""

    token_ids: tuple[int, ...]
    text: str
    turn: int
    """0 for the first action after ``reset``."""


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one action."""

    observation: Observation
    """Appended to the trajectory (may be empty when ``done``)."""
    reward: float
    """This step's reward; a trajectory's reward is the sum over its steps."""
    done: bool
    """The episode is over: no more turns."""


class Environment(abc.ABC):
    """One episode of a task. Subclass it and name it in the config as ``package.module:Class``.

    Example::

        class Echo(Environment):
            async def reset(self, prompt):
                self.answer = prompt.answer
                return prompt.text
            async def step(self, action):
                return StepResult("", float(action.text.strip() == self.answer), done=True)
    """

    @abc.abstractmethod
    async def reset(self, prompt: Prompt) -> Observation:
        """Start the episode for ``prompt``; return the first observation (the policy's prompt)."""

    @abc.abstractmethod
    async def step(self, action: Action) -> StepResult:
        """React to the policy's ``action``; return the observation, reward and whether it is done."""

    async def close(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Release what the episode holds (called once when its trajectory ends, however it ends)."""


def load_environment(spec: str) -> type[Environment]:
    """The ``Environment`` subclass named ``package.module:Class``; a clear ``ValueError`` otherwise."""
    from forge.plugins import import_object

    cls = import_object(spec, "environment", "Class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {spec!r} is {cls!r}, not a subclass of forge.envs.Environment")
    return cls


def check_observation(value: Any, where: str) -> Observation:
    """``value`` if it is text or a sequence of int token ids; else ``EnvError`` naming ``where``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise EnvError(f"{where}: an observation must be a str or a sequence of int token ids, got {_describe(value)}")


def check_step(value: Any, where: str) -> StepResult:
    """A ``StepResult`` (or an ``(observation, reward, done)`` tuple) checked field by field."""
    if isinstance(value, tuple) and len(value) == 3:
        value = StepResult(*value)
    if not isinstance(value, StepResult):
        raise EnvError(f"{where}: step must return a StepResult(observation, reward, done), got {_describe(value)}")
    observation = check_observation(value.observation, where)
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvError(f"{where}: a step's reward must be a finite number, got {_describe(reward)}")
    if not isinstance(value.done, bool):
        raise EnvError(f"{where}: a step's done must be a bool, got {_describe(value.done)}")
    return StepResult(observation, float(reward), value.done)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
