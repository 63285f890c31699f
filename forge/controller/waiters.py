"""The tasks waiting for one replica's answers, and one timer for all their deadlines.

A replica's callers wait with its ``call_timeout_s`` unless they name their own. Arming and
cancelling an ``asyncio.timeout`` for every message costs a timer handle per call, a share of
a plain route's overhead over Monarch's own ``call_one`` (``benchmarks/service_overhead.py``).
Waits with the usual timeout expire in the order they began, so one timer set for the oldest
of them covers all: when it fires it fails the waits that are due, then waits for the next.
A wait with a timeout of its own keeps its own timer (``asyncio.timeout``).

A task is registered while it waits, so that the replica can stop every wait at once when it
fails (``cancel_all``) instead of leaving them to a timeout for answers that will never come.
"""

from __future__ import annotations

import asyncio
import time

TIMED_OUT = "forge: no answer within the timeout"
"""The cancel message of a wait that is past its deadline."""


class Waiters:
    """Tasks waiting for answers; those on the usual timeout share one timer."""

    __slots__ = ("usual_timeout", "_deadlines", "_timer")

    def __init__(self, usual_timeout: float | None) -> None:
        self.usual_timeout = usual_timeout
        self._deadlines: dict[asyncio.Task, float | None] = {}
        """Each waiting task and its deadline on ``time.monotonic`` (None: timed elsewhere, or never);
        in the order they began, so the deadlines that are not None are in order too."""
        self._timer: asyncio.TimerHandle | None = None

    def add(self, task: asyncio.Task, timeout: float | None) -> bool:
        """Register ``task``; whether the caller must time the wait itself. A wait on the usual
        timeout is timed here: cancelled with ``TIMED_OUT`` at its deadline."""
        if timeout is None or timeout != self.usual_timeout:
            self._deadlines[task] = None
            return timeout is not None
        self._deadlines[task] = time.monotonic() + timeout
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)
        return False

    def discard(self, task: asyncio.Task) -> None:
        self._deadlines.pop(task, None)

    def cancel_all(self, message: str) -> None:
        """Stop every wait (``task.cancel(msg=message)``)."""
        for task in list(self._deadlines):
            task.cancel(msg=message)

    def __len__(self) -> int:
        return len(self._deadlines)

    def _expire(self) -> None:
        """Fail the waits that are due; set the timer for the next deadline, if any."""
        self._timer = None
        now = time.monotonic()
        for task, deadline in list(self._deadlines.items()):
            if deadline is None:
                continue
            if deadline > now:
                self._timer = asyncio.get_running_loop().call_later(deadline - now, self._expire)
                return
            del self._deadlines[task]  # cancelled once, even if it runs only after the next sweep
            task.cancel(msg=TIMED_OUT)
