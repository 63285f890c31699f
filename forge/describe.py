"""``describe``: the one way forge turns an error into a line of text for a message or a log.

It lives outside ``forge.controller`` so that modules that must not start Monarch (the
config loader) use the same helper.
"""

from __future__ import annotations

from typing import Any


def describe(error: Any, limit: int = 500, typed: bool = False) -> str:
    """One line saying what went wrong, for messages and logs.

    The text is a Monarch ``MeshFailure``'s ``report()`` or else ``str(error)``. Its first line,
    plus the lines after it while a line ends with ``:``: Monarch's reports open with a heading
    ("The actor ... and all its descendants have failed:") and give the cause on the next line
    ("the process this actor was running on failed: Killed(sig=9)"), while the lines after the
    cause repeat it. An empty text gives the type's name; ``typed`` puts the type's name first
    (``"ReplicaFailed: ..."``) for readers who cannot see the exception object.
    """
    report = getattr(error, "report", None)
    try:
        text = str(report()) if callable(report) else str(error)
    except Exception:  # a report that fails to render still names the error
        text = repr(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__[:limit]
    end = 1
    while end < len(lines) and lines[end - 1].endswith(":"):
        end += 1
    line = " ".join(lines[:end])
    return (f"{type(error).__name__}: {line}" if typed else line)[:limit]
