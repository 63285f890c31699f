"""Slurm's hostlist expressions (``n[1-2]``, ``gpu[01-03,7]``, ``a,b``) expanded to node names.

Slurm reports a job's nodes as one compressed expression (``squeue``'s ``nodes``,
``$SLURM_JOB_NODELIST``), in the order it numbers them (``$SLURM_NODEID``). forge needs the
names one by one, in that order, to know which worker is which node, and ``scontrol show
hostnames`` may not be on the controller's machine, so the expansion lives here.
"""

from __future__ import annotations

import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand(expression: str) -> list[str]:
    """The node names of a hostlist expression, in Slurm's order.

    ``"n[1-2]"`` -> ``["n1", "n2"]``; ``"n[01-03,7]"`` -> ``["n01", "n02", "n03", "n7"]``;
    ``"a,b"`` -> ``["a", "b"]``; ``""`` -> ``[]``. A zero-padded bound keeps its width (each part
    of a bracket its own, as ``scontrol show hostnames`` does). Several
    bracket groups in one name (``r[1-2]n[1-2]``) expand like Slurm's, the last one fastest.
    Raises ``ValueError`` naming the expression when it is not one.
    """
    if not isinstance(expression, str):
        raise ValueError(f"a hostlist expression must be a string like 'n[1-2]', got {expression!r}")
    names: list[str] = []
    for item in _split_top_level(expression.strip(), expression):
        names.extend(_expand_item(item, expression))
    return names


def _split_top_level(text: str, whole: str) -> list[str]:
    """``text`` cut at the commas outside brackets; empty pieces are an error."""
    if not text:
        return []
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"hostlist {whole!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {whole!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"hostlist {whole!r}: '[' is never closed")
    items.append(text[start:])
    if any(not item.strip() for item in items):
        raise ValueError(f"hostlist {whole!r}: an empty name between commas")
    return [item.strip() for item in items]


def _expand_item(item: str, whole: str) -> list[str]:
    """One comma-free name with zero or more bracket groups, expanded."""
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = _expand_item(rest, whole) if rest else [""]
    return [f"{prefix}{number}{tail}" for number in _numbers(body, whole) for tail in tails]


def _numbers(body: str, whole: str) -> list[str]:
    """The numbers of one bracket group (``01-03,7``), as strings of their written width."""
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"hostlist {whole!r}: {part!r} is not a number or a range like 1-4")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"hostlist {whole!r}: range {part!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers
