"""``DrainGate``: the sampling calls in flight, and the hold a draining weight update puts on new ones.

Sampling calls run concurrently (the policy's endpoints, ``AsyncVllmEngine.generate``). An update
that drains must wait for the calls in flight to finish before it loads, and meanwhile hold the
calls that arrive: otherwise a steady stream of them could keep it waiting forever, and they would
sample the old version. The sampling calls enter through ``calling()``, the updates through
``draining()``, one update at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["DrainGate"]


class DrainGate:
    """Counts the sampling calls in flight; ``draining()`` holds new ones until the calls in
    flight finished and the update inside it is done."""

    def __init__(self) -> None:
        self.in_flight = 0
        """Sampling calls running now."""
        self.held = 0
        """Sampling calls waiting for a draining update to finish."""
        self._drained = asyncio.Event()
        self._drained.set()
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._updating = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def calling(self) -> AsyncIterator[None]:
        """One sampling call: held while an update drains, then counted until it returns."""
        if not self._admitting.is_set():
            self.held += 1
            try:
                await self._admitting.wait()
            finally:
                self.held -= 1
        self.in_flight += 1
        self._drained.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._drained.set()

    @contextlib.asynccontextmanager
    async def draining(self) -> AsyncIterator[None]:
        """Hold new calls, wait for those in flight, run the body (the load), let the held ones in."""
        async with self._updating:
            self._admitting.clear()
            try:
                await self._drained.wait()
                yield
            finally:
                self._admitting.set()
