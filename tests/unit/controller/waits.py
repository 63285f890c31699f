"""Bounded waits for the controller tests.

A regression that stops an answer from coming (a retry that never happens, a queue that never
runs) must fail its test in seconds, with a message saying what never happened, not at
pytest's 300 s timeout. Events are ordered with ``settle`` (run the loop until it is idle) or
``until`` (poll a condition), never with a sleep of a guessed length.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

DEATH_NOTICED_S = 60.0
"""Longest a test waits for a dead process to be reported. Monarch's 1 s supervision poll
notices one in about a second, but on a loaded 2-core CI machine an ``os._exit`` once went
unreported for over 20 s; what these tests check is that the caller is told, not how soon."""


async def bounded(awaitable: Awaitable[Any], what: str, timeout: float = 5.0) -> Any:
    """``await awaitable``; after ``timeout`` seconds the test fails, naming ``what`` it waited for.

    Not ``asyncio.wait_for``: the awaited call may raise a ``TimeoutError`` of its own (forge's
    ``RequestTimeout`` is one), which must reach the test as it is.
    """
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        pytest.fail(f"timed out after {timeout}s waiting for {what}", pytrace=False)
    return task.result()


async def until(predicate: Callable[[], bool], what: str, timeout: float = 5.0, poll: float = 0.01) -> None:
    """Wait until ``predicate()`` holds; after ``timeout`` seconds the test fails, naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}", pytrace=False)
        await asyncio.sleep(poll)


async def until_answer(
    probe: Callable[[], Awaitable[bool]], what: str, timeout: float = 5.0, poll: float = 0.05
) -> None:
    """``until`` for a condition only a call can tell (a replica's own counters): ``await probe()``
    until it is true; after ``timeout`` seconds the test fails, naming ``what``."""
    deadline = time.monotonic() + timeout
    while not await probe():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}", pytrace=False)
        await asyncio.sleep(poll)


async def settle() -> None:
    """Let every task that can run (a dispatcher, callers, batch tasks) run until it blocks."""
    for _ in range(10):
        await asyncio.sleep(0)
