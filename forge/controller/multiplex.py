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
- ``svc.retire_model(model_id)`` evicts a model from every replica once its queued and
  running work there is done (a caller that will never name it again, e.g. a stopped run), so
  its room is free at once instead of when the LRU reaches it.
- ``svc.metrics()["models"]``: loads, evictions, hits (requests that found their model loaded),
  misses (requests that waited for a load), load failures and time, and per model its
  requests, loads and batch sizes.

This module is the declaration (``model_loader``, ``Multiplexing``, the multiplexed endpoint
body) and the actor side (``model_store``: the models one actor process holds). The
controller-side replica decides every load and eviction (it owns the queues, so it knows each
model's queued and running work): that is ``forge.controller.model_cache``. The actor only obeys
``_forge_load_model`` messages. ``ModelAware`` is in ``forge.controller.routing``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import inspect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from forge.checks import check_int

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
        check_int("model_loader(max_models=...)", self.max_models, 1)
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
        """The replica's order: it counts the room (its capacity may differ from ours). A
        ``model_id`` of None only evicts (``ReplicaModels.retire``)."""
        for victim in evict:
            await self.evict(victim)
        if model_id is not None:
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
