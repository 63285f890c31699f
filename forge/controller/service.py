"""Services: replicas of one ForgeActor behind routers, and the handle callers use.

``Service`` owns the replicas and decides where each request goes; ``ServiceInterface`` is the
handle a caller holds::

    svc = await Scorer.options(num_replicas=3, router="key_affinity").as_service(scale=2)
    y = await svc.score.route(5, key="prompt-17")    # one item in, one result out
    ys = await svc.score.route_many([1, 2, 3])       # results in order
    rs = await svc.ping.fanout()                     # one result per healthy replica
    async with svc.session():                        # calls inside stick to one replica
        ...
    svc.metrics(); await svc.shutdown()

A request that a replica never answered because its process died is resent to another
healthy replica (up to ``max_retries`` times, unless the endpoint is declared ``retry=False``);
an endpoint's own exception is never retried: it reaches the caller as ``EndpointError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any

from monarch.actor import MeshFailure

from forge.controller.batching import Batching
from forge.controller.endpoint import batching_of, retry_allowed
from forge.controller.errors import NoHealthyReplica, ReplicaFailed, ServiceStopped
from forge.controller.options import ActorOptions
from forge.controller.provisioner import add_fault_listener, remove_fault_listener, split_gpus, visible_gpus
from forge.controller.replica import Replica, ReplicaSpec, ReplicaState
from forge.controller.routing import RouteRequest, Router, make_router

logger = logging.getLogger("forge.service")

_current_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("forge_session", default=None)
_service_ids = itertools.count()


def endpoint_properties(actor_cls: type) -> dict[str, Any]:
    """Name -> Monarch EndpointProperty for every endpoint of ``actor_cls``."""
    from monarch._src.actor.endpoint import EndpointProperty

    return {name: getattr(actor_cls, name) for name in dir(actor_cls) if isinstance(getattr(actor_cls, name, None), EndpointProperty)}


class Service:
    """Replicas of one actor class, their routers, and the request paths through them."""

    def __init__(self, actor_cls: type, options: ActorOptions, args: tuple, kwargs: dict) -> None:
        self.actor_cls = actor_cls
        self.options = options
        self.name = f"{options.name or actor_cls.__name__.lower()}{next(_service_ids)}"
        self.endpoints = endpoint_properties(actor_cls)
        self.batching: dict[str, Batching] = {n: b for n, p in self.endpoints.items() if (b := batching_of(p)) is not None}
        for spec in self.batching.values():
            spec.resolve_assembly(actor_cls)  # a bad enbatch/debatch name fails here, not per batch
        for name in options.endpoint_routers:
            if name not in self.endpoints:
                raise ValueError(f"options(endpoint_routers=...) names {name!r}, which is not an endpoint of {actor_cls.__name__}; endpoints: {sorted(self.endpoints)}")
        self._default_router_spec = options.router
        self._routers: dict[str, Router] = {}
        gpus = split_gpus(options.num_replicas, options.procs, visible_gpus()) if options.with_gpus else [None] * options.num_replicas
        self.replicas = [
            Replica(i, ReplicaSpec(actor_cls, args, kwargs, options, self.batching, self.name, gpus[i]))
            for i in range(options.num_replicas)
        ]
        self._session_pins: dict[str, int] = {}
        self._stopped = False
        self._fault_listener = self._on_mesh_failure

    # ----------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start every replica concurrently; if any fails to start, stop all and raise."""
        add_fault_listener(self._fault_listener)
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            await self.shutdown()
            raise errors[0]
        logger.info("service %s: %d replica(s) of %s ready", self.name, len(self.replicas), self.actor_cls.__name__)

    async def shutdown(self) -> None:
        """Stop every replica; queued requests fail with ``ServiceStopped``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        error = ServiceStopped(f"service {self.name} was shut down")
        await asyncio.gather(*(r.stop(error) for r in self.replicas), return_exceptions=True)
        remove_fault_listener(self._fault_listener)

    def _on_mesh_failure(self, failure: MeshFailure) -> bool:
        mesh_name = str(getattr(failure, "mesh_name", ""))
        for replica in self.replicas:
            if replica.state is not ReplicaState.STOPPED and mesh_name.startswith(replica.mesh_name):
                replica.mark_failed(f"mesh {mesh_name} failed")
                return True
        return False

    # ----------------------------------------------------------- routing
    def router(self, endpoint: str) -> Router:
        router = self._routers.get(endpoint)
        if router is None:
            spec = self.options.endpoint_routers.get(endpoint, self._default_router_spec)
            router = self._routers[endpoint] = make_router(spec)
        return router

    def healthy_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.accepting]

    def choose(self, endpoint: str, key: Hashable, exclude: set[int] = frozenset()) -> Replica:  # type: ignore[assignment]
        if self._stopped:
            raise ServiceStopped(f"service {self.name} was shut down")
        candidates = [r for r in self.healthy_replicas() if r.replica_id not in exclude]
        if not candidates:
            states = {r.replica_id: r.state.value for r in self.replicas}
            raise NoHealthyReplica(f"service {self.name} has no replica that can take {endpoint!r}: {states}")
        session = _current_session.get()
        if session is not None:
            pinned = self._session_pins.get(session)
            for replica in candidates:
                if replica.replica_id == pinned:
                    return replica
        chosen = self.router(endpoint).choose(RouteRequest(endpoint, key), candidates)
        if session is not None:
            self._session_pins[session] = chosen.replica_id
        return chosen  # type: ignore[return-value]

    async def request(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any], key: Hashable, timeout: float | None) -> Any:
        """Route one request, resending it elsewhere if its replica dies before answering."""
        batched = endpoint in self.batching
        if timeout is None and not batched:
            timeout = self.options.call_timeout_s
        # A batched request without its own timeout arms no timer: each batch's message has
        # call_timeout_s, so every queued item is answered or failed in bounded time anyway,
        # and 2,000 queued singletons don't pay for 2,000 timers.
        retries = self.options.max_retries if retry_allowed(self.endpoints[endpoint]) else 0
        tried: set[int] = set()
        while True:
            replica = self.choose(endpoint, key, tried)
            try:
                if batched:
                    return await replica.submit(endpoint, args[0], key, timeout)
                return await replica.call(endpoint, args, kwargs, timeout)
            except ReplicaFailed as exc:
                tried.add(replica.replica_id)
                if retries <= 0 or self._stopped:
                    raise
                retries -= 1
                logger.info("retrying %s.%s on another replica: %s", self.actor_cls.__name__, endpoint, exc)

    async def fanout(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any], timeout: float | None) -> list[Any]:
        if timeout is None and endpoint not in self.batching:
            timeout = self.options.call_timeout_s
        replicas = self.healthy_replicas()
        if not replicas:
            raise NoHealthyReplica(f"service {self.name} has no healthy replica for fanout of {endpoint!r}")
        if endpoint in self.batching:
            calls = [r.submit(endpoint, args[0], None, timeout) for r in replicas]
        else:
            calls = [r.call(endpoint, args, kwargs, timeout) for r in replicas]
        return list(await asyncio.gather(*calls))

    @contextlib.asynccontextmanager
    async def session(self, session_id: str | None = None) -> AsyncIterator[str]:
        """Calls made inside stick to one replica (re-chosen only if that replica fails)."""
        session_id = session_id or uuid.uuid4().hex
        token = _current_session.set(session_id)
        try:
            yield session_id
        finally:
            _current_session.reset(token)
            self._session_pins.pop(session_id, None)

    # ----------------------------------------------------------- metrics
    def metrics(self) -> dict[str, Any]:
        """Per replica and per endpoint: requests, batches, batch sizes, queue wait, in flight, errors."""
        replicas = {r.replica_id: r.metrics() for r in self.replicas}
        totals: dict[str, dict[str, float]] = {}
        for rm in replicas.values():
            for ep, stats in rm["endpoints"].items():
                t = totals.setdefault(ep, {"requests": 0, "batches": 0, "items": 0.0, "wait": 0.0, "max_batch_size": 0, "in_flight": 0, "errors": 0})
                t["requests"] += stats["requests"]
                t["batches"] += stats["batches"]
                t["items"] += stats["mean_batch_size"] * stats["batches"]
                t["wait"] += stats["mean_queue_wait_s"] * stats["mean_batch_size"] * stats["batches"]
                t["max_batch_size"] = max(t["max_batch_size"], stats["max_batch_size"])
                t["in_flight"] += stats["in_flight"]
                t["errors"] += stats["errors"]
        endpoints = {
            ep: {
                "requests": t["requests"],
                "batches": t["batches"],
                "mean_batch_size": t["items"] / t["batches"] if t["batches"] else 0.0,
                "max_batch_size": t["max_batch_size"],
                "mean_queue_wait_s": t["wait"] / t["items"] if t["items"] else 0.0,
                "in_flight": t["in_flight"],
                "errors": t["errors"],
            }
            for ep, t in totals.items()
        }
        return {"service": self.name, "replicas": replicas, "endpoints": endpoints}


class EndpointHandle:
    """``svc.<endpoint>``: the ways to call one endpoint of a service."""

    def __init__(self, service: Service, name: str) -> None:
        self._service = service
        self._name = name
        self._batched = name in service.batching

    async def route(self, *args: Any, key: Hashable = None, timeout: float | None = None, **kwargs: Any) -> Any:
        """One request to one replica chosen by the endpoint's router.

        For a batched endpoint pass exactly one item; it is prebatched with others and you get
        its own result back. ``key`` is the similarity key used by ``key_affinity`` routing and
        by per-key batch queues.
        """
        if self._batched and (len(args) != 1 or kwargs):
            raise TypeError(
                f"{self._service.actor_cls.__name__}.{self._name} is batched: route() takes exactly one item "
                f"(got {len(args)} positional and {sorted(kwargs)} keyword arguments)"
            )
        return await self._service.request(self._name, args, kwargs, key, timeout)

    async def route_many(self, items: Sequence[Any], *, keys: Sequence[Hashable] | None = None, timeout: float | None = None) -> list[Any]:
        """Route each item as its own request, concurrently; results in the items' order."""
        if keys is not None and len(keys) != len(items):
            raise ValueError(f"route_many: {len(keys)} keys for {len(items)} items; give one key per item")
        keys = keys if keys is not None else [None] * len(items)
        return list(await asyncio.gather(*(self.route(item, key=k, timeout=timeout) for item, k in zip(items, keys))))

    async def fanout(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """The same request to every healthy replica; one result per replica."""
        return await self._service.fanout(self._name, args, kwargs, timeout)

    def __repr__(self) -> str:
        return f"<endpoint {self._service.actor_cls.__name__}.{self._name}{' (batched)' if self._batched else ''}>"


class ServiceInterface:
    """The handle a caller holds: ``svc.<endpoint>.route(...)``, ``session()``, ``metrics()``, ``shutdown()``."""

    def __init__(self, service: Service) -> None:
        self._service = service
        self._handles = {name: EndpointHandle(service, name) for name in service.endpoints}

    def __getattr__(self, name: str) -> EndpointHandle:
        handles = self.__dict__.get("_handles", {})
        if name in handles:
            return handles[name]
        raise AttributeError(
            f"{self._service.actor_cls.__name__} service has no endpoint {name!r}; endpoints: {sorted(handles)}"
        )

    def session(self, session_id: str | None = None) -> contextlib.AbstractAsyncContextManager[str]:
        return self._service.session(session_id)

    def metrics(self) -> dict[str, Any]:
        return self._service.metrics()

    @property
    def service(self) -> Service:
        return self._service

    async def shutdown(self) -> None:
        await self._service.shutdown()

    def __repr__(self) -> str:
        s = self._service
        return f"<service {s.name}: {len(s.healthy_replicas())}/{len(s.replicas)} healthy>"
