"""Model multiplexing: many models per replica, loaded on demand, batched per model.

An actor declares how to load one model and how many fit on a replica; its multiplexed
endpoints receive a batch of one model's requests together with that model::

    class Predictor(ForgeActor):
        @model_loader(max_models=3)
        async def load_model(self, model_id: str) -> Any:
            return load_from_disk(model_id)

        @endpoint(batch=Batching(max_size=16, max_wait_s=0.01), multiplexed=True)
        async def predict(self, model: Any, items: list) -> list:
            return model(items)

    svc = await Predictor.options(num_replicas=3).as_service()
    y = await svc.predict.route(x, model_id="m7")

The contract, clause by clause (each has a test):

- A request is served by the model it named, never another. A batch holds the items of one
  model's queue, its message carries that model id, and the actor looks the model up by it.
  (Ray #56633: a mixed batch was served by its first request's model.)
- Batches form per model in the replica's ``Batcher``, whose per-model queues share the
  endpoint's execution slots, so each model's batches fill instead of a filled mixed batch being
  split into small ones (Ray #50695). A model's queue is held back while the model loads, and
  keeps growing meanwhile; idle queues are removed.
- A replica holds at most ``max_models`` models (``options(max_models=...)`` overrides the
  loader's). A request for a model it lacks starts a load, which first evicts the least recently
  used model (a request or a finished batch uses it) that has no queued or running work. If every
  model has work, the least recently used one *drains*: its queued work finishes, new requests
  for it wait for a reload, then it is evicted; so busy models cannot starve a waiting one.
  Loads run one at a time per replica, each evicting before it loads.
- A model that fails to load fails only the requests that named it (``ModelLoadError``); the
  next request for it tries again.
- ``model_aware`` routing (the default for multiplexed endpoints) sends a request to a replica
  that has its model loaded, loading or waiting to load, preferring one where a batch for it is
  forming; else to a replica with the fewest models. Both stay within a load bound
  (``load_factor`` x the mean in-flight load, plus ``slack``): past it, a hot model is loaded on
  one more replica.
- ``svc.metrics()["models"]``: loads, evictions, hits (requests that found their model loaded),
  misses (requests that waited for a load), load failures and time, and per model its
  requests, loads and batch sizes.

The controller-side replica decides every load and eviction (it owns the queues, so it knows
each model's queued and running work); the actor only obeys ``_forge_load_model`` messages.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import functools
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from forge.controller.batching import Batcher, Batching
from forge.controller.errors import EndpointError, ModelLoadError
from forge.controller.routing import KeyAffinity, ReplicaView, RouteRequest, least_loaded_of_two, register_router

logger = logging.getLogger("forge.multiplex")

LOAD_ENDPOINT = "_forge_load_model"
"""The ForgeActor endpoint a replica sends to evict models and load one."""
_LOADER_ATTR = "_forge_model_loader"
_STORE_ATTR = "_forge_model_store"


# ---------------------------------------------------------------- declaring
@dataclass(frozen=True)
class Multiplexing:
    """How an actor loads its models; ``@model_loader`` makes one (see the module docstring)."""

    max_models: int = 3
    """Most models one replica holds at once, counting the one loading."""
    loader: str = "load_model"
    """Name of the actor's ``async def loader(self, model_id) -> model`` method."""
    unload: str | None = None
    """Name of an actor method ``async def unload(self, model_id, model)`` run when a model is
    evicted (e.g. to free GPU memory at once). None: the model is just dropped."""

    def __post_init__(self) -> None:
        if isinstance(self.max_models, bool) or not isinstance(self.max_models, int) or self.max_models < 1:
            raise ValueError(f"model_loader(max_models=...) must be an integer >= 1, got {self.max_models!r}")
        if self.unload is not None and not isinstance(self.unload, str):
            raise TypeError(f"model_loader(unload=...) must be the name of an actor method, got {self.unload!r}")


def model_loader(method: Callable[..., Any] | None = None, *, max_models: int = 3, unload: str | None = None) -> Any:
    """Mark an actor method as its model loader: ``async def load(self, model_id) -> model``.

    Example::

        @model_loader(max_models=3)
        async def load_model(self, model_id: str) -> torch.nn.Module:
            return AutoModelForCausalLM.from_pretrained(self.root / model_id)
    """

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"model loaders must be 'async def' ({fn.__qualname__} is not)")
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        required = [
            p
            for p in params
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(required) != 1:
            raise TypeError(
                f"model loader {fn.__qualname__} must take exactly one required argument (the model id), "
                f"got {[p.name for p in required]}"
            )
        setattr(fn, _LOADER_ATTR, Multiplexing(max_models=max_models, loader=fn.__name__, unload=unload))
        return fn

    return mark if method is None else mark(method)


def multiplexing_of(actor_cls: type) -> Multiplexing | None:
    """The ``Multiplexing`` an actor class declares with ``@model_loader``, or None."""
    specs = [
        spec
        for name in dir(actor_cls)
        if (spec := getattr(getattr(actor_cls, name, None), _LOADER_ATTR, None)) is not None
    ]
    if len(specs) > 1:
        raise TypeError(
            f"{actor_cls.__name__} marks {len(specs)} methods with @model_loader "
            f"({[s.loader for s in specs]}); mark one"
        )
    if not specs:
        return None
    spec = specs[0]
    if spec.unload is not None and not callable(getattr(actor_cls, spec.unload, None)):
        raise TypeError(
            f"model_loader(unload={spec.unload!r}): {actor_cls.__name__} has no method named {spec.unload!r}"
        )
    return spec


def check_multiplexing(
    actor_cls: type, multiplexed: Sequence[str], max_models: int | None = None
) -> Multiplexing | None:
    """A service's multiplexing, checked: multiplexed endpoints need a model loader.
    ``max_models`` (the ``options(max_models=...)`` of the service) overrides the loader's."""
    spec = multiplexing_of(actor_cls)
    if multiplexed and spec is None:
        raise TypeError(
            f"{actor_cls.__name__}: endpoints {sorted(multiplexed)} are multiplexed but no method is marked "
            f"@model_loader; add `@model_loader(max_models=...) async def load_model(self, model_id)`"
        )
    if max_models is not None:
        if not multiplexed:
            raise ValueError(f"options(max_models={max_models}): {actor_cls.__name__} has no multiplexed endpoint")
        spec = dataclasses.replace(spec, max_models=max_models)  # type: ignore[arg-type]
    return spec


def multiplexed_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """The endpoint body Monarch runs: ``(model_id, batch)`` -> ``method(self, model, batch)``.

    Called directly on an actor mesh (``actor.predict.call_one("m7", [x])``) it loads the model
    on demand; under a service the replica has loaded it before sending the batch.
    """

    @functools.wraps(method)
    async def serve(self: Any, model_id: Hashable, batch: Any) -> Any:
        store = model_store(self)
        model = await store.acquire(model_id)
        try:
            return await method(self, model, batch)
        finally:
            store.release(model_id)

    del serve.__wrapped__  # Monarch and forge read this signature, not the user's
    return serve


# ---------------------------------------------------------------- actor side
class _ModelStore:
    """The models one actor process holds.

    A service's replica decides what it loads and evicts (``load``). Called directly on an
    actor mesh, it loads on demand and, past ``max_models``, evicts its least recently used
    model that no call is using.
    """

    def __init__(self, actor: Any, spec: Multiplexing) -> None:
        self.actor = actor
        self.spec = spec
        self.models: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()  # least recently used first
        self._loading: dict[Hashable, asyncio.Future] = {}
        self._in_use: collections.Counter = collections.Counter()

    async def load(self, model_id: Hashable, evict: Sequence[Hashable] = ()) -> None:
        """The replica's order: it counts the room (its capacity may differ from ours)."""
        for victim in evict:
            await self.evict(victim)
        await self._get(model_id, make_room=False)

    async def acquire(self, model_id: Hashable) -> Any:
        model = await self._get(model_id)
        self._in_use[model_id] += 1
        return model

    def release(self, model_id: Hashable) -> None:
        self._in_use[model_id] -= 1
        if self._in_use[model_id] <= 0:
            del self._in_use[model_id]

    async def evict(self, model_id: Hashable) -> None:
        if model_id not in self.models:
            return
        model = self.models.pop(model_id)
        if self.spec.unload is not None:
            await getattr(self.actor, self.spec.unload)(model_id, model)

    async def _get(self, model_id: Hashable, make_room: bool = True) -> Any:
        if model_id in self.models:
            self.models.move_to_end(model_id)
            return self.models[model_id]
        if model_id in self._loading:
            return await asyncio.shield(self._loading[model_id])
        future = self._loading[model_id] = asyncio.get_running_loop().create_future()
        try:
            if make_room:
                await self._make_room()
            model = await getattr(self.actor, self.spec.loader)(model_id)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a load nobody else waited for logs no warning
            raise
        finally:
            del self._loading[model_id]
        self.models[model_id] = model
        future.set_result(model)
        return model

    async def _make_room(self) -> None:
        """Direct calls only: a replica evicts before it asks for a load, so there is room."""
        while len(self.models) + len(self._loading) > self.spec.max_models:
            idle = next((m for m in self.models if m not in self._in_use), None)
            if idle is None:
                return  # every model is in use: hold one more rather than break a call
            await self.evict(idle)


def model_store(actor: Any) -> _ModelStore:
    """The actor's model store, made on first use."""
    store = actor.__dict__.get(_STORE_ATTR)
    if store is None:
        spec = multiplexing_of(type(actor))
        if spec is None:
            raise TypeError(f"{type(actor).__name__} has no method marked @model_loader, so it cannot load models")
        store = actor.__dict__[_STORE_ATTR] = _ModelStore(actor, spec)
    return store


# ---------------------------------------------------------------- replica side
class _State(enum.Enum):
    WANTED = "wanted"  # requests wait for room and a load
    LOADING = "loading"
    LOADED = "loaded"
    DRAINING = "draining"  # queued work finishes; new requests wait for a reload; then evicted


@dataclass(eq=False)
class _Model:
    """One model on one replica, as the replica's controller side tracks it."""

    model_id: Hashable
    key: tuple  # its batcher key, (model_id, epoch): a reload starts a new epoch and queue
    state: _State = _State.WANTED
    pending: int = 0  # requests not yet answered: queued, or in a running batch
    running: int = 0  # batches on the actor (a batch outlives its cancelled callers)

    @property
    def idle(self) -> bool:
        return self.pending == 0 and self.running == 0


@dataclass
class _ModelStats:
    requests: int = 0
    loads: int = 0
    batches: int = 0
    items: int = 0
    max_batch_size: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "loads": self.loads,
            "batches": self.batches,
            "mean_batch_size": self.items / self.batches if self.batches else 0.0,
            "max_batch_size": self.max_batch_size,
        }


class ReplicaModels:
    """One replica's models as the controller sees them: resident (loading, loaded, draining)
    and wanted, the work queued and running for each, and the one task that evicts and loads.

    ``load(model_id, evict)`` evicts the models in ``evict`` on the actor, then loads
    ``model_id`` there (a replica sends ``_forge_load_model``; tests pass a coroutine).
    """

    def __init__(
        self, spec: Multiplexing, load: Callable[[Hashable, list], Awaitable[Any]], *, name: str = "models"
    ) -> None:
        self.spec = spec
        self.name = name
        self.loads = self.evictions = self.hits = self.misses = self.load_failures = 0
        self.load_s_total = 0.0
        self.per_model: dict[Hashable, _ModelStats] = {}
        self._load = load
        self._resident: collections.OrderedDict[Hashable, _Model] = collections.OrderedDict()  # LRU first
        self._wanted: collections.OrderedDict[Hashable, _Model] = collections.OrderedDict()  # first come first
        self._batchers: list[Batcher] = []
        self._epochs = itertools.count()
        self._changed = asyncio.Event()  # a model went idle, or a wanted one lost its callers
        self._loader: asyncio.Task | None = None
        self._closed = False

    def batcher(
        self, spec: Batching, execute: Callable[[list[Any], Hashable], Awaitable[Sequence[Any]]], *, name: str
    ) -> Batcher:
        """A batcher for one multiplexed endpoint: per-model queues, ``execute(items, model_id)``."""
        batcher = _ModelBatcher(self, spec, self._serving(execute), name=name)
        self._batchers.append(batcher)
        return batcher

    # ------------------------------------------------------------ routing views
    def holds(self, model_id: Hashable) -> bool:
        """Whether a request for ``model_id`` would find it loaded, loading or waiting to load."""
        return self.current(model_id) is not None

    @property
    def count(self) -> int:
        """Models resident or waiting to load (``model_aware`` prefers replicas with fewer)."""
        return len(self._resident.keys() | self._wanted.keys())

    def current(self, model_id: Hashable) -> _Model | None:
        """The record a new request for ``model_id`` joins, if there is one yet."""
        rec = self._resident.get(model_id)
        if rec is not None and rec.state is not _State.DRAINING:
            return rec
        return self._wanted.get(model_id)

    # ------------------------------------------------------------ request path
    def admit(self, model_id: Hashable) -> _Model:
        """The record a new request for ``model_id`` joins; a new wanted one starts the loader."""
        rec = self._resident.get(model_id)
        if rec is not None and rec.state is not _State.DRAINING:
            self._resident.move_to_end(model_id)
            return rec
        rec = self._wanted.get(model_id)
        if rec is None:
            rec = self._wanted[model_id] = _Model(model_id, (model_id, next(self._epochs)))
            if not self._closed and (self._loader is None or self._loader.done()):
                self._loader = asyncio.get_running_loop().create_task(self._load_loop(), name=f"{self.name}-loader")
        return rec

    def track(self, rec: _Model, future: asyncio.Future) -> None:
        """Count one queued request of ``rec`` until its future is done."""
        rec.pending += 1
        self._stats(rec.model_id).requests += 1
        if rec.state is _State.LOADED:
            self.hits += 1
        else:
            self.misses += 1
        future.add_done_callback(functools.partial(self._answered, rec))

    def _answered(self, rec: _Model, _: asyncio.Future) -> None:
        rec.pending -= 1
        if rec.idle:
            self._changed.set()

    def runnable(self, key: Hashable) -> bool:
        """The batcher's gate: a model's queue runs only while that load of it is resident."""
        rec = self._resident.get(key[0])  # type: ignore[index]
        return rec is not None and rec.key == key and rec.state in (_State.LOADED, _State.DRAINING)

    def _serving(
        self, execute: Callable[[list[Any], Hashable], Awaitable[Sequence[Any]]]
    ) -> Callable[[list[Any], Hashable], Awaitable[Sequence[Any]]]:
        async def run(items: list[Any], key: Hashable) -> Sequence[Any]:
            model_id = key[0]  # type: ignore[index]
            rec = self._resident.get(model_id)
            if rec is None or rec.key != key or rec.state not in (_State.LOADED, _State.DRAINING):
                # Unreachable by construction (a model with queued work is never evicted);
                # failing the batch is the safe answer if it ever happens.
                raise RuntimeError(
                    f"{self.name}: a batch for model {model_id!r} was ready while that model was not loaded"
                )
            rec.running += 1
            if rec.state is _State.LOADED:
                self._resident.move_to_end(model_id)
            stats = self._stats(model_id)
            stats.batches += 1
            stats.items += len(items)
            stats.max_batch_size = max(stats.max_batch_size, len(items))
            try:
                return await execute(items, model_id)
            finally:
                rec.running -= 1
                if rec.state is _State.LOADED:  # just served: recently used
                    self._resident.move_to_end(model_id)
                if rec.idle:
                    self._changed.set()

        return run

    # ------------------------------------------------------------ loads and evictions
    async def _load_loop(self) -> None:
        """Load wanted models one at a time, oldest first, evicting to make room."""
        try:
            while self._wanted and not self._closed:
                self._changed.clear()
                rec = next(iter(self._wanted.values()))
                if rec.pending == 0:  # every caller gave up (or its enqueue failed)
                    del self._wanted[rec.model_id]
                    continue
                old = self._resident.get(rec.model_id)
                if old is not None:  # it is draining: once idle, the new requests reuse it as is
                    if old.idle:
                        del self._wanted[rec.model_id]
                        self._resident[rec.model_id] = rec
                        self._resident.move_to_end(rec.model_id)
                        self._loaded(rec)
                    else:
                        await self._changed.wait()
                    continue
                evict: list[Hashable] = []
                if len(self._resident) >= self.spec.max_models:
                    victim = self._victim()
                    if victim is None:
                        await self._changed.wait()
                        continue
                    del self._resident[victim.model_id]
                    self.evictions += 1
                    evict.append(victim.model_id)
                del self._wanted[rec.model_id]
                rec.state = _State.LOADING
                self._resident[rec.model_id] = rec
                await self._load_one(rec, evict)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must fail the waiting callers, not hang them
            logger.exception("%s: the model loader stopped", self.name)
            for rec in [*self._wanted.values(), *self._resident.values()]:
                if rec.state in (_State.WANTED, _State.LOADING):
                    self._fail(rec, exc)
            self._wanted.clear()

    def _victim(self) -> _Model | None:
        """The model to evict now: the draining one once idle, else the least recently used
        idle one. If none is idle, start draining the least recently used one; None: wait."""
        draining = next((r for r in self._resident.values() if r.state is _State.DRAINING), None)
        if draining is not None and draining.idle:
            return draining
        idle = next((r for r in self._resident.values() if r.state is _State.LOADED and r.idle), None)
        if idle is not None:
            return idle
        if draining is None:
            lru = next((r for r in self._resident.values() if r.state is _State.LOADED), None)
            if lru is not None:
                lru.state = _State.DRAINING
                logger.debug("%s: draining model %r to make room", self.name, lru.model_id)
        return None

    async def _load_one(self, rec: _Model, evict: list[Hashable]) -> None:
        t0 = time.monotonic()
        try:
            await self._load(rec.model_id, evict)
        except Exception as exc:
            self.load_failures += 1
            if isinstance(exc, EndpointError):
                exc = ModelLoadError(
                    f"{self.name}: {self.spec.loader}({rec.model_id!r})", exc.type_name, exc.remote_message, exc.remote
                )
            logger.warning("loading model %r failed: %s", rec.model_id, exc)
            if self._resident.get(rec.model_id) is rec:
                del self._resident[rec.model_id]
            self._fail(rec, exc)
            return
        self.loads += 1
        self._stats(rec.model_id).loads += 1
        self.load_s_total += time.monotonic() - t0
        self._loaded(rec)

    def _loaded(self, rec: _Model) -> None:
        rec.state = _State.LOADED
        for batcher in self._batchers:
            batcher.wake()

    def _fail(self, rec: _Model, error: BaseException) -> None:
        for batcher in self._batchers:
            batcher.fail(rec.key, error)

    async def close(self) -> None:
        """Stop loading (the batchers fail what is queued)."""
        self._closed = True
        loader, self._loader = self._loader, None
        if loader is not None and loader is not asyncio.current_task():
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)

    # ------------------------------------------------------------ metrics
    def _stats(self, model_id: Hashable) -> _ModelStats:
        stats = self.per_model.get(model_id)
        if stats is None:
            stats = self.per_model[model_id] = _ModelStats()
        return stats

    def metrics(self) -> dict[str, Any]:
        by_state = {state: [m for m, r in self._resident.items() if r.state is state] for state in _State}
        return {
            "max_models": self.spec.max_models,
            "loaded": by_state[_State.LOADED] + by_state[_State.DRAINING],  # least recently used first
            "loading": by_state[_State.LOADING],
            "waiting": list(self._wanted),
            "loads": self.loads,
            "evictions": self.evictions,
            "hits": self.hits,
            "misses": self.misses,
            "load_failures": self.load_failures,
            "load_s_total": self.load_s_total,
            "per_model": {m: s.as_dict() for m, s in self.per_model.items()},
        }


class _ModelBatcher(Batcher):
    """A ``Batcher`` whose queues are per model (and per load of it), gated on the load."""

    def __init__(
        self,
        models: ReplicaModels,
        spec: Batching,
        execute: Callable[[list[Any], Hashable], Awaitable[Sequence[Any]]],
        *,
        name: str,
    ) -> None:
        super().__init__(spec, execute, name=name, runnable=models.runnable)
        self._models = models

    def enqueue(self, item: Any, key: Hashable = None) -> asyncio.Future:
        if key is None:
            raise TypeError(f"{self.name} is multiplexed: every request needs a model id")
        rec = self._models.admit(key)
        future = super().enqueue(item, rec.key)
        self._models.track(rec, future)
        return future

    def has_forming(self, key: Hashable) -> bool:
        rec = self._models.current(key)
        return rec is not None and super().has_forming(rec.key)

    async def close(self, error: BaseException | None = None) -> None:
        await super().close(error)
        await self._models.close()


def aggregate_metrics(replica_models: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``svc.metrics()["models"]``: the replicas' model metrics summed, per model too."""
    keys = ("loads", "evictions", "hits", "misses", "load_failures")
    total: dict[str, Any] = {k: sum(m[k] for m in replica_models) for k in keys}
    load_s = sum(m["load_s_total"] for m in replica_models)
    total["mean_load_s"] = load_s / total["loads"] if total["loads"] else 0.0
    asked = total["hits"] + total["misses"]
    total["hit_rate"] = total["hits"] / asked if asked else 0.0
    per_model: dict[Hashable, dict[str, Any]] = {}
    for m in replica_models:
        for model_id, s in m["per_model"].items():
            t = per_model.setdefault(
                model_id, {"requests": 0, "loads": 0, "batches": 0, "items": 0.0, "max_batch_size": 0}
            )
            t["requests"] += s["requests"]
            t["loads"] += s["loads"]
            t["batches"] += s["batches"]
            t["items"] += s["mean_batch_size"] * s["batches"]
            t["max_batch_size"] = max(t["max_batch_size"], s["max_batch_size"])
    for t in per_model.values():
        items = t.pop("items")
        t["mean_batch_size"] = items / t["batches"] if t["batches"] else 0.0
    total["per_model"] = per_model
    return total


# ---------------------------------------------------------------- routing
class ModelReplicaView(ReplicaView, Protocol):
    """What ``ModelAware`` looks at besides load: which models a replica holds, and how many."""

    def has_model(self, model_id: Hashable) -> bool: ...

    @property
    def num_models(self) -> int: ...


class ModelAware(KeyAffinity):
    """Model-aware routing for multiplexed endpoints; the key is the model id.

    A replica that holds the model (loaded, loading or waiting to load) takes the request,
    preferring one where a batch for the model is forming, then the least loaded. Failing
    that, a replica with the fewest models (ties: least loaded, then rendezvous hashing, so
    that equal states agree). Both stay within ``KeyAffinity.bound``: a hot model whose
    replicas are past it is loaded on one more replica. Arguments as for ``KeyAffinity``.

    The bound is looser than ``KeyAffinity``'s by default (2x the mean plus 8, not 1.5x plus
    2): a spill costs a model load, and often an eviction that costs another, so the bound
    should catch a hot model's sustained excess, not the noise of a burst. (In a simulation
    of 6 models on 3 replicas of capacity 2, bursts of 48 requests made 1.5x+2 load 11 to 43
    models where 6 suffice; 2x+8 loaded 6.)
    """

    def __init__(self, load_factor: float = 2.0, slack: int = 8, batch_aware: bool = True, seed: int | None = None):
        super().__init__(load_factor=load_factor, slack=slack, batch_aware=batch_aware, seed=seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ModelReplicaView]) -> ModelReplicaView:  # type: ignore[override]
        model_id = request.key
        if model_id is None:
            return least_loaded_of_two(replicas, self._rng)  # type: ignore[return-value]
        bound = self.bound(replicas)
        within = [r for r in replicas if r.in_flight < bound] or list(replicas)
        holders = [r for r in within if r.has_model(model_id)]
        if holders:
            if self.batch_aware:
                holders = [r for r in holders if r.has_forming(request.endpoint, model_id)] or holders
            return min(holders, key=lambda r: r.in_flight)
        fewest = min(r.num_models for r in within)
        ties = [r for r in within if r.num_models == fewest]
        least = min(r.in_flight for r in ties)
        return self.owner(model_id, [r for r in ties if r.in_flight == least])  # type: ignore[return-value]


register_router("model_aware", ModelAware)
