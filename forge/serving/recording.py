"""What the front door served a recorded session, and the trajectories built from it.

An agent trained through the front door (``rollout.agent``) talks to the policy as any OpenAI
client does; forge keeps, per session, every completion it was served: the prompt's ids (a
continued turn's history is the earlier ids exactly, ``forge.serving.sessions``), the sampled ids
with their behaviour logprobs and versions. ``trajectories`` turns that into ``Trajectory``s: a
run of turns that continue one another is one trajectory (the text the agent added between turns
is an observation, out of the loss); a turn that does not continue the one before starts another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from forge.envs.trajectory import Trajectory
from forge.types import TurnResult

__all__ = ["Recorder", "RecordedTurn", "SessionRecord", "trajectories"]


@dataclass(frozen=True)
class RecordedTurn:
    prompt_ids: list[int]
    continued_from: int | None
    """How many leading prompt ids are the turn before's prompt and completion; None: tokenised whole."""
    completion: Any
    """The ``Completion`` served: ``token_ids``, ``logprobs``, ``versions()``, ``policy_version``, ``text``."""


@dataclass
class SessionRecord:
    """Everything one recorded session was served, and the failure that ended a request of it."""

    session: str
    turns: list[RecordedTurn] = field(default_factory=list)
    failure: BaseException | None = None
    """The service's failure behind an error the session was answered with (a replica died, none was up)."""


class Recorder:
    """The sessions being recorded, and the sampling they are held to.

    The sampling temperature of a recorded session is the run's (``temperature``), whatever the
    agent asks: the trainer scores the sampled tokens at that temperature, and behaviour logprobs
    of another one would make every importance ratio wrong. ``top_p`` is 1 for the same reason.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self._records: dict[str, SessionRecord] = {}

    def open(self, session: str) -> SessionRecord:
        if session in self._records:
            raise ValueError(f"session {session!r} is already being recorded")
        record = self._records[session] = SessionRecord(session)
        return record

    def close(self, session: str) -> SessionRecord:
        return self._records.pop(session)

    def get(self, session: str | None) -> SessionRecord | None:
        return None if session is None else self._records.get(session)


def trajectories(record: SessionRecord, group_id: str, reward: float) -> list[Trajectory]:
    """The record's turns as trajectories, each ending with the episode's ``reward``."""
    built: list[Trajectory] = []
    current: Trajectory | None = None
    for i, turn in enumerate(record.turns):
        ids = torch.tensor(turn.prompt_ids, dtype=torch.long)
        if current is not None and turn.continued_from == current.length:
            current.add_observation(ids[current.length :], 0.0, False)
        else:
            current = Trajectory(f"{record.session}/{i}", group_id, ids)
            built.append(current)
        c = turn.completion
        current.add_turn(
            TurnResult(c.token_ids, c.logprobs, c.text, int(c.policy_version), c.finish_reason, c.versions())
        )
    for trajectory in built:
        trajectory.add_observation(torch.zeros(0, dtype=torch.long), reward, True)
    return built
