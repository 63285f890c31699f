"""A multi-turn environment whose every step takes a while, as a real tool call or simulator does.

The fault tests kill a role "between turns": with the toy environment's instant steps, a fast
machine plays a whole step's trajectories in tens of milliseconds, and a kill meant for the middle
of a step lands after the run's last one. Steps that take ``step_s`` keep each trajectory between
turns long enough for the kill to meet it, on any machine; with ``marks`` (a folder) each step in
flight holds a file there, so a test kills a role once trajectories are observably between turns
instead of after a guessed delay."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from forge.envs.base import Action, StepResult
from forge.envs.toy import ReverseWithFeedback


class SlowReverseWithFeedback(ReverseWithFeedback):
    """``ReverseWithFeedback`` whose steps each take ``step_s`` seconds."""

    def __init__(self, max_guesses: int = 3, step_s: float = 0.25, marks: str | None = None) -> None:
        super().__init__(max_guesses)
        self.step_s = step_s
        self.marks = None if marks is None else Path(marks)

    async def step(self, action: Action) -> StepResult:
        if self.marks is None:
            await asyncio.sleep(self.step_s)
            return await super().step(action)
        self.marks.mkdir(parents=True, exist_ok=True)
        mark = self.marks / f"{os.getpid()}-{id(action)}"
        mark.touch()  # a trajectory is between turns (its env step in flight) while this exists
        try:
            await asyncio.sleep(self.step_s)
            return await super().step(action)
        finally:
            mark.unlink(missing_ok=True)


def steps_in_flight(marks: Path) -> int:
    """How many environment steps are in flight now (``marks`` as given to the environment); the
    marks of a killed environment process are not counted."""
    import psutil

    found = list(marks.iterdir()) if marks.is_dir() else []
    return sum(1 for mark in found if psutil.pid_exists(int(mark.name.split("-")[0])))
