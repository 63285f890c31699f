"""Reward functions and their registry.

A reward function is ``fn(prompt, response_text) -> float`` in ``[0, 1]``. It is pure and
cheap so the reward actor can score a whole batch of completions in one call; it reads what
it needs from ``prompt.answer`` (and ``prompt.meta`` if it must). Functions are registered by
name so a config can pick one (``reward: gsm8k``) without importing code.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from forge.types import Prompt

RewardFn = Callable[[Prompt, str], float]

_REGISTRY: dict[str, RewardFn] = {}


class UnknownRewardError(KeyError):
    """``get_reward`` was asked for a name nobody registered."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register the decorated function as reward ``name``; a second use of a name is an error.

    Refusing duplicates (rather than overwriting) keeps two modules from silently fighting over
    one name; the function is returned unchanged so it can still be called directly.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(
                f"reward {name!r} is already registered (by {_REGISTRY[name].__module__}."
                f"{_REGISTRY[name].__qualname__}); choose another name"
            )
        _REGISTRY[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownRewardError(
            f"unknown reward {name!r}; known rewards: {', '.join(list_rewards()) or '(none)'}"
        ) from None


def list_rewards() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(_REGISTRY)


# ---------------------------------------------------------------------------------------------
# Built-in rewards


def _first_word(text: str) -> str:
    """The response's answer: its first whitespace-separated word ('' if none).

    A tiny model may have no end-of-sequence token, so a space (or newline) ends the answer;
    what follows it is ignored.
    """
    words = text.split()
    return words[0] if words else ""


@register_reward("toy")
def toy_partial_reward(prompt: Prompt, response_text: str) -> float:
    """Partial credit for the toy task: 0.9 for per-position characters, 0.1 for the length.

    ``0.9 * (#positions i < n with word[i] == answer[i]) / n + 0.1 * (len(word) == n)`` where
    ``word`` is the response's first word and ``n = len(answer)``. Position-wise credit gives a
    random model small but varied rewards, so groups have nonzero advantages from the start;
    the length bonus teaches the model to stop. Credit is positional (not edit distance) on
    purpose: with edit distance a model learned to pad the answer with junk in front and
    stalled at 0.5. A constant answer matches each position with probability 1/10: ~0.19.
    """
    answer = prompt.answer
    if not answer:
        raise ValueError(f"prompt {prompt.prompt_id!r} has an empty answer; the toy reward needs one")
    word = _first_word(response_text)
    n = len(answer)
    matches = sum(a == b for a, b in zip(answer, word[:n]))
    return 0.9 * matches / n + 0.1 * float(len(word) == n)


@register_reward("exact_match")
def exact_match_reward(prompt: Prompt, response_text: str) -> float:
    """1.0 when the response equals the answer after trimming surrounding whitespace, else 0.0."""
    return float(response_text.strip() == prompt.answer.strip())


# A number as written in GSM8K text: thousands separators and decimals ("1,234.5"), or a bare
# decimal (".5"). A minus sign counts only where it cannot be a dash or a range: "between 10-12"
# holds 10 and 12, not -12.
_UNSIGNED = r"(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"
_ANY_NUMBER = re.compile(r"(?:(?<![\w.)])-)?" + _UNSIGNED)
# The marker's answer is the first number after "####", past markdown emphasis ("**72**") and a
# dollar sign on either side of the sign ("-$3", "$-3"). What follows it ("(48+24)") is ignored.
_HASH_ANSWER = re.compile(r"####[\s*_]*(-)?\s*\$?\s*(-)?\s*(" + _UNSIGNED + ")")


def _normalise(sign: str, digits: str) -> str:
    """``sign`` + ``digits`` without thousands separators and with a leading zero (".5" -> "0.5")."""
    digits = digits.replace(",", "")
    if digits.startswith("."):
        digits = "0" + digits
    return sign + digits


def extract_final_number(text: str) -> str | None:
    """The final numeric answer of a GSM8K-style text, normalised, or ``None``.

    The number right after the last ``####`` marker wins; without a marker, the last number in
    the text (so "... so the answer is $42." gives "42"). Normalised: no commas, a leading zero
    for a bare decimal, a sign only where it is one (``#### -$3`` gives "-3"; the "-" of
    "10-12" is a range, so that text gives "12").
    """
    marked = _HASH_ANSWER.findall(text)
    if marked:
        sign_before, sign_after, digits = marked[-1]
        return _normalise(sign_before or sign_after, digits)
    numbers = _ANY_NUMBER.findall(text)
    if not numbers:
        return None
    last = numbers[-1]
    return _normalise("-", last[1:]) if last.startswith("-") else _normalise("", last)


@register_reward("gsm8k")
def gsm8k_reward(prompt: Prompt, response_text: str) -> float:
    """1.0 when the response's final number equals the reference's, else 0.0.

    Both sides go through ``extract_final_number``, so ``prompt.answer`` may be a full GSM8K
    solution ("... #### 42") or the bare number; "42", "42.0" and "#### 42" all match 42.
    A reference without any number is a data error and raises.
    """
    reference = extract_final_number(prompt.answer)
    if reference is None:
        raise ValueError(
            f"prompt {prompt.prompt_id!r}: no number in its answer {prompt.answer[-80:]!r}; "
            "gsm8k needs '#### <number>' or a trailing number"
        )
    predicted = extract_final_number(response_text)
    if predicted is None:
        return 0.0
    return float(math.isclose(float(predicted), float(reference), rel_tol=1e-9, abs_tol=1e-9))
