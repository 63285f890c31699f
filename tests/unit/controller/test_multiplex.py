"""Model multiplexing on real Monarch CPU meshes: each behaviour of the multiplexing issue.

Every result says which model served it, so a test can check that no request was ever served
by another model than the one it named. The LRU and routing logic alone, with fakes, is in
``test_multiplex_logic.py``. Waits for results are bounded (``waits``), so a request that is
never served fails its test in seconds.
"""

import asyncio
import os
import random
import signal

import pytest
from waits import bounded, until

from forge.controller import (
    Batching,
    ForgeActor,
    ModelLoadError,
    ReplicaState,
    RequestTimeout,
    Router,
    endpoint,
    model_loader,
)
from forge.controller.multiplex import check_multiplexing, model_store

SLOW_LOAD_S = 1.5


class Predictor(ForgeActor):
    """Models are dicts naming themselves; the log shows loads, batches and evictions in order."""

    def __init__(self):
        self.log: list[tuple] = []

    @model_loader(max_models=2, unload="unload_model")
    async def load_model(self, model_id: str) -> dict:
        self.log.append(("load", model_id))
        await asyncio.sleep(SLOW_LOAD_S if model_id.startswith("slowload") else 0.02)
        if model_id.startswith("broken"):
            raise ValueError(f"no weights for {model_id}")
        return {"id": model_id}

    async def unload_model(self, model_id: str, model: dict) -> None:
        self.log.append(("evict", model_id))

    @endpoint(batch=Batching(max_size=8, max_wait_s=0.02), multiplexed=True)
    async def predict(self, model: dict, items: list) -> list:
        self.log.append(("run", model["id"], len(items)))
        return [(model["id"], x) for x in items]

    @endpoint(batch=Batching(max_size=8, max_wait_s=0.01), multiplexed=True)
    async def slow(self, model: dict, items: list) -> list:
        self.log.append(("start", model["id"]))
        await asyncio.sleep(0.2)
        self.log.append(("end", model["id"]))
        return [(model["id"], x) for x in items]

    @endpoint
    async def events(self) -> list:
        return self.log

    @endpoint
    async def held(self) -> list:
        return list(model_store(self).models)

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
async def solo():
    """One replica holding at most two models."""
    svc = await Predictor.options(num_replicas=1).as_service()
    yield svc
    await svc.shutdown()


@pytest.fixture(scope="module")
async def trio():
    """Three replicas of two models each, model-aware routing (the default)."""
    svc = await Predictor.options(num_replicas=3).as_service()
    yield svc
    await svc.shutdown()


async def since(svc, mark: int) -> list:
    return (await svc.events.route())[mark:]


async def test_every_request_is_served_by_the_model_it_named(solo):
    """Ray #56633: 120 requests over 3 models (capacity 2: evictions), arriving in random order."""
    rng = random.Random(0)
    asks = [(i, f"n{rng.randrange(3)}") for i in range(120)]

    async def ask(i, model_id):
        await asyncio.sleep(rng.random() * 0.3)
        return await solo.predict.route(i, model_id=model_id)

    before = solo.metrics()["models"]["evictions"]
    out = await bounded(asyncio.gather(*(ask(i, m) for i, m in asks)), "120 requests over 3 models", 30)
    assert out == [(m, i) for i, m in asks]
    assert solo.metrics()["models"]["evictions"] > before


async def test_batches_fill_per_model_while_models_share_the_replica(solo):
    """Ray #50695: 16 requests for each of two models, interleaved: four full batches of 8."""
    mark = len(await solo.events.route())
    calls = asyncio.gather(*(solo.predict.route(i, model_id="f1" if i % 2 else "f2") for i in range(32)))
    await bounded(calls, "32 requests over two models", 20)
    runs = [e for e in await since(solo, mark) if e[0] == "run"]
    assert sorted(runs) == [("run", "f1", 8), ("run", "f1", 8), ("run", "f2", 8), ("run", "f2", 8)]
    per_model = solo.metrics()["models"]["per_model"]
    assert per_model["f1"]["max_batch_size"] == 8 and per_model["f2"]["max_batch_size"] == 8


async def test_least_recently_used_idle_model_is_evicted(solo):
    for model_id in ("a", "b", "a", "c"):
        await bounded(solo.predict.route(0, model_id=model_id), f"a request for model {model_id}", 10)
    assert await solo.held.route() == ["a", "c"]


async def test_model_with_running_work_is_never_evicted(solo):
    """Two models busy in slow batches and a third asked for: it loads only after one of them
    finished its batch, and the evicted one had nothing left to run."""
    mark = len(await solo.events.route())
    busy = [asyncio.ensure_future(solo.slow.route(i, model_id=m)) for i, m in enumerate(["x", "y", "x", "y"])]
    models = solo.service.replicas[0].models
    await until(lambda: sorted(models.metrics()["loaded"]) == ["x", "y"], "x and y loaded, with work queued", 10)
    third = await bounded(solo.slow.route(9, model_id="z"), "z loaded once x or y has no work left", 20)
    assert third == ("z", 9)
    assert await bounded(asyncio.gather(*busy), "x's and y's batches", 20) == [("x", 0), ("y", 1), ("x", 2), ("y", 3)]
    log = await since(solo, mark)
    evicted = [e[1] for e in log if e[0] == "evict"]
    for victim in set(evicted) & {"x", "y"}:
        last_end = max(i for i, e in enumerate(log) if e == ("end", victim))
        assert log.index(("evict", victim)) > last_end
    assert ("load", "z") in log


async def test_failed_load_fails_only_its_requests(solo):
    calls = asyncio.gather(
        solo.predict.route(1, model_id="broken"),
        solo.predict.route(2, model_id="a"),
        solo.predict.route(3, model_id="broken"),
        return_exceptions=True,
    )
    out = await bounded(calls, "a failed load's errors and another model's result", 10)
    assert out[1] == ("a", 2)
    for err in (out[0], out[2]):
        assert isinstance(err, ModelLoadError) and err.type_name == "ValueError" and "no weights for broken" in str(err)
    with pytest.raises(ModelLoadError):  # the next request tries the load again
        await bounded(solo.predict.route(4, model_id="broken"), "the second load's error", 10)
    assert solo.metrics()["models"]["load_failures"] == 2
    assert await bounded(solo.predict.route(5, model_id="a"), "a result after failed loads", 10) == ("a", 5)


async def test_idle_model_queues_are_removed(solo):
    await bounded(asyncio.gather(*(solo.predict.route(i, model_id=f"q{i % 4}") for i in range(16))), "results", 20)
    replica = solo.service.replicas[0]
    assert replica.batchers["predict"].keys == []
    assert replica.metrics()["models"]["waiting"] == [] and replica.metrics()["models"]["loading"] == []


class ProbingRoundRobin(Router):
    """Round robin that first asks every replica whether the key's batch is forming, as a
    batch-aware router does: a probe of a replica the request then does not go to."""

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, request, replicas):
        for replica in replicas:
            replica.has_forming(request.endpoint, request.key)
        self.turn += 1
        return replicas[self.turn % len(replicas)]


async def test_a_caller_that_times_out_during_a_load_leaves_no_stuck_queue():
    """Callers time out while their model loads on two replicas; a router's probe then empties
    both queues during the load. Once loaded, later requests below max_size are still served
    on either replica, in about max_wait_s, not after their own timeout."""
    svc = await Predictor.options(num_replicas=2, endpoint_routers={"predict": ProbingRoundRobin()}).as_service()
    try:
        out = await svc.predict.fanout(0, model_id="slowload-m", timeout=0.3)  # both replicas load it
        pytest.fail(f"the fanout should have timed out while the model loads, got {out}")
    except RequestTimeout:
        pass
    try:
        during = await asyncio.wait_for(svc.predict.route(1, model_id="slowload-m"), SLOW_LOAD_S + 10)
        assert during == ("slowload-m", 1)
        after = [await asyncio.wait_for(svc.predict.route(i, model_id="slowload-m"), 5.0) for i in range(2, 6)]
        assert after == [("slowload-m", i) for i in range(2, 6)]
        for replica in svc.service.replicas:
            assert replica.batchers["predict"].keys == []  # no queue outlived its last item
    finally:
        await svc.shutdown()


async def test_route_needs_a_model_id(solo):
    with pytest.raises(TypeError, match="is multiplexed: name the model"):
        await solo.predict.route(1)
    with pytest.raises(TypeError, match="is multiplexed: name the model"):
        await solo.predict.route(1, key="a")
    with pytest.raises(TypeError, match="no key= or batch_key="):
        await solo.predict.route(1, model_id="a", batch_key="a")


async def test_model_aware_routing_loads_each_model_about_once(trio):
    """A stream over 6 models on 3 replicas of capacity 2: each model is loaded about once,
    and each replica ends up holding two of them."""
    rng = random.Random(2)
    for _ in range(15):
        asks = [(i, f"s{rng.randrange(6)}") for i in range(12)]
        out = await bounded(asyncio.gather(*(trio.predict.route(i, model_id=m) for i, m in asks)), "a wave", 20)
        assert out == [(m, i) for i, m in asks]
    m = trio.metrics()["models"]
    assert m["loads"] <= 7 and m["evictions"] <= 1
    assert m["hit_rate"] > 0.8
    held = await trio.held.fanout()
    assert sorted(x for h in held for x in h) == [f"s{k}" for k in range(6)] and all(len(h) == 2 for h in held)


async def test_metrics_report_loads_evictions_hits_and_per_model_batches(trio):
    """Its own traffic first, so that it holds when run alone too."""
    assert await trio.predict.route_many([1, 2, 3], model_id="s0") == [("s0", 1), ("s0", 2), ("s0", 3)]
    m = trio.metrics()
    models = m["models"]
    for key in ("loads", "evictions", "hits", "misses", "load_failures", "mean_load_s", "hit_rate", "per_model"):
        assert key in models
    for key in ("requests", "loads", "batches", "mean_batch_size", "max_batch_size"):
        assert key in models["per_model"]["s0"]
    assert models["mean_load_s"] >= 0.02  # the loader sleeps 20 ms
    assert set(m["replicas"][0]["models"]["loaded"]) <= {f"s{k}" for k in range(6)}


async def test_fanout_loads_the_model_on_every_replica(trio):
    assert await trio.predict.fanout(7, model_id="everywhere") == [("everywhere", 7)] * 3


async def test_round_robin_thrashes_where_model_aware_does_not():
    """The same kind of stream with round robin: every replica cycles through all six models."""
    svc = await Predictor.options(num_replicas=3, router="round_robin").as_service()
    try:
        rng = random.Random(2)
        for _ in range(15):
            asks = [(i, f"s{rng.randrange(6)}") for i in range(12)]
            out = await bounded(asyncio.gather(*(svc.predict.route(i, model_id=m) for i, m in asks)), "a wave", 20)
            assert out == [(m, i) for i, m in asks]
        assert svc.metrics()["models"]["loads"] >= 20
    finally:
        await svc.shutdown()


async def test_requests_of_a_killed_replica_are_served_by_their_model_elsewhere():
    """A replica dies mid-stream: its requests are resent to the survivor, which loads their
    models; the restarted replica starts with no model and serves again."""
    svc = await Predictor.options(num_replicas=2, max_models=4, restart_backoff_s=0.2).as_service()
    try:
        await asyncio.gather(*(svc.predict.route(0, model_id=f"k{k}") for k in range(4)))
        victim = svc.service.replicas[0]
        victim_models = victim.metrics()["models"]["loaded"]
        pid = await victim.call("pid", (), {}, 10)
        rng = random.Random(3)
        asks = [(i, f"k{rng.randrange(4)}") for i in range(300)]

        async def ask(i, model_id):
            await asyncio.sleep(i * 0.003)
            return await svc.predict.route(i, model_id=model_id)

        tasks = [asyncio.ensure_future(ask(i, m)) for i, m in asks]
        await until(lambda: sum(t.done() for t in tasks) >= 50, "50 answers before the kill", 10)
        os.kill(pid, signal.SIGKILL)
        out = await bounded(asyncio.gather(*tasks), "every request answered by its model after the kill", 30)
        assert out == [(m, i) for i, m in asks]
        assert svc.metrics()["retried"] > 0
        survivor = svc.service.replicas[1].metrics()["models"]
        assert set(victim_models) <= set(survivor["loaded"])
        await until(lambda: victim.state is ReplicaState.HEALTHY, "the killed replica to be healthy again", 20)
        assert victim.generation == 1 and victim.metrics()["models"]["loads"] == 0
        assert await svc.predict.fanout(1, model_id="k0") == [("k0", 1)] * 2
    finally:
        await svc.shutdown()


async def test_requests_that_wait_for_admission_keep_their_model():
    """Past max_in_flight_per_replica a request is not queued at call time: it waits for
    admission, and is then served by the model it named like any other."""
    svc = await Predictor.options(num_replicas=1, max_in_flight_per_replica=2).as_service()
    try:
        asks = [(i, "w1" if i % 2 else "w2") for i in range(6)]
        out = await bounded(asyncio.gather(*(svc.slow.route(i, model_id=m) for i, m in asks)), "admitted requests", 20)
        assert out == [(m, i) for i, m in asks]
    finally:
        await svc.shutdown()


async def test_plain_actor_mesh_loads_models_on_demand():
    actor = await Predictor.as_actor()
    try:
        assert await actor.predict.call_one("m5", [1, 2]) == [("m5", 1), ("m5", 2)]
        for model_id in ("m6", "m7"):
            await actor.predict.call_one(model_id, [0])
        assert await actor.held.call_one() == ["m6", "m7"]  # capacity 2: m5 was evicted
    finally:
        await ForgeActor.shutdown(actor)


# ------------------------------------------------------------------ declaration errors
def test_multiplexed_endpoint_needs_a_batch():
    with pytest.raises(TypeError, match="needs batch=Batching"):

        @endpoint(multiplexed=True)
        async def predict(self, model, items): ...


def test_multiplexed_endpoint_takes_the_model_and_the_batch():
    with pytest.raises(
        TypeError, match="must take exactly two required arguments \\(the model, the batch\\), got \\['items'\\]"
    ):

        @endpoint(batch=Batching(), multiplexed=True)
        async def predict(self, items): ...


def test_multiplexed_endpoint_rejects_a_batching_key():
    with pytest.raises(TypeError, match="batching key is the model id"):

        @endpoint(batch=Batching(key=len), multiplexed=True)
        async def predict(self, model, items): ...


def test_model_loader_must_be_async_and_take_a_model_id():
    with pytest.raises(TypeError, match="model loaders must be 'async def'"):

        @model_loader(max_models=2)
        def load(self, model_id): ...

    with pytest.raises(TypeError, match="exactly one required argument \\(the model id\\)"):

        @model_loader
        async def load2(self): ...

    with pytest.raises(ValueError, match="max_models=...\\) must be an integer >= 1, got 0"):
        model_loader(max_models=0)(Predictor.load_model)


def test_service_option_max_models_overrides_the_loaders():
    assert check_multiplexing(Predictor, {"predict"}, 5).max_models == 5
    assert check_multiplexing(Predictor, {"predict"}).max_models == 2
    with pytest.raises(ValueError, match="max_models=...\\) must be an integer >= 1, got 0"):
        Predictor.options(max_models=0)
    with pytest.raises(ValueError, match="has no multiplexed endpoint"):
        check_multiplexing(ForgeActor, set(), 3)


def test_multiplexed_endpoints_need_a_model_loader():
    class NoLoader(ForgeActor):
        @endpoint(batch=Batching(), multiplexed=True)
        async def predict(self, model, items):
            return items

    with pytest.raises(TypeError, match="are multiplexed but no method is marked @model_loader"):
        asyncio.run(NoLoader.as_service())
