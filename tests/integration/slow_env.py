"""A multi-turn environment whose every step takes a while, as a real tool call or simulator does.

The fault tests kill a role "between turns": with the toy environment's instant steps, a fast
machine plays a whole step's trajectories in tens of milliseconds, and a kill meant for the middle
of a step lands after the run's last one. Steps that take ``step_s`` keep each trajectory between
turns long enough for the kill to meet it, on any machine."""

from __future__ import annotations

import asyncio

from forge.envs.base import Action, StepResult
from forge.envs.toy import ReverseWithFeedback


class SlowReverseWithFeedback(ReverseWithFeedback):
    """``ReverseWithFeedback`` whose steps each take ``step_s`` seconds."""

    def __init__(self, max_guesses: int = 3, step_s: float = 0.25) -> None:
        super().__init__(max_guesses)
        self.step_s = step_s

    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(self.step_s)
        return await super().step(action)
