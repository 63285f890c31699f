"""The toy reward, taking a while per response, as a learned reward model does.

The tiny run trains a step in about 0.1 s, so a fault test that kills a role "at step 2" races
the run's end: a test process slowed by a loaded machine looks again after the last step was
trained, and the kill meets a run that no longer needs the role. With each response scored in
``SLOW_REWARD_S`` seconds (in the reward role's process), a step takes most of a second, and the
kill lands while the run still needs the role. ``OVERRIDES`` puts it in a run's config."""

from __future__ import annotations

import time

from forge.data.rewards import toy_partial_reward
from forge.types import Prompt

SLOW_REWARD_S = 0.05
"""Seconds per response by default: 4 prompts x 4 samples make a step of 0.8 s at least."""


OVERRIDES = ('reward.fns={"tests.integration.slow_reward:slow_toy": 1.0}',)
"""The app's overrides that score with ``slow_toy`` instead of ``toy``."""


def slow_toy(prompt: Prompt, response_text: str) -> float:
    """``toy_partial_reward`` after ``SLOW_REWARD_S`` seconds (a blocking wait, as a model's
    forward pass in the reward process blocks)."""
    time.sleep(SLOW_REWARD_S)
    return toy_partial_reward(prompt, response_text)
