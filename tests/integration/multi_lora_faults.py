"""Rewards of the multi-adapter crash-isolation test: one that always raises, and one that holds
its run back until the first has raised, so the other run's steps all come after that failure
(an order of events, not of timings)."""

import os
import time
from pathlib import Path

from forge.data.rewards import toy_partial_reward
from forge.types import Prompt

MARK_ENV = "MLORA_TEST_RAISED"
"""The file ``raising_reward`` creates before it raises (a path in the reward role's environment)."""


def raising_reward(prompt: Prompt, response_text: str) -> float:
    mark = os.environ.get(MARK_ENV)
    if mark:
        Path(mark).touch()
    raise RuntimeError(f"this run's reward is broken on purpose (prompt {prompt.prompt_id!r})")


def toy_after_the_raise(prompt: Prompt, response_text: str) -> float:
    """The toy reward, once ``raising_reward`` has raised (a bounded wait: at most 300 s)."""
    mark = Path(os.environ[MARK_ENV])
    deadline = time.monotonic() + 300
    while not mark.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{mark} never appeared: the other run's reward never raised")
        time.sleep(0.05)
    return toy_partial_reward(prompt, response_text)
