"""A multi-turn toy game that a tiny random-init model learns on a CPU in minutes.

``ReverseWithFeedback``: the toy task's prompt (``"371="``, answer ``"173"``), but the policy
has ``max_guesses`` tries. After each wrong guess the environment marks it position by
position (the right digits stay, the wrong ones become ``x``: guess ``"193"`` gets
``" 1x3="``) and asks again. The final guess is scored with the toy task's partial-credit
reward (``forge.data.rewards.toy``); a fully right guess ends the game at once.

Why it is learnable by a 2-layer model: a later guess can copy the marked digits from the
feedback right before it, and every digit still comes from one prompt position, as in the
single-turn task.
"""

from __future__ import annotations

from forge.checks import check_int
from forge.data.rewards import toy_partial_reward
from forge.envs.base import Action, Environment, StepResult
from forge.types import Prompt

__all__ = ["ReverseWithFeedback"]


def feedback_marks(guess: str, answer: str) -> str:
    """The answer's digits where ``guess`` has them right, ``x`` elsewhere (answer-long)."""
    return "".join(a if i < len(guess) and guess[i] == a else "x" for i, a in enumerate(answer))


class ReverseWithFeedback(Environment):
    """The digit-reversal task over up to ``max_guesses`` turns with per-position feedback."""

    def __init__(self, max_guesses: int = 3) -> None:
        check_int("max_guesses", max_guesses, 1)
        self.max_guesses = max_guesses
        self.prompt: Prompt | None = None

    async def reset(self, prompt: Prompt) -> str:
        if not prompt.answer:
            raise ValueError(f"prompt {prompt.prompt_id!r} has no answer to play against")
        self.prompt = prompt
        return prompt.text

    async def step(self, action: Action) -> StepResult:
        assert self.prompt is not None, "step before reset"
        words = action.text.split()
        guess = words[0] if words else ""
        answer = self.prompt.answer
        last = action.turn + 1 >= self.max_guesses
        if guess == answer or last:
            return StepResult("", toy_partial_reward(self.prompt, action.text), done=True)
        return StepResult(f" {feedback_marks(guess, answer)}=", 0.0, done=False)
