"""A reward that always raises: the broken run of the multi-adapter crash-isolation test."""

from forge.types import Prompt


def raising_reward(prompt: Prompt, response_text: str) -> float:
    raise RuntimeError(f"this run's reward is broken on purpose (prompt {prompt.prompt_id!r})")
