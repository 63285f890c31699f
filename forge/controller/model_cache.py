"""A replica's model cache, as the controller sees it: which models it holds, loads and drains.

A service's replica owns one ``ReplicaModels`` when its actor multiplexes models (see
``forge.controller.multiplex`` for the contract). It knows each model's queued and running work,
because the replica's batchers hold that work, so it decides every eviction and load and sends
them to the actor one at a time; a model's queue is held back while the model loads.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from forge.controller.batching import Batcher, Batching
from forge.controller.errors import EndpointError, ModelLoadError
from forge.controller.multiplex import Multiplexing

logger = logging.getLogger("forge.multiplex")


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
    """One model's counts on one replica (sums: replicas' stats add up)."""

    requests: int = 0
    loads: int = 0
    batches: int = 0
    items: int = 0
    max_batch_size: int = 0


class ReplicaModels:
    """One replica's models as the controller sees them: resident (loading, loaded, draining)
    and wanted, the work queued and running for each, and the one task that evicts and loads.

    ``load(model_id, evict)`` evicts the models in ``evict`` on the actor, then loads
    ``model_id`` there (a replica sends ``_forge_load_model``; tests pass a coroutine); a
    ``model_id`` of None only evicts (``retire``).
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
                    for batcher in self._batchers:
                        batcher.prune(rec.key)  # that load never comes: its emptied queue goes too
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

    async def retire(self, model_id: Hashable, poll_s: float = 0.01) -> bool:
        """Evict ``model_id`` as soon as it has no queued or running work (the caller bounds the
        wait), not when the LRU reaches it: its caller will not name it again (a stopped run).
        True if this replica held it. A later request for it loads it again, as after any
        eviction."""
        while True:
            rec = self._resident.get(model_id)
            if rec is None:
                return False
            if rec.state is not _State.LOADING and rec.idle:
                break
            await asyncio.sleep(poll_s)  # polled: the load loop owns ``_changed``
        del self._resident[model_id]  # no await since the check: the load loop cannot pick it too
        self.evictions += 1
        self._changed.set()  # a load waiting for room may go
        await self._load(None, [model_id])
        return True

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
        """The replica's model counts and totals (sums; ``models_view`` adds the means)."""
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
            "per_model": {m: dataclasses.asdict(s) for m, s in self.per_model.items()},
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


_SUMMED = ("loads", "evictions", "hits", "misses", "load_failures", "load_s_total")
_SUMMED_PER_MODEL = ("requests", "loads", "batches", "items")


def aggregate_metrics(replica_models: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``svc.metrics()["models"]``: the replicas' model sums added up, with the means."""
    total: dict[str, Any] = {k: sum(m[k] for m in replica_models) for k in _SUMMED}
    per_model: dict[Hashable, dict[str, Any]] = {}
    for m in replica_models:
        for model_id, s in m["per_model"].items():
            t = per_model.setdefault(model_id, dict.fromkeys(_SUMMED_PER_MODEL, 0) | {"max_batch_size": 0})
            for k in _SUMMED_PER_MODEL:
                t[k] += s[k]
            t["max_batch_size"] = max(t["max_batch_size"], s["max_batch_size"])
    return models_view({**total, "per_model": per_model})


def models_view(sums: dict[str, Any]) -> dict[str, Any]:
    """Model metrics as reported: ``sums`` (one replica's or several added up) with the means
    (load time, hit rate, batch size per model) computed from them."""
    view = dict(sums)
    load_s = view.pop("load_s_total")
    view["mean_load_s"] = load_s / view["loads"] if view["loads"] else 0.0
    asked = view["hits"] + view["misses"]
    view["hit_rate"] = view["hits"] / asked if asked else 0.0
    view["per_model"] = {}
    for model_id, s in sums["per_model"].items():
        per = {k: v for k, v in s.items() if k != "items"}
        per["mean_batch_size"] = s["items"] / s["batches"] if s["batches"] else 0.0
        view["per_model"][model_id] = per
    return view
