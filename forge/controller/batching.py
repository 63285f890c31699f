"""Prebatching: singleton requests in, one batch per endpoint invocation out.

``Batching`` is the contract an endpoint declares; ``Batcher`` is the engine a replica runs for
each batched endpoint. The contract, clause by clause (each has a test):

- A batch holds at most ``max_size`` items (or, with ``size_fn``, items whose sizes sum to at
  most ``max_size``; an item larger than that alone fails at once, for its caller only).
- The wait is timed from a batch's *first* item: a batch is ready when full or when its first
  item has waited ``max_wait_s``.
- A batch is *closed* only when an execution slot (``max_concurrent_batches``) is free, so while
  the slots are busy the forming batch keeps growing instead of queueing half-empty batches.
  With ``send_full=True`` a batch that is full (it cannot grow) starts even when the slots are
  taken: the replica uses it for endpoints whose actor runs one message at a time, where the
  batch then waits in the actor's mailbox instead of in the controller.
- One queue per batch key: items of different keys never share a batch; a queue that runs
  empty is removed, so keys cost nothing once idle. Through a service an item's batch key is
  ``route(..., batch_key=)``, else ``Batching.key(item)``, else None (one queue for all); it
  never routes.
- A key's queue can be held back (``runnable(key)`` is False, e.g. its model is loading): it
  keeps growing, and the other keys use the slots meanwhile.
- Callers cancelled before their batch runs are dropped from it; if all are, nothing runs.
- The executor must return one result per item. A wrong count or type fails every caller of
  that batch with ``BatchResultError``; an ``Exception`` instance in one slot fails only that
  caller; an exception from the executor fails every caller of that batch. None of these stop
  the batcher.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from forge.checks import check_int
from forge.controller.batch_queues import NO_KEY, KeyQueues, Pending
from forge.controller.errors import BatchResultError, ServiceStopped

logger = logging.getLogger("forge.batching")

Enbatch = Callable[[list[Any]], Any]
Debatch = Callable[[Any, int], Sequence[Any]]


@dataclass(frozen=True)
class Batching:
    """How a batched endpoint's singleton requests are grouped before they reach the actor.

    Example::

        @endpoint(batch=Batching(max_size=16, max_wait_s=0.01, key=lambda req: len(req) // 32))
        async def logprobs(self, requests: list[Request]) -> list[Tensor]: ...
    """

    max_size: int = 32
    """Most items in one batch; with ``size_fn``, the most total size (e.g. tokens)."""
    max_wait_s: float = 0.005
    """Longest a batch's first item waits for company before the batch is ready."""
    max_concurrent_batches: int = 1
    """Batches of this endpoint that may run at once on one replica (its execution slots)."""
    size_fn: Callable[[Any], int] | None = None
    """Size of one item (e.g. its token count); batches are then limited by total size."""
    key: Callable[[Any], Hashable] | None = None
    """Batch key of an item whose caller names none (``route(..., batch_key=)``): only equal keys
    share a batch. It picks the queue on the replica, never the replica."""
    enbatch: Enbatch | str | None = None
    """Builds the one payload sent to the actor from the list of items (e.g. pads token lists
    into one tensor). A string names a static/class method of the actor class. Default: the
    list itself."""
    debatch: Debatch | str | None = None
    """Splits the endpoint's result back into one result per item: ``debatch(result, n)``.
    A string names a static/class method of the actor class. Default: the result is a list."""

    def __post_init__(self) -> None:
        check_int("Batching.max_size", self.max_size, 1)
        if isinstance(self.max_wait_s, bool) or not isinstance(self.max_wait_s, (int, float)) or self.max_wait_s < 0:
            raise ValueError(f"Batching.max_wait_s must be a number of seconds >= 0, got {self.max_wait_s!r}")
        mcb = self.max_concurrent_batches
        check_int("Batching.max_concurrent_batches", mcb, 1)
        for name in ("size_fn", "key"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"Batching.{name} must be a callable or None, got {value!r}")
        for name in ("enbatch", "debatch"):
            value = getattr(self, name)
            if value is not None and not (callable(value) or isinstance(value, str)):
                raise TypeError(f"Batching.{name} must be a callable, a method name or None, got {value!r}")

    def resolve_assembly(self, actor_cls: type) -> tuple[Enbatch | None, Debatch | None]:
        """The enbatch/debatch callables, with method names looked up on ``actor_cls``."""

        def lookup(name: str, value: Any) -> Any:
            if not isinstance(value, str):
                return value
            fn = getattr(actor_cls, value, None)
            if fn is None or not callable(fn):
                raise TypeError(
                    f"Batching.{name}={value!r}: {actor_cls.__name__} has no static or class method named {value!r}"
                )
            return fn

        return lookup("enbatch", self.enbatch), lookup("debatch", self.debatch)


@dataclass
class BatchStats:
    """Running totals a replica reports in ``Service.metrics()`` (sums only: the service adds
    replicas up and computes the means)."""

    requests: int = 0
    batches: int = 0
    items_batched: int = 0
    max_batch_size: int = 0
    queue_wait_s_total: float = 0.0
    errors: int = 0


class Batcher:
    """Async queue that accepts single items and runs them through ``execute`` in batches.

    ``execute(items, key)`` is called with at most ``spec.max_size`` items of one key and must
    return (an awaitable of) one result per item. It is called synchronously when the batch
    starts, so an executor that sends its message when called sends it at once. A replica owns one
    ``Batcher`` per batched endpoint; tests drive it with a plain coroutine.

    The queues and the order in which they become ready (a deadline heap and a list of full
    queues, O(log keys) per batch whatever the number of live keys) are ``KeyQueues``
    (``forge.controller.batch_queues``); the Batcher owns the execution slots, the dispatcher
    task and the results.
    """

    def __init__(
        self,
        spec: Batching,
        execute: Callable[[list[Any], Hashable], Awaitable[Sequence[Any]]],
        *,
        name: str = "batcher",
        clock: Callable[[], float] = time.monotonic,
        runnable: Callable[[Hashable], bool] | None = None,
        send_full: bool = False,
    ) -> None:
        """``runnable(key)``, if given, holds back a key's queue while it returns False (the
        queue keeps growing; e.g. a multiplexed model that is still loading). Call ``wake()``
        when it may have turned True."""
        self.spec = spec
        self.name = name
        self.stats = BatchStats()
        self._execute = execute
        self._clock = clock
        self._queues = KeyQueues(spec.max_size, spec.max_wait_s, clock, runnable)
        self._free_slots = spec.max_concurrent_batches  # below 0 while full batches run past the slots
        self._send_full = send_full
        self._wakeup = asyncio.Event()
        self._running: set[asyncio.Task] = set()
        self._dispatcher: asyncio.Task | None = None
        self._closed: BaseException | None = None

    # ----------------------------------------------------------------- public
    async def submit(self, item: Any, key: Hashable = None) -> Any:
        """Queue one item and wait for its own result."""
        return await self.enqueue(item, key)

    def enqueue(self, item: Any, key: Hashable = None) -> asyncio.Future:
        """Queue one item under ``key`` (None: ``spec.key(item)`` if the spec has one); the
        returned future resolves to its own result.

        Synchronous on purpose: enqueueing costs no task, and cancelling the future drops
        the item from its batch.
        """
        if self._closed is not None:
            raise self._closed
        self.stats.requests += 1
        try:
            if key is None and self.spec.key is not None:
                key = self.spec.key(item)
            size = int(self.spec.size_fn(item)) if self.spec.size_fn is not None else 1
        except Exception as exc:
            self.stats.errors += 1
            raise BatchResultError(f"{self.name}: the batching key/size function failed on this item: {exc!r}") from exc
        if size > self.spec.max_size:
            self.stats.errors += 1
            raise BatchResultError(
                f"{self.name}: item of size {size} can never fit a batch of max_size={self.spec.max_size}"
            )
        future = asyncio.get_running_loop().create_future()
        full = self._queues.add(key, Pending(item, size, future, self._clock()))
        if full and (self._free_slots > 0 or self._send_full):
            # Full with a slot free (or full batches may go past the slots): start it now. In a
            # burst of singletons this sends the first batches before the rest is even queued.
            self._start(key)
        self._ensure_dispatcher()
        self._wakeup.set()
        return future

    def has_forming(self, key: Hashable) -> bool:
        """Whether a batch for ``key`` is waiting for more items (batch-aware routing uses it)."""
        return self._queues.prune(key)

    def prune(self, key: Hashable) -> bool:
        """Drop the cancelled callers at the head of ``key``'s queue, and the queue itself once
        nothing is left in it; returns whether it still holds items. For a key that will never
        run again (a load of a model whose callers all left) this is how its queue goes."""
        return self._queues.prune(key)

    @property
    def queued(self) -> int:
        """Items waiting in the queues (O(1): kept as a count)."""
        return self._queues.queued

    @property
    def keys(self) -> list[Hashable]:
        return self._queues.keys()

    def wake(self) -> None:
        """Look at the queues again (a key held back by ``runnable`` may now run)."""
        self._queues.release_runnable()
        self._wakeup.set()

    def fail(self, key: Hashable, error: BaseException) -> None:
        """Fail every queued item of ``key`` with ``error`` and drop its queue."""
        for pending in self._queues.remove(key):
            if not pending.future.done():
                self.stats.errors += 1
                pending.future.set_exception(error)

    async def close(self, error: BaseException | None = None) -> None:
        """Fail every queued and running item with ``error`` and stop the dispatcher."""
        self._closed = error or ServiceStopped(f"{self.name}: the batcher was closed")
        _fail_all(self._queues.clear(), self._closed)
        tasks = [t for t in (self._dispatcher, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---------------------------------------------------------------- engine
    def _ensure_dispatcher(self) -> None:
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch(), name=f"{self.name}-dispatch")

    async def _dispatch(self) -> None:
        """Start each batch as soon as it is ready and a slot is free; forever."""
        while True:
            while self._free_slots > 0 or self._send_full:
                ready_key = self._queues.next_ready(full_only=self._free_slots <= 0)
                if ready_key is NO_KEY:
                    break
                self._start(ready_key)
            self._wakeup.clear()
            timeout = None  # with no slot free, only a finished batch (or wake) can change anything
            if self._free_slots > 0:
                deadline = self._queues.next_deadline()
                if deadline is not None:
                    timeout = max(0.0, deadline - self._clock())
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _start(self, key: Hashable) -> None:
        """Take a batch of ``key`` into a free slot and hand it to the executor now.

        The executor is called synchronously: one that sends its message when called (the
        replica's does) puts the batch on the wire before this returns.
        """
        live = self._queues.take(key)
        if not live:
            return
        now = self._clock()
        self.stats.batches += 1
        self.stats.items_batched += len(live)
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(live))
        self.stats.queue_wait_s_total += sum(now - p.enqueued_at for p in live)
        try:
            pending_result = self._execute([p.item for p in live], key)
        except Exception as exc:
            self.stats.errors += len(live)
            _fail_all(live, exc)
            return
        self._free_slots -= 1
        task = asyncio.get_running_loop().create_task(self._run(live, pending_result), name=f"{self.name}-batch")
        self._running.add(task)
        # The cleanup is a done-callback, not a ``finally`` in ``_run``: a task cancelled before its
        # first step (closed in the tick it started) never enters ``_run``, and its callers would wait
        # forever.
        task.add_done_callback(functools.partial(self._batch_done, live, pending_result))

    async def _run(self, live: list[Pending], pending_result: Awaitable[Sequence[Any]]) -> None:
        """Wait for one batch's results and give each caller its own."""
        try:
            results = await pending_result
        except Exception as exc:
            self.stats.errors += len(live)
            _fail_all(live, exc)
        else:
            self._deliver(live, results)

    def _batch_done(self, live: list[Pending], pending_result: Awaitable[Sequence[Any]], task: asyncio.Task) -> None:
        """A batch task ended, however: fail its callers if it was cancelled, then free its slot."""
        self._running.discard(task)
        if task.cancelled():  # closed while the batch ran, or before it began
            _fail_all(live, self._closed or ServiceStopped(f"{self.name}: batch cancelled"))
        if inspect.iscoroutine(pending_result):
            pending_result.close()  # never awaited if the task was cancelled before its first step
        self._free_slots += 1
        self._wakeup.set()

    def _deliver(self, live: list[Pending], results: Any) -> None:
        """One result per caller, in order; an ``Exception`` in a slot fails only its caller."""
        if not isinstance(results, (list, tuple)) or len(results) != len(live):
            got = (
                f"{type(results).__name__} of length {len(results)}"
                if isinstance(results, (list, tuple))
                else type(results).__name__
            )
            self.stats.errors += len(live)
            error = BatchResultError(
                f"{self.name}: a batch of {len(live)} items must return a list of {len(live)} results, got {got}"
            )
            _fail_all(live, error)
            return
        for pending, result in zip(live, results):
            if pending.future.done():
                continue
            if isinstance(result, BaseException):
                self.stats.errors += 1
                pending.future.set_exception(result)
            else:
                pending.future.set_result(result)


def _fail_all(batch: list[Pending], exc: BaseException) -> None:
    for pending in batch:
        if not pending.future.done():
            pending.future.set_exception(exc)
