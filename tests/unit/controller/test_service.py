"""Services on real Monarch CPU meshes: prebatching, assembly, errors, routing, placement.

The actor classes live in this test module on purpose: replicas must import them without the
user setting PYTHONPATH (behaviour 8 of the service-core issue).
"""

import asyncio
import os
import re

import pytest
import torch
from monarch.actor import current_rank
from waits import bounded, settle

from forge.controller import (
    Batching,
    BatchResultError,
    EndpointError,
    ForgeActor,
    InsufficientGpus,
    RequestTimeout,
    Router,
    ServiceStopped,
    endpoint,
)


class Counter(ForgeActor):
    """Counts how often each endpoint body runs, so tests can count Monarch messages."""

    def __init__(self, scale: int = 1):
        self.scale = scale
        self.batch_sizes: list[int] = []
        self.ready = False

    @endpoint
    async def setup(self) -> None:
        self.ready = True

    @endpoint(batch=Batching(max_size=8, max_wait_s=0.2))
    async def score(self, items: list[int]) -> list[int]:
        self.batch_sizes.append(len(items))
        return [x * self.scale for x in items]

    @endpoint(batch=Batching(max_size=8, max_wait_s=0.05))
    async def fragile(self, items: list[int]) -> list:
        if any(x < 0 for x in items):
            raise ValueError(f"negative input in {items}")
        if 13 in items:
            return items[:-1]  # wrong length
        return [KeyError(f"no {x}") if x == 7 else x for x in items]

    @endpoint
    async def add(self, xs: list[int]) -> int:
        """Caller batching: a plain endpoint that takes a list."""
        self.batch_sizes.append(len(xs))
        return sum(xs)

    @endpoint
    async def stats(self) -> dict:
        return {
            "ready": self.ready,
            "batch_sizes": list(self.batch_sizes),
            "pid": os.getpid(),
            "rank": current_rank().rank,
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "proc_mesh": os.environ.get("FORGE_PROC_MESH"),
        }


def pad_rows(requests: list[list[int]]) -> torch.Tensor:
    """enbatch: token lists -> one right-padded [B, T] tensor."""
    width = max(len(r) for r in requests)
    return torch.tensor([r + [0] * (width - len(r)) for r in requests])


def split_rows(result: torch.Tensor, n: int) -> list[int]:
    return result.tolist()


class Summer(ForgeActor):
    def __init__(self):
        self.shapes: list[tuple] = []

    @endpoint(batch=Batching(max_size=4, max_wait_s=0.1, enbatch=pad_rows, debatch="split"))
    async def total(self, batch: torch.Tensor) -> torch.Tensor:
        assert isinstance(batch, torch.Tensor)
        self.shapes.append(tuple(batch.shape))
        return batch.sum(dim=1)

    @staticmethod
    def split(result: torch.Tensor, n: int) -> list[int]:
        return split_rows(result, n)

    @endpoint
    async def seen_shapes(self) -> list:
        return self.shapes


async def every_rank(replica, endpoint: str) -> list:
    """Every rank's answer, in rank order, through Monarch's own adverb on the replica's actor mesh."""
    values = await asyncio.wait_for(getattr(replica.actor_mesh, endpoint).call(), 30)
    return list(values.values())


@pytest.fixture(scope="module")
async def counter_service():
    svc = await Counter.options(num_replicas=2, router="key_affinity").as_service(scale=2)
    yield svc
    await svc.shutdown()


async def test_singletons_are_prebatched_into_one_message_per_batch():
    svc = await Counter.options(num_replicas=1).as_service(scale=3)
    try:
        out = await bounded(asyncio.gather(*(svc.score.route(i) for i in range(24))), "24 prebatched results", 10)
        assert out == [3 * i for i in range(24)]
        stats = await svc.stats.route()
        assert stats["ready"] is True  # setup ran before traffic
        assert stats["batch_sizes"] == [8, 8, 8]  # 3 endpoint invocations for 24 callers
        m = svc.metrics()["endpoints"]["score"]
        assert m["requests"] == 24 and m["batches"] == 3 and m["max_batch_size"] == 8
    finally:
        await svc.shutdown()


async def test_burst_is_queued_at_call_time_and_full_batches_go_out_at_once():
    """route() queues a batched item when it is called, and full batches do not wait for the
    busy slot: a burst keeps the actor fed before any caller has awaited."""
    svc = await Counter.options(num_replicas=1).as_service()
    try:
        calls = [svc.score.route(i) for i in range(20)]  # made, not yet awaited
        replica = svc.service.replicas[0]
        assert replica.in_flight == 20
        assert replica.batchers["score"].queued == 4  # 2 full batches are on their way
        assert await bounded(asyncio.gather(*calls), "the burst's results", 10) == list(range(20))
        assert (await svc.stats.route())["batch_sizes"] == [8, 8, 4]
        task = asyncio.create_task(svc.score.route(5))  # route() still gives a coroutine
        assert await task == 5
    finally:
        await svc.shutdown()


async def test_each_replica_process_names_its_proc_mesh_in_its_environment(counter_service):
    """Tools outside forge (ps, profilers, the benchmarks' CPU accounting) tell replicas apart by it."""
    names = sorted(s["proc_mesh"] for s in await counter_service.stats.fanout())
    assert len(names) == 2 and all(re.fullmatch(r"counter\d+-r[01]-g0", n) for n in names), names
    assert names[0][:-5] == names[1][:-5] and names[0] != names[1]  # one service, two replicas


async def test_route_many_keeps_order_and_fanout_reaches_every_replica(counter_service):
    svc = counter_service
    assert await svc.score.route_many([5, 1, 4], keys=["a", "b", "a"]) == [10, 2, 8]
    stats = await svc.stats.fanout()
    assert len({s["pid"] for s in stats}) == 2


async def test_custom_assembly_sends_one_padded_tensor():
    svc = await Summer.options(num_replicas=1).as_service()
    try:
        rows = [[1, 2, 3], [4], [5, 6]]
        assert await svc.total.route_many(rows) == [6, 4, 11]
        assert await svc.seen_shapes.route() == [(3, 3)]
    finally:
        await svc.shutdown()


async def test_caller_batching_goes_straight_through(counter_service):
    assert await counter_service.add.route([1, 2, 3]) == 6


async def test_endpoint_exception_reaches_every_caller_and_replica_keeps_serving(counter_service):
    svc = counter_service
    out = await asyncio.gather(*(svc.fragile.route(x, key="k") for x in (1, -2, 3)), return_exceptions=True)
    for err in out:
        assert isinstance(err, EndpointError)
        assert err.type_name == "ValueError" and "negative input" in str(err)
    assert await svc.fragile.route(4, key="k") == 4


async def test_exception_in_one_slot_fails_only_that_caller(counter_service):
    out = await asyncio.gather(*(counter_service.fragile.route(x, key="s") for x in (6, 7, 8)), return_exceptions=True)
    assert out[0] == 6 and out[2] == 8
    assert isinstance(out[1], KeyError)


async def test_wrong_result_length_is_a_clear_error_to_the_batch(counter_service):
    out = await asyncio.gather(*(counter_service.fragile.route(x, key="w") for x in (12, 13)), return_exceptions=True)
    assert all(isinstance(e, BatchResultError) and "2 results" in str(e) for e in out)
    assert await counter_service.fragile.route(1, key="w") == 1


async def test_equal_keys_meet_on_one_replica_and_batch_together(counter_service):
    svc = counter_service
    before = {s["pid"]: len(s["batch_sizes"]) for s in await svc.stats.fanout()}
    await asyncio.gather(*(svc.score.route(i, key="prompt-17") for i in range(8)))
    after = {s["pid"]: s["batch_sizes"] for s in await svc.stats.fanout()}
    new = {pid: sizes[before[pid] :] for pid, sizes in after.items()}
    assert sorted(new.values(), key=len) == [[], [8]]  # one replica, one batch of 8


async def test_the_key_routes_and_the_batch_key_picks_the_queue(counter_service):
    """One routing key, two batch keys: one replica, one batch per batch key. Eight routing keys
    held on one replica by a session, no batch key: one shared batch."""
    svc = counter_service
    before = {s["pid"]: len(s["batch_sizes"]) for s in await svc.stats.fanout()}
    await asyncio.gather(*(svc.score.route(i, key="prompt-3", batch_key=i % 2) for i in range(8)))
    after = {s["pid"]: s["batch_sizes"] for s in await svc.stats.fanout()}
    assert sorted(sizes[before[pid] :] for pid, sizes in after.items()) == [[], [4, 4]]
    async with svc.session():
        await svc.stats.route()  # pins the session
        before = {s["pid"]: len(s["batch_sizes"]) for s in await svc.stats.fanout()}
        await asyncio.gather(*(svc.score.route(i, key=f"prompt-{i}") for i in range(8)))
    after = {s["pid"]: s["batch_sizes"] for s in await svc.stats.fanout()}
    assert sorted(sizes[before[pid] :] for pid, sizes in after.items()) == [[], [8]]


async def test_batch_key_on_a_plain_endpoint_is_a_clear_error(counter_service):
    with pytest.raises(TypeError, match=r"Counter.add is not batched: batch_key= .* \(got batch_key='b'\)"):
        await counter_service.add.route([1], batch_key="b")
    with pytest.raises(ValueError, match="2 batch_keys for 3 items"):
        await counter_service.score.route_many([1, 2, 3], batch_keys=["a", "b"])


async def test_session_sticks_to_one_replica(counter_service):
    """Keys that key_affinity spreads over both replicas all go to one inside a session."""
    keys = [f"session-key-{i}" for i in range(6)]
    spread = {(await counter_service.stats.route(key=k))["pid"] for k in keys}
    assert len(spread) == 2  # without the session these keys reach both replicas, every time
    async with counter_service.session():
        pids = {(await counter_service.stats.route(key=k))["pid"] for k in keys}
    assert len(pids) == 1


async def test_user_router_can_be_plugged_per_endpoint():
    class AlwaysLast(Router):
        def choose(self, request, replicas):
            return replicas[-1]

    svc = await Counter.options(num_replicas=2, endpoint_routers={"stats": AlwaysLast}).as_service()
    try:
        pids = {(await svc.stats.route())["pid"] for _ in range(4)}
        assert len(pids) == 1
        for _ in range(4):  # another endpoint keeps the default router: round robin
            await svc.add.route([1])
        served = {i: r["endpoints"].get("add", {}).get("requests", 0) for i, r in svc.metrics()["replicas"].items()}
        assert served == {0: 2, 1: 2}
        rr = {i for i, n in served.items() if n}
        assert len(rr) == 2
    finally:
        await svc.shutdown()


async def test_gpus_are_split_across_replicas(monkeypatch):
    """Each replica process sees only its own devices (faked device list; no GPU needed)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    svc = await Counter.options(num_replicas=2, procs=2, with_gpus=True).as_service()
    try:
        seen = [[r["cuda"] for r in await every_rank(replica, "stats")] for replica in svc.service.replicas]
        assert seen == [["4", "5"], ["6", "7"]]
    finally:
        await svc.shutdown()


def test_too_few_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(InsufficientGpus, match=r"3 replicas x 1 GPUs each need 3 GPUs, but only 2"):
        asyncio.run(Counter.options(num_replicas=3, with_gpus=True).as_service())


async def test_multi_proc_replica_runs_on_every_rank_and_returns_rank_zero():
    svc = await Counter.options(num_replicas=1, procs=2).as_service()
    try:
        assert (await svc.stats.route())["rank"] == 0
        await asyncio.gather(*(svc.score.route(i) for i in range(8)))
        ranks = await every_rank(svc.service.replicas[0], "stats")
        assert [r["batch_sizes"] for r in ranks] == [[8], [8]]  # every rank ran the batch
    finally:
        await svc.shutdown()


async def test_metrics_report_each_replica_and_endpoint(counter_service):
    await counter_service.score.route_many(list(range(10)))
    m = counter_service.metrics()
    assert set(m["replicas"]) == {0, 1}
    score = m["endpoints"]["score"]
    for key in ("requests", "batches", "mean_batch_size", "max_batch_size", "mean_queue_wait_s", "in_flight", "errors"):
        assert key in score
    assert score["mean_queue_wait_s"] > 0 and score["in_flight"] == 0
    assert m["replicas"][0]["state"] == "healthy"


async def test_every_answered_request_leaves_the_in_flight_counts(counter_service):
    """Plain and batched requests, some failing, once answered leave no request in flight on any
    replica (the counts least-loaded routing and max_in_flight_per_replica admission go by)."""
    svc = counter_service
    await asyncio.gather(*(svc.add.route([i]) for i in range(6)))
    await asyncio.gather(*(svc.fragile.route(x, key=str(x)) for x in (1, -2, 7)), return_exceptions=True)
    assert [r.in_flight for r in svc.service.replicas] == [0, 0]
    endpoints = svc.metrics()["endpoints"]
    assert endpoints["add"]["requests"] >= 6 and endpoints["add"]["in_flight"] == 0
    assert endpoints["fragile"]["in_flight"] == 0


async def test_plain_actor_mesh_supports_monarch_adverbs():
    actor = await Counter.options(procs=2).as_actor(scale=5)
    try:
        assert await actor.slice(procs=0).score.call_one([1, 2]) == [5, 10]
        values = await actor.score.call([1])
        assert list(values.values()) == [[5], [5]]
    finally:
        await ForgeActor.shutdown(actor)


async def test_shutdown_fails_queued_requests_and_later_calls():
    svc = await Counter.options(num_replicas=1).as_service()
    pending = asyncio.ensure_future(svc.score.route(1))  # queued at once; waits up to 0.2 s for company
    await settle()
    assert svc.service.replicas[0].batchers["score"].queued == 1
    await svc.shutdown()
    with pytest.raises(ServiceStopped):
        await bounded(pending, "ServiceStopped for an item queued at shutdown")
    with pytest.raises(ServiceStopped):
        await svc.score.route(2)


async def test_callers_that_leave_before_their_batch_runs_never_reach_the_endpoint():
    """Through a real service: callers that time out, or are cancelled, while their items wait
    for company leave nothing behind; the actor's endpoint never runs for them, and the service
    serves the next caller in a batch of its own."""
    svc = await Counter.options(num_replicas=1).as_service()  # score waits up to 0.2 s for company
    try:
        batcher = svc.service.replicas[0].batchers["score"]
        calls = asyncio.gather(*(svc.score.route(i, timeout=0.01) for i in range(3)), return_exceptions=True)
        timed_out = await bounded(calls, "the callers' own timeouts")
        assert all(isinstance(e, RequestTimeout) for e in timed_out)
        cancelled = [asyncio.ensure_future(svc.score.route(i)) for i in range(3, 6)]
        await settle()  # each caller awaits its queued item
        for task in cancelled:
            task.cancel()
        await asyncio.gather(*cancelled, return_exceptions=True)
        assert await bounded(svc.score.route(7), "the next caller's result") == 7
        assert (await svc.stats.route())["batch_sizes"] == [1]  # one message, holding only the last caller
        assert batcher.queued == 0 and batcher.keys == []
        score = svc.metrics()["endpoints"]["score"]
        assert (score["requests"], score["batches"], score["in_flight"]) == (7, 1, 0)
    finally:
        await svc.shutdown()


async def test_bad_calls_are_named_at_the_call_site(counter_service):
    with pytest.raises(AttributeError, match="no endpoint 'scroe'; endpoints: .*'score'"):
        _ = counter_service.scroe
    with pytest.raises(TypeError, match="is batched: route\\(\\) takes exactly one item"):
        await counter_service.score.route(1, 2)
    with pytest.raises(ValueError, match="2 keys for 3 items"):
        await counter_service.score.route_many([1, 2, 3], keys=["a", "b"])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_replicas": 0}, "num_replicas=...\\) must be an integer >= 1, got 0"),
        ({"procs": "2"}, "procs=...\\) must be an integer >= 1, got '2'"),
        ({"router": "fastest"}, "unknown router 'fastest'"),
        ({"call_timeout_s": -1}, "call_timeout_s=...\\) must be a number of seconds > 0"),
        ({"replicas": 2}, "known options"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Counter.options(**options)


def test_unknown_endpoint_router_is_named():
    with pytest.raises(ValueError, match="names 'nope', which is not an endpoint of Counter"):
        asyncio.run(Counter.options(endpoint_routers={"nope": "round_robin"}).as_service())


def test_controller_log_records_carry_no_monarch_actor_prefix(caplog):
    """After the controller has used Monarch, its own log lines read as written, not
    ``[actor=<root>] [actor=<root>] ...`` once per handler."""
    import logging

    from monarch.actor import context

    from forge.controller.quiet import local_host

    local_host()  # what every forge mesh start goes through
    context()  # the controller's Monarch context, as any Monarch call in this thread makes it
    with caplog.at_level(logging.INFO, logger="forge.test"):
        logging.getLogger("forge.test").info("step 3 | loss 0.5")
    assert [r.getMessage() for r in caplog.records] == ["step 3 | loss 0.5"]
