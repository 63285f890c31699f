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
- One queue per key: items of different keys never share a batch; a queue that runs empty is
  removed, so keys cost nothing once idle.
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
import collections
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from forge.controller.errors import BatchResultError, ServiceStopped

logger = logging.getLogger("forge.batching")

_NO_KEY = object()
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
    """Batching key of an item when the caller gives none: only equal keys share a batch."""
    enbatch: Enbatch | str | None = None
    """Builds the one payload sent to the actor from the list of items (e.g. pads token lists
    into one tensor). A string names a static/class method of the actor class. Default: the
    list itself."""
    debatch: Debatch | str | None = None
    """Splits the endpoint's result back into one result per item: ``debatch(result, n)``.
    A string names a static/class method of the actor class. Default: the result is a list."""

    def __post_init__(self) -> None:
        if isinstance(self.max_size, bool) or not isinstance(self.max_size, int) or self.max_size < 1:
            raise ValueError(f"Batching.max_size must be an integer >= 1, got {self.max_size!r}")
        if isinstance(self.max_wait_s, bool) or not isinstance(self.max_wait_s, (int, float)) or self.max_wait_s < 0:
            raise ValueError(f"Batching.max_wait_s must be a number of seconds >= 0, got {self.max_wait_s!r}")
        mcb = self.max_concurrent_batches
        if isinstance(mcb, bool) or not isinstance(mcb, int) or mcb < 1:
            raise ValueError(f"Batching.max_concurrent_batches must be an integer >= 1, got {mcb!r}")
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
class _Pending:
    item: Any
    size: int
    future: asyncio.Future
    enqueued_at: float


@dataclass
class _KeyQueue:
    items: collections.deque = field(default_factory=collections.deque)
    total_size: int = 0

    def drop_done_head(self) -> None:
        """Drop callers at the head that were cancelled (O(1) per dropped item).

        Cancelled items further back stay until their batch is taken, where they are skipped;
        scanning the whole queue on every look would make a deep queue quadratic.
        """
        while self.items and self.items[0].future.done():
            self.total_size -= self.items.popleft().size

    def oldest(self) -> float:
        return self.items[0].enqueued_at


@dataclass
class BatchStats:
    """Running totals a replica reports in ``Service.metrics()``."""

    requests: int = 0
    batches: int = 0
    items_batched: int = 0
    max_batch_size: int = 0
    queue_wait_s_total: float = 0.0
    errors: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "batches": self.batches,
            "mean_batch_size": self.items_batched / self.batches if self.batches else 0.0,
            "max_batch_size": self.max_batch_size,
            "mean_queue_wait_s": self.queue_wait_s_total / self.items_batched if self.items_batched else 0.0,
            "errors": self.errors,
        }


class Batcher:
    """Async queue that accepts single items and runs them through ``execute`` in batches.

    ``execute(items, key)`` is called with at most ``spec.max_size`` items of one key and must
    return (an awaitable of) one result per item. It is called synchronously when the batch
    starts, so an executor that sends its message when called sends it at once. A replica owns one
    ``Batcher`` per batched endpoint; tests drive it with a plain coroutine.
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
        self._runnable = runnable
        self._queues: dict[Hashable, _KeyQueue] = {}
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
        """Queue one item; the returned future resolves to its own result.

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
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _KeyQueue()
        queue.items.append(_Pending(item, size, future, self._clock()))
        queue.total_size += size
        if (
            (self._free_slots > 0 or self._send_full)
            and queue.total_size >= self.spec.max_size
            and (self._runnable is None or self._runnable(key))
        ):
            # Full with a slot free (or full batches may go past the slots): start it now. In a
            # burst of singletons this sends the first batches before the rest is even queued.
            self._start(key)
        self._ensure_dispatcher()
        self._wakeup.set()
        return future

    def has_forming(self, key: Hashable) -> bool:
        """Whether a batch for ``key`` is waiting for more items (batch-aware routing uses it)."""
        queue = self._queues.get(key)
        if queue is None:
            return False
        queue.drop_done_head()
        return bool(queue.items)

    @property
    def queued(self) -> int:
        return sum(len(q.items) for q in self._queues.values())

    @property
    def keys(self) -> list[Hashable]:
        return list(self._queues)

    def wake(self) -> None:
        """Look at the queues again (a key held back by ``runnable`` may now run)."""
        self._wakeup.set()

    def fail(self, key: Hashable, error: BaseException) -> None:
        """Fail every queued item of ``key`` with ``error`` and drop its queue."""
        queue = self._queues.pop(key, None)
        if queue is not None:
            for pending in queue.items:
                if not pending.future.done():
                    self.stats.errors += 1
                    pending.future.set_exception(error)

    async def close(self, error: BaseException | None = None) -> None:
        """Fail every queued and running item with ``error`` and stop the dispatcher."""
        self._closed = error or ServiceStopped(f"{self.name}: the batcher was closed")
        for queue in self._queues.values():
            for pending in queue.items:
                if not pending.future.done():
                    pending.future.set_exception(self._closed)
        self._queues.clear()
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
            next_deadline = None
            if self._free_slots > 0 or self._send_full:
                ready_key, next_deadline = self._ready(full_only=self._free_slots <= 0)
                if ready_key is not _NO_KEY:
                    self._start(ready_key)
                    continue
            self._wakeup.clear()
            timeout = None if next_deadline is None else max(0.0, next_deadline - self._clock())
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _ready(self, full_only: bool = False) -> tuple[Hashable, float | None]:
        """The ready key whose first item is oldest (or _NO_KEY), and the next deadline.
        ``full_only``: only a full queue is ready (no slot is free; see ``send_full``)."""
        now = self._clock()
        ready_key: Hashable = _NO_KEY  # None is a valid key
        next_deadline = None
        for key in list(self._queues):
            queue = self._queues[key]
            queue.drop_done_head()
            if not queue.items:
                del self._queues[key]  # idle queues go away
                continue
            if self._runnable is not None and not self._runnable(key):
                continue  # held back: it keeps growing until wake()
            deadline = queue.oldest() + self.spec.max_wait_s
            if queue.total_size >= self.spec.max_size or (deadline <= now and not full_only):
                if ready_key is _NO_KEY or queue.oldest() < self._queues[ready_key].oldest():
                    ready_key = key
            elif not full_only and (next_deadline is None or deadline < next_deadline):
                next_deadline = deadline
        return ready_key, next_deadline

    def _start(self, key: Hashable) -> None:
        """Take a batch of ``key`` into a free slot and hand it to the executor now.

        The executor is called synchronously: one that sends its message when called (the
        replica's does) puts the batch on the wire before this returns.
        """
        live = self._take(key)
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
        task.add_done_callback(self._running.discard)

    def _take(self, key: Hashable) -> list[_Pending]:
        queue = self._queues[key]
        batch: list[_Pending] = []
        total = 0
        while queue.items and total + queue.items[0].size <= self.spec.max_size:
            pending = queue.items.popleft()
            queue.total_size -= pending.size
            if not pending.future.done():  # skip callers cancelled while queued
                total += pending.size
                batch.append(pending)
        if not queue.items:
            del self._queues[key]
        return batch

    async def _run(self, live: list[_Pending], pending_result: Awaitable[Sequence[Any]]) -> None:
        try:
            try:
                results = await pending_result
            except Exception as exc:
                self.stats.errors += len(live)
                _fail_all(live, exc)
                return
            if not isinstance(results, (list, tuple)) or len(results) != len(live):
                got = (
                    f"{type(results).__name__} of length {len(results)}"
                    if isinstance(results, (list, tuple))
                    else type(results).__name__
                )
                self.stats.errors += len(live)
                _fail_all(
                    live,
                    BatchResultError(
                        f"{self.name}: a batch of {len(live)} items must return a list of {len(live)} results, "
                        f"got {got}"
                    ),
                )
                return
            for pending, result in zip(live, results):
                if pending.future.done():
                    continue
                if isinstance(result, BaseException):
                    self.stats.errors += 1
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)
        except asyncio.CancelledError:
            _fail_all(live, self._closed or ServiceStopped(f"{self.name}: batch cancelled"))
            raise
        finally:
            if inspect.iscoroutine(pending_result):
                pending_result.close()  # never awaited if we were cancelled first
            self._free_slots += 1
            self._wakeup.set()


def _fail_all(batch: list[_Pending], exc: BaseException) -> None:
    for pending in batch:
        if not pending.future.done():
            pending.future.set_exception(exc)
