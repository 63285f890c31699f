"""Argument checks every layer shares, so that the same mistake reads the same everywhere.

``check_int`` refuses what Python would accept by accident: a bool (``True`` is an int), a float
such as 1.5, a string from a config, and anything below the minimum; the message names the
argument, the rule and the value, e.g. ``max_size must be an integer >= 1, got 0``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_int"]


def check_int(name: str, value: Any, minimum: int = 0) -> int:
    """``value`` if it is an integer (not a bool) >= ``minimum``; a ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
