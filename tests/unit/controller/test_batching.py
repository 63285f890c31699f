"""The Batcher's contract, clause by clause, driven in-process with a fake executor.

Deadlines are decided on the Batcher's clock (``FakeClock``) where a test is about them; events
are ordered with ``settle`` and every wait for a result is bounded (``waits.bounded``).
"""

import asyncio

import pytest
from waits import bounded, settle, until

from forge.controller import Batcher, Batching, BatchResultError, ServiceStopped


class Recorder:
    """An executor that records each batch and can be held busy."""

    def __init__(self, fn=lambda x: x * 2):
        self.batches: list[list] = []
        self.keys: list = []
        self.fn = fn
        self.gate: asyncio.Event | None = None

    async def __call__(self, items, key):
        self.batches.append(list(items))
        self.keys.append(key)
        if self.gate is not None:
            await self.gate.wait()
        return [self.fn(i) for i in items]


async def test_batch_is_capped_at_max_size():
    """40 concurrent items with max_size 8 run as 5 batches of 8, results in order."""
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=1.0), rec)
    out = await bounded(asyncio.gather(*(b.submit(i) for i in range(40))), "40 results")
    assert out == [i * 2 for i in range(40)]
    assert [len(x) for x in rec.batches] == [8] * 5


async def test_lone_item_runs_after_max_wait():
    """A single item waits max_wait_s for company, then runs alone."""
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=0.05), rec)
    t0 = asyncio.get_running_loop().time()
    assert await bounded(b.submit(3), "the lone item's result") == 6
    assert asyncio.get_running_loop().time() - t0 >= 0.05 - 0.005  # not before its wait (timer slack)
    assert rec.batches == [[3]]


async def test_size_one_never_waits():
    """max_size=1 runs each item at once even with a very long wait."""
    rec = Recorder()
    b = Batcher(Batching(max_size=1, max_wait_s=1000), rec)
    assert await bounded(b.submit(1), "the result of a batch of max_size=1", 1.0) == 2


class FakeClock:
    """The Batcher's clock, moved by hand: deadlines are decided by it, never by the wall clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_wait_is_timed_from_first_item():
    """An item arriving late joins the batch of the first one, which is due at first item +
    max_wait_s (on the Batcher's clock), not a moment before: the later item neither restarts
    nor extends the wait."""
    clock = FakeClock()
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=10.0), rec, clock=clock)
    first = b.enqueue(1)
    clock.now = 6.0
    second = b.enqueue(2)  # 6 s after the first: due at 10, not at 16
    await settle()
    clock.now = 9.999
    b.wake()
    await settle()
    assert rec.batches == []  # not due yet
    clock.now = 10.0
    b.wake()
    await settle()
    assert rec.batches == [[1, 2]]
    assert await bounded(asyncio.gather(first, second), "the batch's results") == [2, 4]
    assert b.stats.queue_wait_s_total == pytest.approx(10.0 + 4.0)  # waits measured on the same clock


async def test_oldest_first_item_goes_first_and_a_cancelled_head_moves_the_deadline():
    """Among due keys the one whose first item is oldest starts first; when a queue's first
    caller is cancelled, its wait is timed from the next item instead."""
    clock = FakeClock()
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = Batcher(Batching(max_size=8, max_wait_s=1.0), rec, clock=clock)
    blocker = b.enqueue("x", key="busy")
    clock.now = 1.0
    b.wake()
    await settle()
    assert rec.keys == ["busy"]  # holds the only slot
    clock.now = 1.2
    cancelled = b.enqueue("gone", key="late")  # the first queue made, but its first caller leaves
    futures = []
    for t, key in [(1.5, "c"), (2.0, "a"), (2.5, "b"), (3.0, "c")]:
        clock.now = t
        futures.append(b.enqueue(t, key=key))
    clock.now = 3.2
    late = b.enqueue(3.2, key="late")
    cancelled.cancel()
    clock.now = 100.0  # everything is due; the slot frees up
    rec.gate.set()
    await bounded(asyncio.gather(blocker, *futures, late), "every key's batch once the slot is free")
    assert rec.keys == ["busy", "c", "a", "b", "late"]
    assert rec.batches[1] == [1.5, 3.0]

    rec2 = Recorder()
    b2 = Batcher(Batching(max_size=8, max_wait_s=1.0), rec2, clock=clock)
    clock.now = 0.0
    head = b2.enqueue("head")
    clock.now = 0.5
    tail = b2.enqueue("tail")
    head.cancel()
    clock.now = 1.2  # the cancelled head was due at 1.0; the live one is due at 1.5
    b2.wake()
    await settle()
    assert rec2.batches == []
    clock.now = 1.5
    b2.wake()
    assert await bounded(tail, "the live item's batch at its own deadline") == "tailtail"
    assert rec2.batches == [["tail"]]


async def test_starting_a_batch_looks_at_a_bounded_number_of_queues():
    """With thousands of live keys the dispatcher must not walk every queue per batch: the
    runnable() gate, asked once per queue looked at, is asked O(1) times per batch."""
    asked = 0

    def runnable(key):
        nonlocal asked
        asked += 1
        return True

    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=0.0), rec, runnable=runnable)
    keys = 2000
    futures = [b.enqueue(i, key=k) for k in range(keys) for i in range(2)]
    await bounded(asyncio.gather(*futures), "2,000 keys' batches")
    assert len(rec.batches) == keys
    assert asked <= 4 * keys  # a scan per batch would ask about keys**2 / 2 = 2,000,000 times
    assert b.keys == [] and b.queued == 0


async def test_held_key_keeps_growing_and_runs_after_wake():
    """runnable(key) False holds a key's queue back (it grows past the others); wake() lets it go."""
    clock = FakeClock()
    ready = {"m1": False}
    rec = Recorder()
    b = Batcher(Batching(max_size=4, max_wait_s=1.0), rec, clock=clock, runnable=lambda k: ready.get(k, True))
    held = [b.enqueue(i, key="m1") for i in range(6)]
    other = b.enqueue(100, key="m2")
    clock.now = 5.0
    b.wake()
    await settle()
    assert rec.keys == ["m2"]  # m1 is held although full and due
    assert b.queued == 6 and b.has_forming("m1")
    ready["m1"] = True
    b.wake()
    assert await bounded(asyncio.gather(*held, other), "the held key's batches after wake()") == [
        0,
        2,
        4,
        6,
        8,
        10,
        200,
    ]
    assert rec.batches[1:] == [[0, 1, 2, 3], [4, 5]]


async def test_a_held_queue_emptied_by_a_cancelled_caller_still_serves_later_items():
    """A held key's only caller is cancelled and a batch-aware router probes the key (the queue
    runs empty); once the key is runnable, a later item below max_size runs on its deadline
    instead of waiting forever in a queue that lost its deadline."""
    ready = {"m": False}
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=0.01), rec, runnable=lambda k: ready[k])
    first = b.enqueue(1, key="m")
    await settle()  # the dispatcher sees that "m" is not runnable and holds it
    first.cancel()
    assert not b.has_forming("m")  # the router's probe drops the cancelled head
    assert b.keys == [] and b.queued == 0  # an empty queue is not kept
    ready["m"] = True
    b.wake()
    second = b.enqueue(2, key="m")
    assert await bounded(second, "a later item of a queue its cancelled caller emptied", 2.0) == 4
    assert rec.batches == [[2]]


async def test_a_held_queue_whose_callers_all_left_goes_when_released():
    """Every caller of a held key cancelled, without a probe: once released, the empty queue
    is dropped, and the next item of that key runs alone on its deadline."""
    clock = FakeClock()
    ready = {"m": False}
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=1.0), rec, clock=clock, runnable=lambda k: ready[k])
    gone = [b.enqueue(i, key="m") for i in range(3)]
    await settle()
    for f in gone:
        f.cancel()
    ready["m"] = True
    b.wake()
    await settle()
    assert b.keys == [] and b.queued == 0 and rec.batches == []
    clock.now = 5.0
    late = b.enqueue(7, key="m")
    clock.now = 6.0
    b.wake()
    assert await bounded(late, "the next item of a released queue whose callers left", 2.0) == 14
    assert rec.batches == [[7]]


async def test_batch_keeps_growing_while_slots_are_busy():
    """With the only slot busy, later items form ONE batch instead of many half-empty ones."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = Batcher(Batching(max_size=16, max_wait_s=0.0), rec)
    first = b.enqueue(0)
    await until(lambda: len(rec.batches) == 1, "the first batch to start")
    rest = [b.enqueue(i) for i in range(1, 8)]
    await settle()  # all past their (zero) wait, but the slot is busy
    assert len(rec.batches) == 1
    rec.gate.set()
    await bounded(asyncio.gather(first, *rest), "both batches once the slot is free")
    assert rec.batches == [[0], list(range(1, 8))]


async def test_send_full_starts_full_batches_past_busy_slots_but_partial_ones_wait():
    """send_full: a full batch cannot grow, so it goes at once; a partial one still closes late."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = Batcher(Batching(max_size=4, max_wait_s=0.0), rec, send_full=True)
    futures = [b.enqueue(i) for i in range(14)]  # 3 full batches and 2 items over
    await settle()
    assert rec.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # the slot is busy: no [12, 13] yet
    futures += [b.enqueue(i) for i in range(14, 16)]  # the partial batch fills up: it goes too
    await settle()
    assert rec.batches[-1] == [12, 13, 14, 15]
    futures.append(b.enqueue(16))
    await settle()
    assert len(rec.batches) == 4  # partial: waits for a slot
    rec.gate.set()
    assert await bounded(asyncio.gather(*futures), "every batch once the slot is free") == [i * 2 for i in range(17)]
    assert rec.batches[-1] == [16]


async def test_concurrent_batches_use_all_slots():
    """max_concurrent_batches=2 runs two batches at the same time."""
    rec = Recorder()
    rec.gate = asyncio.Event()
    b = Batcher(Batching(max_size=2, max_wait_s=0.0, max_concurrent_batches=2), rec)
    futs = [b.enqueue(i) for i in range(4)]
    await until(lambda: len(rec.batches) == 2, "two batches running at once")  # both blocked on the gate
    rec.gate.set()
    await bounded(asyncio.gather(*futs), "both batches' results")
    assert len(rec.batches) == 2


async def test_size_fn_limits_total_size():
    """With size_fn, a batch holds items whose sizes sum to at most max_size."""
    rec = Recorder(fn=len)
    b = Batcher(Batching(max_size=10, max_wait_s=0.5, size_fn=len), rec)
    items = ["aaaa", "bbbb", "cccc", "dd", "e"]
    out = await bounded(asyncio.gather(*(b.submit(s) for s in items)), "the sized items' results")
    assert out == [4, 4, 4, 2, 1]
    assert all(sum(map(len, batch)) <= 10 for batch in rec.batches)
    assert rec.batches[0] == ["aaaa", "bbbb"]


async def test_oversized_item_fails_only_its_caller():
    """An item bigger than max_size alone gets a clear error; the others are served."""
    rec = Recorder(fn=len)
    b = Batcher(Batching(max_size=4, max_wait_s=0.01, size_fn=len), rec)
    ok, bad = await bounded(asyncio.gather(b.submit("ab"), b.submit("abcdefg"), return_exceptions=True), "results")
    assert ok == 2
    assert isinstance(bad, BatchResultError) and "size 7" in str(bad)


async def test_keys_never_share_a_batch_and_idle_queues_go_away():
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=0.05), rec)
    await bounded(asyncio.gather(*(b.submit(i, key=i % 3) for i in range(12))), "three keys' batches")
    for batch, key in zip(rec.batches, rec.keys):
        assert {i % 3 for i in batch} == {key}
    assert b.keys == []


async def test_key_function_groups_items():
    """Batching(key=...) derives the key when the caller gives none."""
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=0.05, key=lambda x: x % 2), rec)
    await bounded(asyncio.gather(*(b.submit(i) for i in range(6))), "two derived keys' batches")
    assert sorted(map(sorted, rec.batches)) == [[0, 2, 4], [1, 3, 5]]


async def test_failing_key_function_fails_only_that_caller():
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=0.01, key=lambda x: 10 // x), rec)
    good, bad = await bounded(asyncio.gather(b.submit(5), b.submit(0), return_exceptions=True), "results")
    assert good == 10
    assert isinstance(bad, BatchResultError) and "ZeroDivisionError" in str(bad)
    assert await bounded(b.submit(2), "a result after a failing key function") == 4  # still serving


async def test_exception_in_one_slot_fails_only_that_caller():
    async def execute(items, key):
        return [ValueError(f"bad {i}") if i == 2 else i for i in items]

    b = Batcher(Batching(max_size=4, max_wait_s=0.05), execute)
    out = await bounded(asyncio.gather(*(b.submit(i) for i in range(4)), return_exceptions=True), "results")
    assert out[0:2] == [0, 1] and out[3] == 3
    assert isinstance(out[2], ValueError) and str(out[2]) == "bad 2"


async def test_wrong_result_length_fails_the_whole_batch_and_batcher_recovers():
    calls = []

    async def execute(items, key):
        calls.append(items)
        return items[:-1] if len(calls) == 1 else items

    b = Batcher(Batching(max_size=4, max_wait_s=0.05), execute)
    out = await bounded(asyncio.gather(*(b.submit(i) for i in range(3)), return_exceptions=True), "errors")
    assert all(isinstance(e, BatchResultError) for e in out)
    assert "3 results" in str(out[0]) and "length 2" in str(out[0])
    assert await bounded(b.submit(7), "a result after a wrong-length batch") == 7


async def test_non_list_result_is_a_clear_error():
    async def execute(items, key):
        return 42

    b = Batcher(Batching(max_size=2, max_wait_s=0.0), execute)
    with pytest.raises(BatchResultError, match="got int"):
        await bounded(b.submit(1), "the error of a non-list result")


async def test_executor_exception_reaches_every_caller_of_the_batch():
    async def execute(items, key):
        raise RuntimeError("engine down")

    b = Batcher(Batching(max_size=4, max_wait_s=0.05), execute)
    out = await bounded(asyncio.gather(*(b.submit(i) for i in range(3)), return_exceptions=True), "errors")
    assert all(isinstance(e, RuntimeError) and str(e) == "engine down" for e in out)


async def test_cancelled_callers_are_dropped_before_the_batch_runs():
    clock = FakeClock()
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=1.0), rec, clock=clock)
    keep = asyncio.ensure_future(b.submit(1))
    drop = asyncio.ensure_future(b.submit(2))
    await settle()
    drop.cancel()
    clock.now = 1.0
    b.wake()
    assert await bounded(keep, "the remaining caller's batch") == 2
    assert rec.batches == [[1]]


async def test_all_cancelled_means_endpoint_not_called():
    clock = FakeClock()
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=1.0), rec, clock=clock)
    futs = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
    await settle()
    for f in futs:
        f.cancel()
    clock.now = 5.0  # long past the batch's deadline
    b.wake()
    await settle()
    assert rec.batches == [] and b.keys == [] and b.queued == 0
    late = b.enqueue(5)
    clock.now = 7.0
    b.wake()
    assert await bounded(late, "a later item's batch") == 10  # the batcher still serves
    assert rec.batches == [[5]]


async def test_close_fails_queued_items_instead_of_hanging():
    rec = Recorder()
    b = Batcher(Batching(max_size=8, max_wait_s=10.0), rec)
    futs = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
    await settle()
    await b.close()
    out = await bounded(asyncio.gather(*futs, return_exceptions=True), "the queued callers' errors after close()")
    assert all(isinstance(e, ServiceStopped) for e in out)
    with pytest.raises(ServiceStopped):
        await b.submit(1)


async def test_a_batch_closed_in_the_tick_it_started_fails_its_callers_and_frees_its_work():
    """close() right after a full batch started: its task is cancelled before it ever ran. Its
    callers get the close error (they hung before) and the executor's coroutine is closed."""
    started: list = []

    async def slow(items):
        await asyncio.sleep(30)
        return items

    def execute(items, key):
        coro = slow(items)
        started.append(coro)
        return coro

    b = Batcher(Batching(max_size=2, max_wait_s=10.0), execute)
    futs = [b.enqueue(1), b.enqueue(2)]  # full: started synchronously, its task not yet stepped
    assert len(started) == 1
    await b.close(RuntimeError("the replica failed"))
    out = await bounded(asyncio.gather(*futs, return_exceptions=True), "the started batch's callers after close()")
    assert [str(e) for e in out] == ["the replica failed", "the replica failed"]
    assert started[0].cr_frame is None  # closed, never left pending


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_size": 0}, "max_size must be an integer >= 1"),
        ({"max_size": 1.5}, "max_size must be an integer >= 1"),
        ({"max_wait_s": -1}, "max_wait_s must be a number of seconds >= 0"),
        ({"max_concurrent_batches": 0}, "max_concurrent_batches must be an integer >= 1"),
        ({"size_fn": 3}, "size_fn must be a callable"),
        ({"enbatch": 3}, "enbatch must be a callable, a method name"),
    ],
)
def test_bad_batching_values_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Batching(**kwargs)
