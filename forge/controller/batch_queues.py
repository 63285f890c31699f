"""The ``Batcher``'s queues, one per key, and the order in which they become ready.

This is the Batcher's bookkeeping, kept apart from its engine (``forge.controller.batching``):
which queue holds which items, and which one runs next. It is synchronous and has no slots,
tasks or executor; the Batcher asks it for the next ready key and takes a batch off it.

Why the ready state lives in a heap and a list: session keys mean thousands of live keys
with a couple of items each. The dispatcher must find the next ready batch without looking
at every key, so each queue has one entry in a heap ordered by its first item's deadline
(which is also the order of first items' ages), and the queues that are full are listed in
the order they filled. Starting a batch costs O(log keys), not O(keys). Entries are fixed
lazily: one that points at a queue whose head was taken or cancelled is re-pushed with the
right deadline when it reaches the top. A queue's ``epoch`` changes whenever it is held back,
which voids its heap and full-list entries at once.

A queue's lifecycle: it is registered (in ``_queues``) exactly while it holds items. ``add``
creates it with its first item and files its deadline; whatever takes its last item (a batch,
a cancelled caller dropped, ``remove``) forgets it in the same step (``_prune``/``_forget``). So
an item always lands either in a new queue, which files a deadline, or in a live queue whose
deadline entry (or held state, whose release files one) is already there: no empty queue can
swallow later items.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

NO_KEY = object()
"""``next_ready``'s answer when no queue is ready (None is a valid key)."""


@dataclass
class Pending:
    """One caller's item, waiting in its key's queue."""

    item: Any
    size: int
    future: asyncio.Future
    enqueued_at: float


@dataclass(eq=False)
class _KeyQueue:
    """One key's items, plus its place in the ready structures (see the module docstring)."""

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


class KeyQueues:
    """Items by key, and which key's batch is ready next.

    ``runnable(key)``, if given, holds a key's queue back while it returns False (it keeps
    growing); ``release_runnable`` looks at the held ones again.
    """

    def __init__(
        self,
        max_size: int,
        max_wait_s: float,
        clock: Callable[[], float],
        runnable: Callable[[Hashable], bool] | None = None,
    ) -> None:
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self.queued = 0  # items in the queues (cancelled ones included until dropped)
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

    def keys(self) -> list[Hashable]:
        return list(self._queues)

    # ----------------------------------------------------------------- items in
    def add(self, key: Hashable, pending: Pending) -> bool:
        """Queue one item under ``key``; returns whether its queue is now full and may run."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _KeyQueue()
            self._push_deadline(key, queue, pending.enqueued_at + self.max_wait_s)
        queue.items.append(pending)
        queue.total_size += pending.size
        self.queued += 1
        if queue.total_size < self.max_size:
            return False
        runnable = self._is_runnable(key)
        if queue.held and runnable:
            self._release(key, queue)
        if not queue.held and key not in self._full:
            self._full[key] = (queue, queue.epoch)
        return runnable

    def release_runnable(self) -> None:
        """File the held queues whose key is runnable now in the ready structures again."""
        for key, queue in list(self._held.items()):
            if self._is_runnable(key):
                self._release(key, queue)

    # ----------------------------------------------------------------- items out
    def next_ready(self, full_only: bool) -> Hashable:
        """The key to start next, or ``NO_KEY``.

        The deadline heap's top holds the oldest first item of all: when it is due (or full) it
        is the oldest ready queue. Otherwise no queue is due, and the ready ones are the full
        ones, in the order they filled. ``full_only``: only a full queue may go (no slot is free,
        see ``Batcher(send_full=)``).
        """
        if not full_only:
            top = self._deadline_top()
            if top is not None:
                deadline, _, key, queue, _ = top
                if deadline <= self._clock() or queue.total_size >= self.max_size:
                    return key
        return self._full_front()

    def next_deadline(self) -> float | None:
        """When the oldest first item of a runnable queue is due; None if no queue waits."""
        top = self._deadline_top()
        return None if top is None else top[0]

    def take(self, key: Hashable) -> list[Pending]:
        """Pop one batch off ``key``'s queue, skipping callers cancelled while queued. Its heap
        entry is now early; it is re-filed lazily."""
        queue = self._queues[key]
        batch: list[Pending] = []
        total = 0
        while queue.items and total + queue.items[0].size <= self.max_size:
            pending = queue.items.popleft()
            queue.total_size -= pending.size
            self.queued -= 1
            if not pending.future.done():
                total += pending.size
                batch.append(pending)
        if not queue.items:
            self._forget(key)
        elif key in self._full:
            if queue.total_size >= self.max_size:
                self._full.move_to_end(key)  # full again: behind the other full keys
            else:
                del self._full[key]
        return batch

    def prune(self, key: Hashable) -> bool:
        """Drop the cancelled callers at the head of ``key``'s queue, and the queue itself once
        nothing is left in it; returns whether it still holds items."""
        queue = self._queues.get(key)
        return queue is not None and self._prune(key, queue)

    def remove(self, key: Hashable) -> list[Pending]:
        """Forget ``key``'s queue and return its items (its heap entry dies with it)."""
        queue = self._queues.get(key)
        if queue is None:
            return []
        self._forget(key)
        self.queued -= len(queue.items)
        return list(queue.items)

    def clear(self) -> list[Pending]:
        """Forget every queue and return all their items."""
        items = [pending for queue in self._queues.values() for pending in queue.items]
        self._queues.clear()
        self._deadlines.clear()
        self._full.clear()
        self._held.clear()
        self.queued = 0
        return items

    # ------------------------------------------------------- the ready structures
    def _is_runnable(self, key: Hashable) -> bool:
        return self._runnable is None or self._runnable(key)

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
        if not self._is_runnable(key):
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
            actual = queue.oldest() + self.max_wait_s
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
            if queue.total_size < self.max_size:  # cancelled items made room: it can grow
                del self._full[key]
                continue
            return key
        return NO_KEY

    def _hold(self, key: Hashable, queue: _KeyQueue) -> None:
        queue.held = True
        queue.epoch += 1  # voids its heap and full-list entries
        self._full.pop(key, None)
        self._held[key] = queue

    def _release(self, key: Hashable, queue: _KeyQueue) -> None:
        """A held queue may run again: file it in the deadline heap (and the full list)."""
        del self._held[key]
        queue.held = False
        self._push_deadline(key, queue, queue.oldest() + self.max_wait_s)
        if queue.total_size >= self.max_size:
            self._full[key] = (queue, queue.epoch)

    # ------------------------------------------------------- a queue's lifecycle
    def _prune(self, key: Hashable, queue: _KeyQueue) -> bool:
        """Drop cancelled callers at the head of ``key``'s queue; forget the queue if that
        emptied it. Returns whether it still holds items."""
        self.queued -= queue.drop_done_head()
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
