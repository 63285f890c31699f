"""A replica's model cache (LRU, loads, draining) and model-aware routing, with in-process fakes.

``ReplicaModels`` is driven with a fake load (a coroutine that records evictions and loads, and
can be held) and a fake executor; ``ModelAware`` with fake replicas. The same behaviours on
real Monarch meshes are in ``test_multiplex.py``.
"""

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from waits import bounded, settle, until

from forge.controller import Batching, ModelAware, ModelLoadError, RoundRobin, RouteRequest
from forge.controller.errors import EndpointError
from forge.controller.model_cache import ReplicaModels, aggregate_metrics, models_view
from forge.controller.multiplex import Multiplexing


class FakeActor:
    """The actor side: which models it holds, every load/evict call, and batches it ran."""

    def __init__(self, max_models: int, fail: set = frozenset()):
        self.max_models = max_models
        self.held: list = []
        self.calls: list[tuple] = []
        self.batches: list[tuple] = []
        self.fail = set(fail)
        self.load_gate: asyncio.Event | None = None
        self.run_gate: asyncio.Event | None = None

    async def load(self, model_id, evict):
        self.calls.append((model_id, list(evict)))
        for victim in evict:
            self.held.remove(victim)
        if model_id is None:  # an eviction alone (ReplicaModels.retire)
            return
        if self.load_gate is not None:
            await self.load_gate.wait()
        if model_id in self.fail:
            self.fail.discard(model_id)  # fails once
            raise EndpointError("load_model", "ValueError", f"no model {model_id}")
        self.held.append(model_id)
        assert len(self.held) <= self.max_models, self.held

    async def execute(self, items, model_id):
        assert model_id in self.held, (model_id, self.held)
        self.batches.append((model_id, list(items)))
        if self.run_gate is not None:
            await self.run_gate.wait()
        return [(model_id, x) for x in items]  # a result says which model served it


def make(max_models=2, max_size=8, max_wait_s=0.01, slots=1, **actor_kwargs):
    actor = FakeActor(max_models, **actor_kwargs)
    models = ReplicaModels(Multiplexing(max_models=max_models), actor.load, name="fake")
    batcher = models.batcher(
        Batching(max_size=max_size, max_wait_s=max_wait_s, max_concurrent_batches=slots),
        actor.execute,
        name="fake.predict",
    )
    return actor, models, batcher


async def test_model_loads_on_first_request_and_serves_its_batch():
    """The first request of a model loads it; its batch runs after, on that model."""
    actor, models, b = make()
    out = await bounded(asyncio.gather(*(b.submit(i, "m1") for i in range(3))), "m1's batch after its load")
    assert out == [("m1", 0), ("m1", 1), ("m1", 2)]
    assert actor.calls == [("m1", [])]
    assert actor.batches == [("m1", [0, 1, 2])]
    await b.close()


async def test_queue_is_held_back_while_its_model_loads_and_keeps_growing():
    """Items wait for the load and then run as one full batch, not as many small ones."""
    actor, models, b = make(max_size=16, max_wait_s=0.0)
    actor.load_gate = asyncio.Event()
    futs = [b.enqueue(i, "m1") for i in range(10)]
    await until(lambda: models.metrics()["loading"] == ["m1"], "m1's load to start")
    await settle()
    assert actor.batches == []
    actor.load_gate.set()
    await bounded(asyncio.gather(*futs), "m1's batch after its load")
    assert actor.batches == [("m1", list(range(10)))]
    await b.close()


async def test_other_models_run_while_one_loads():
    actor, models, b = make()
    await bounded(b.submit(0, "m1"), "m1's first batch")
    actor.load_gate = asyncio.Event()
    slow = b.enqueue(1, "m2")
    assert await bounded(b.submit(2, "m1"), "m1's batch while m2 loads", 1.0) == ("m1", 2)
    actor.load_gate.set()
    assert await bounded(slow, "m2's batch after its load") == ("m2", 1)
    await b.close()


async def test_least_recently_used_idle_model_is_evicted():
    actor, models, b = make(max_models=2)
    for model_id in ("m1", "m2", "m1", "m3"):
        await bounded(b.submit(0, model_id), f"a batch of {model_id}")
    assert actor.calls == [("m1", []), ("m2", []), ("m3", ["m2"])]
    assert models.metrics()["loaded"] == ["m1", "m3"]
    await b.close()


async def test_busy_model_is_not_evicted_but_drains():
    """Capacity 1: m2 loads only after m1's running batch is done; later m1 requests wait
    for a reload instead of keeping m1 resident forever."""
    actor, models, b = make(max_models=1)
    actor.run_gate = asyncio.Event()
    first = b.enqueue(1, "m1")
    await until(lambda: actor.batches == [("m1", [1])], "m1's batch to run")  # and be held there
    second = b.enqueue(2, "m2")
    await settle()  # m2 waits for room, so m1 starts draining
    late = b.enqueue(3, "m1")  # arrives while m1 drains
    await settle()
    assert actor.calls == [("m1", [])]  # m2 waits: m1 has running work
    actor.run_gate.set()
    out = await bounded(asyncio.gather(first, second, late), "m1 drained, m2 loaded, m1 reloaded")
    assert out == [("m1", 1), ("m2", 2), ("m1", 3)]
    assert actor.calls == [("m1", []), ("m2", ["m1"]), ("m1", ["m2"])]
    await b.close()


async def test_retired_model_is_evicted_at_once_and_reloads_when_named_again():
    """retire evicts an idle model without waiting for the LRU; a later request loads it again."""
    actor, models, b = make(max_models=2)
    for model_id in ("m1", "m2"):
        await bounded(b.submit(0, model_id), f"a batch of {model_id}")
    assert await bounded(models.retire("m1"), "m1 retired") is True
    assert actor.held == ["m2"] and actor.calls[-1] == (None, ["m1"])
    assert models.metrics()["loaded"] == ["m2"]
    assert await bounded(models.retire("m1"), "m1 retired again") is False  # no longer held
    await bounded(b.submit(1, "m1"), "m1 reloaded")
    assert actor.calls[-1] == ("m1", [])  # room was free: nothing else evicted
    await b.close()


async def test_retire_waits_for_the_models_running_batch():
    """A model with a batch on the actor is evicted only after that batch is answered."""
    actor, models, b = make(max_models=2)
    actor.run_gate = asyncio.Event()
    running = b.enqueue(1, "m1")
    await until(lambda: actor.batches == [("m1", [1])], "m1's batch to run")
    retiring = asyncio.ensure_future(models.retire("m1"))
    await settle()
    assert not retiring.done() and actor.held == ["m1"]
    actor.run_gate.set()
    assert await bounded(running, "m1's batch") == ("m1", 1)
    assert await bounded(retiring, "m1 retired after its batch") is True
    assert actor.held == []
    await b.close()


async def test_busy_models_cannot_starve_a_waiting_model():
    """A steady stream for the loaded model does not keep a waiting model out forever."""
    actor, models, b = make(max_models=1, max_wait_s=0.005)
    stop = asyncio.Event()

    async def hot():
        while not stop.is_set():
            await asyncio.gather(*(b.submit(i, "hot") for i in range(4)))

    streams = [asyncio.ensure_future(hot()) for _ in range(3)]
    await until(lambda: len(actor.batches) >= 3, "the hot model's stream to run")
    assert await bounded(b.submit(7, "cold"), "the waiting model's batch past a busy one", 2.0) == ("cold", 7)
    stop.set()
    await bounded(asyncio.gather(*streams), "the hot streams to stop")
    await b.close()


async def test_failed_load_fails_only_its_requests_and_is_tried_again():
    actor, models, b = make(fail={"bad"})
    asks = asyncio.gather(b.submit(1, "bad"), b.submit(2, "bad"), b.submit(3, "m1"), return_exceptions=True)
    out = await bounded(asks, "a failed load's errors and another model's batch")
    assert all(
        isinstance(e, ModelLoadError) and "no model bad" in str(e) and "load_model('bad')" in str(e) for e in out[:2]
    )
    assert out[2] == ("m1", 3)
    assert await bounded(b.submit(4, "bad"), "a second load of a model that failed") == ("bad", 4)  # loads again
    m = models.metrics()
    assert m["load_failures"] == 1 and m["loads"] == 2 and b.keys == []
    await b.close()


async def test_cancelled_waiters_release_their_claim_on_a_load():
    """A request that gives up while its model waits for room causes no load."""
    actor, models, b = make(max_models=1)
    actor.run_gate = asyncio.Event()
    busy = b.enqueue(1, "m1")
    await until(lambda: actor.batches == [("m1", [1])], "m1's batch to run")
    waiter = asyncio.ensure_future(b.submit(2, "m2"))
    await settle()
    assert models.metrics()["waiting"] == ["m2"]
    waiter.cancel()
    await settle()
    actor.run_gate.set()
    await bounded(busy, "m1's held batch")
    await settle()  # the loader wakes when m1 goes idle, and finds m2 unclaimed
    assert actor.calls == [("m1", [])] and models.metrics()["waiting"] == []
    await b.close()


async def test_batches_never_mix_models_under_concurrency_and_eviction():
    """400 requests over 5 models, capacity 2, two slots: every result comes from its model."""
    actor, models, b = make(max_models=2, max_size=6, max_wait_s=0.002, slots=2)
    rng = random.Random(0)
    asks = [(i, f"m{rng.randrange(5)}") for i in range(400)]

    async def one(i, model_id):
        await asyncio.sleep(rng.random() * 0.05)
        return await b.submit(i, model_id)

    out = await bounded(asyncio.gather(*(one(i, m) for i, m in asks)), "400 results over 5 models", 20.0)
    assert out == [(m, i) for i, m in asks]
    assert models.evictions > 0  # eviction really happened meanwhile
    assert b.keys == [] and models.metrics()["waiting"] == []  # idle queues are gone
    await b.close()


async def test_metrics_count_loads_evictions_hits_and_batch_sizes():
    actor, models, b = make(max_models=1, max_size=4, max_wait_s=0.05)
    await bounded(asyncio.gather(*(b.submit(i, "a") for i in range(4))), "a's first batch")  # misses: a is loading
    await bounded(asyncio.gather(*(b.submit(i, "a") for i in range(2))), "a's second batch")  # hits
    await bounded(b.submit(0, "b"), "b's batch")
    sums = models.metrics()  # a replica reports sums; the means are computed from them
    assert sums["per_model"]["a"]["items"] == 6
    m = models_view(sums)
    assert (m["loads"], m["evictions"], m["hits"], m["misses"]) == (2, 1, 2, 5)
    assert m["per_model"]["a"] == {"requests": 6, "loads": 1, "batches": 2, "mean_batch_size": 3.0, "max_batch_size": 4}
    total = aggregate_metrics([sums, sums])
    assert total["loads"] == 4 and total["per_model"]["a"]["mean_batch_size"] == 3.0 and total["hit_rate"] == 2 / 7
    await b.close()


async def test_close_fails_requests_waiting_for_a_load():
    actor, models, b = make()
    actor.load_gate = asyncio.Event()
    fut = b.enqueue(1, "m1")
    await until(lambda: models.metrics()["loading"] == ["m1"], "m1's load to start")
    await b.close()
    with pytest.raises(Exception, match="closed"):
        await bounded(fut, "the error of a request whose load was closed")


# ------------------------------------------------------------------ routing
@dataclass
class FakeReplica:
    replica_id: int
    in_flight: int = 0
    models: set = field(default_factory=set)
    forming: set = field(default_factory=set)

    def has_forming(self, endpoint, key):
        return key in self.forming

    def has_model(self, model_id):
        return model_id in self.models

    @property
    def num_models(self):
        return len(self.models)


def test_model_aware_routes_to_a_replica_holding_the_model():
    reps = [FakeReplica(0, models={"a"}), FakeReplica(1, models={"b"}), FakeReplica(2)]
    assert ModelAware().choose(RouteRequest("ep", "b"), reps).replica_id == 1


def test_model_aware_prefers_a_holder_with_a_forming_batch():
    reps = [FakeReplica(0, models={"a"}), FakeReplica(1, in_flight=3, models={"a"}, forming={"a"})]
    assert ModelAware().choose(RouteRequest("ep", "a"), reps).replica_id == 1


def test_model_aware_sends_a_new_model_to_the_replica_with_fewest_models():
    reps = [FakeReplica(0, models={"a", "b"}), FakeReplica(1, models={"c"}), FakeReplica(2, models={"d", "e"})]
    assert ModelAware().choose(RouteRequest("ep", "z"), reps).replica_id == 1


def test_model_aware_stays_within_the_load_bound():
    """A holder past the bound is skipped: the model goes to one more replica."""
    r = ModelAware(load_factor=1.5, slack=0)
    reps = [
        FakeReplica(0, in_flight=12, models={"hot"}),
        FakeReplica(1, in_flight=2, models={"x"}),
        FakeReplica(2, in_flight=1, models={"y", "w"}),
    ]
    assert r.choose(RouteRequest("ep", "hot"), reps).replica_id == 1


def test_model_aware_balances_requests_without_a_model():
    r = ModelAware(seed=0)
    reps = [FakeReplica(0, in_flight=9), FakeReplica(1)]
    assert all(r.choose(RouteRequest("ep"), reps).replica_id == 1 for _ in range(10))


class CachedReplica:
    """A fake replica made of the real ``ReplicaModels`` and batcher, with a fake actor."""

    def __init__(self, replica_id, max_models):
        self.replica_id = replica_id
        self.in_flight = 0
        self.actor, self.models, self.batcher = make(max_models=max_models, max_size=8, max_wait_s=0.002)

    def has_forming(self, endpoint, key):
        return self.batcher.has_forming(key)

    def has_model(self, model_id):
        return self.models.holds(model_id)

    @property
    def num_models(self):
        return self.models.count

    async def submit(self, item, model_id):
        self.in_flight += 1
        try:
            return await self.batcher.submit(item, model_id)
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize("router, most_loads", [(ModelAware, 7), (RoundRobin, None)])
async def test_stream_over_six_models_loads_each_about_once_with_model_aware_routing(router, most_loads):
    """6 models, 3 replicas of capacity 2: model-aware routing loads each model about once;
    round robin makes every replica cycle through all six (it thrashes)."""
    reps = [CachedReplica(i, max_models=2) for i in range(3)]
    r = router()
    rng = random.Random(1)

    async def route(i, model_id):  # as the service does: choose, then enqueue at once
        return await r.choose(RouteRequest("predict", model_id), reps).submit(i, model_id)

    for _wave in range(40):
        asks = [(i, f"m{rng.randrange(6)}") for i in range(12)]
        out = await bounded(asyncio.gather(*(route(i, m) for i, m in asks)), "a wave of 12 requests over 6 models")
        assert out == [(m, i) for i, m in asks]
    loads = sum(rep.models.loads for rep in reps)
    if most_loads is not None:
        assert loads <= most_loads
        assert Counter(m for rep in reps for m in rep.actor.held) == Counter(f"m{k}" for k in range(6))
    else:
        assert loads > 60
    for rep in reps:
        await rep.batcher.close()
