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
import heapq
import inspect
import itertools
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


@dataclass(eq=False)
class _KeyQueue:
    """One key's items, plus its place in the Batcher's ready structures.

    ``epoch`` changes whenever the queue is held back, which voids its entries in the deadline
    heap and the full-queue list at once (they are dropped lazily when they come to the front).
    """

    items: collections.deque = field(default_factory=collections.deque)
    total_size: int = 0
    held: bool = False
    epoch: int = 0

    def drop_done_head(self) -> int:
        """Drop callers at the head that were cancelled (O(1) per dropped item); return how many.

        Cancelled items further back stay until their batch is taken, where they are skipped;
        scanning the whole queue on every look would make a deep queue quadratic.
        """
        dropped = 0
        while self.items and self.items[0].future.done():
            self.total_size -= self.items.popleft().size
            dropped += 1
        return dropped

    def oldest(self) -> float:
        return self.items[0].enqueued_at


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

    Why the ready state lives in a heap and a list: session keys mean thousands of live keys
    with a couple of items each. The dispatcher must find the next ready batch without looking
    at every key, so each queue has one entry in a heap ordered by its first item's deadline
    (which is also the order of first items' ages), and the queues that are full are listed in
    the order they filled. Starting a batch costs O(log keys), not O(keys). Entries are fixed
    lazily: one that points at a queue whose head was taken or cancelled is re-pushed with the
    right deadline when it reaches the top.
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
        # (first item's deadline, tie-break, key, queue, queue epoch): one live entry per queue
        # that is neither empty nor held. The tie-break keeps keys (maybe unorderable) out of
        # the comparison.
        self._deadlines: list[tuple[float, int, Hashable, _KeyQueue, int]] = []
        self._full: collections.OrderedDict[Hashable, tuple[_KeyQueue, int]] = collections.OrderedDict()
        self._held: dict[Hashable, _KeyQueue] = {}  # queues whose key is not runnable yet
        self._tie = itertools.count()
        self._queued = 0  # items in the queues (cancelled ones included until dropped)
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
        now = self._clock()
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _KeyQueue()
            self._push_deadline(key, queue, now + self.spec.max_wait_s)
        queue.items.append(_Pending(item, size, future, now))
        queue.total_size += size
        self._queued += 1
        if queue.total_size >= self.spec.max_size:
            runnable = self._runnable is None or self._runnable(key)
            if queue.held and runnable:
                self._release(key, queue)
            if not queue.held and key not in self._full:
                self._full[key] = (queue, queue.epoch)
            if (self._free_slots > 0 or self._send_full) and runnable:
                # Full with a slot free (or full batches may go past the slots): start it now. In a
                # burst of singletons this sends the first batches before the rest is even queued.
                self._start(key)
        self._ensure_dispatcher()
        self._wakeup.set()
        return future

    def has_forming(self, key: Hashable) -> bool:
        """Whether a batch for ``key`` is waiting for more items (batch-aware routing uses it)."""
        return self.prune(key)

    def prune(self, key: Hashable) -> bool:
        """Drop the cancelled callers at the head of ``key``'s queue, and the queue itself once
        nothing is left in it; returns whether it still holds items. For a key that will never
        run again (a load of a model whose callers all left) this is how its queue goes."""
        queue = self._queues.get(key)
        return queue is not None and self._prune(key, queue)

    @property
    def queued(self) -> int:
        """Items waiting in the queues (O(1): kept as a count)."""
        return self._queued

    @property
    def keys(self) -> list[Hashable]:
        return list(self._queues)

    def wake(self) -> None:
        """Look at the queues again (a key held back by ``runnable`` may now run)."""
        for key, queue in list(self._held.items()):
            if self._runnable is None or self._runnable(key):
                self._release(key, queue)
        self._wakeup.set()

    def fail(self, key: Hashable, error: BaseException) -> None:
        """Fail every queued item of ``key`` with ``error`` and drop its queue."""
        queue = self._queues.get(key)
        if queue is not None:
            self._forget(key)  # its heap entry dies with it (checked by identity)
            self._queued -= len(queue.items)
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
        self._deadlines.clear()
        self._full.clear()
        self._held.clear()
        self._queued = 0
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
                ready_key = self._next_ready(full_only=self._free_slots <= 0)
                if ready_key is _NO_KEY:
                    break
                self._start(ready_key)
            self._wakeup.clear()
            timeout = None  # with no slot free, only a finished batch (or wake) can change anything
            if self._free_slots > 0:
                top = self._deadline_top()
                if top is not None:
                    timeout = max(0.0, top[0] - self._clock())
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _next_ready(self, full_only: bool) -> Hashable:
        """The key to start next, or _NO_KEY (None is a valid key).

        The deadline heap's top holds the oldest first item of all: when it is due (or full) it
        is the oldest ready queue. Otherwise no queue is due, and the ready ones are the full
        ones, in the order they filled. ``full_only``: no slot is free, only a full queue may go
        (see ``send_full``).
        """
        if not full_only:
            top = self._deadline_top()
            if top is not None:
                deadline, _, key, queue, _ = top
                if deadline <= self._clock() or queue.total_size >= self.spec.max_size:
                    return key
        return self._full_front()

    def _push_deadline(self, key: Hashable, queue: _KeyQueue, deadline: float) -> None:
        heapq.heappush(self._deadlines, (deadline, next(self._tie), key, queue, queue.epoch))

    def _live(self, key: Hashable, queue: _KeyQueue, epoch: int) -> bool:
        """Whether a heap or full-list entry still stands for a queue that can run now.

        Drops cancelled callers at the queue's head (``_prune``) and holds the queue back if its
        key is not runnable.
        """
        if self._queues.get(key) is not queue or queue.epoch != epoch:
            return False  # the queue was emptied, failed or held since this entry was made
        if not self._prune(key, queue):
            return False
        if self._runnable is not None and not self._runnable(key):
            self._hold(key, queue)
            return False
        return True

    def _deadline_top(self) -> tuple[float, int, Hashable, _KeyQueue, int] | None:
        """The heap's top once it is exact: live, and with its queue's real first deadline."""
        heap = self._deadlines
        while heap:
            deadline, _, key, queue, epoch = top = heap[0]
            if not self._live(key, queue, epoch):
                heapq.heappop(heap)
                continue
            actual = queue.oldest() + self.spec.max_wait_s
            if actual != deadline:  # its head was taken or cancelled since: re-file it
                heapq.heapreplace(heap, (actual, next(self._tie), key, queue, epoch))
                continue
            return top
        return None

    def _full_front(self) -> Hashable:
        while self._full:
            key, (queue, epoch) = next(iter(self._full.items()))
            if not self._live(key, queue, epoch):
                self._full.pop(key, None)
                continue
            if queue.total_size < self.spec.max_size:  # cancelled items made room: it can grow
                del self._full[key]
                continue
            return key
        return _NO_KEY

    def _hold(self, key: Hashable, queue: _KeyQueue) -> None:
        queue.held = True
        queue.epoch += 1  # voids its heap and full-list entries
        self._full.pop(key, None)
        self._held[key] = queue

    def _release(self, key: Hashable, queue: _KeyQueue) -> None:
        """A held queue may run again: file it in the deadline heap (and the full list)."""
        del self._held[key]
        queue.held = False
        self._push_deadline(key, queue, queue.oldest() + self.spec.max_wait_s)
        if queue.total_size >= self.spec.max_size:
            self._full[key] = (queue, queue.epoch)

    # ------------------------------------------------------- a queue's lifecycle
    # A queue is registered (in ``_queues``) exactly while it holds items: ``enqueue`` creates it
    # with its first item and files its deadline; whatever takes its last item (a batch, a
    # cancelled caller dropped, ``fail``) forgets it in the same step. So an item always lands
    # either in a new queue, which files a deadline, or in a live queue whose deadline entry (or
    # held state, whose release files one) is already there: no empty queue can swallow later items.
    def _prune(self, key: Hashable, queue: _KeyQueue) -> bool:
        """Drop cancelled callers at the head of ``key``'s queue; forget the queue if that
        emptied it. Returns whether it still holds items."""
        self._queued -= queue.drop_done_head()
        if queue.items:
            return True
        self._forget(key)
        return False

    def _forget(self, key: Hashable) -> None:
        """Unregister ``key``'s queue everywhere. Its heap entry is dropped lazily: it no longer
        matches ``_queues`` (by identity)."""
        self._queues.pop(key, None)
        self._full.pop(key, None)
        self._held.pop(key, None)

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
        """Pop one batch off ``key``'s queue. Its heap entry is now early; it is re-filed lazily."""
        queue = self._queues[key]
        batch: list[_Pending] = []
        total = 0
        while queue.items and total + queue.items[0].size <= self.spec.max_size:
            pending = queue.items.popleft()
            queue.total_size -= pending.size
            self._queued -= 1
            if not pending.future.done():  # skip callers cancelled while queued
                total += pending.size
                batch.append(pending)
        if not queue.items:
            self._forget(key)
        elif key in self._full:
            if queue.total_size >= self.spec.max_size:
                self._full.move_to_end(key)  # full again: behind the other full keys
            else:
                del self._full[key]
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
