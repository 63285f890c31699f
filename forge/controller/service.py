"""Services: replicas of one ForgeActor behind routers, and the handle callers use.

``Service`` owns the replicas and decides where each request goes; ``ServiceInterface`` is the
handle a caller holds::

    svc = await Scorer.options(num_replicas=3, router="key_affinity").as_service(scale=2)
    y = await svc.score.route(5, key="prompt-17")    # one item in, one result out
    ys = await svc.score.route_many([1, 2, 3])       # results in order
    rs = await svc.ping.fanout()                     # one result per healthy replica
    p = await svc.predict.route(x, model_id="m7")   # a multiplexed endpoint: name the model
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
import inspect
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any

from monarch.actor import MeshFailure

from forge.controller.batching import Batching
from forge.controller.endpoint import batching_of, is_concurrent, is_multiplexed, retry_allowed
from forge.controller.errors import NoHealthyReplica, Overloaded, ReplicaFailed, ServiceStopped
from forge.controller.multiplex import aggregate_metrics, check_multiplexing
from forge.controller.options import ActorOptions
from forge.controller.provisioner import add_fault_listener, remove_fault_listener, split_gpus, visible_gpus
from forge.controller.replica import Replica, ReplicaSpec, ReplicaState
from forge.controller.routing import Router, RouteRequest, make_router

logger = logging.getLogger("forge.service")

_current_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("forge_session", default=None)
_service_ids = itertools.count()


def endpoint_properties(actor_cls: type) -> dict[str, Any]:
    """Name -> Monarch EndpointProperty for every endpoint of ``actor_cls``."""
    from monarch._src.actor.endpoint import EndpointProperty

    return {
        name: getattr(actor_cls, name)
        for name in dir(actor_cls)
        if isinstance(getattr(actor_cls, name, None), EndpointProperty)
    }


class Service:
    """Replicas of one actor class, their routers, and the request paths through them."""

    def __init__(self, actor_cls: type, options: ActorOptions, args: tuple, kwargs: dict) -> None:
        self.actor_cls = actor_cls
        self.options = options
        self.name = f"{options.name or actor_cls.__name__.lower()}{next(_service_ids)}"
        self.endpoints = endpoint_properties(actor_cls)
        self.batching: dict[str, Batching] = {
            n: b for n, p in self.endpoints.items() if (b := batching_of(p)) is not None
        }
        for spec in self.batching.values():
            spec.resolve_assembly(actor_cls)  # a bad enbatch/debatch name fails here, not per batch
        self.multiplexed = frozenset(n for n, p in self.endpoints.items() if is_multiplexed(p))
        self.multiplexing = check_multiplexing(actor_cls, self.multiplexed, options.max_models)
        # Full batches of an endpoint the actor runs one message at a time go out past the
        # slots (see Batcher's send_full); concurrent ones would run at once, so they wait.
        send_full = frozenset(
            n for n in self.batching if not is_concurrent(self.endpoints[n]) and n not in self.multiplexed
        )
        for name in options.endpoint_routers:
            if name not in self.endpoints:
                raise ValueError(
                    f"options(endpoint_routers=...) names {name!r}, which is not an endpoint of "
                    f"{actor_cls.__name__}; endpoints: {sorted(self.endpoints)}"
                )
        self._default_router_spec = options.router
        self._routers: dict[str, Router] = {}
        gpus = (
            split_gpus(options.num_replicas, options.procs, visible_gpus())
            if options.with_gpus
            else [None] * options.num_replicas
        )
        self.replicas = [
            Replica(
                i,
                ReplicaSpec(
                    actor_cls,
                    args,
                    kwargs,
                    options,
                    self.batching,
                    self.name,
                    gpus[i],
                    multiplexing=self.multiplexing,
                    multiplexed=self.multiplexed,
                    send_full=send_full,
                ),
            )
            for i in range(options.num_replicas)
        ]
        for replica in self.replicas:
            replica.on_failure = self._on_replica_failed
        self._session_pins: dict[str, int] = {}
        self._stopped = False
        self._fault_listener = self._on_mesh_failure
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = contextvars.copy_context()
        self._resync: Callable[[Any], Awaitable[None]] | None = None
        self._recoveries: dict[int, asyncio.Task] = {}
        self._health_task: asyncio.Task | None = None
        self._capacity_changed: asyncio.Condition | None = None
        self._waiting = 0
        self.recovery_log: list[dict[str, float]] = []
        self.retried = 0  # requests resent after their replica died
        self._signatures = {name: _call_signature(prop) for name, prop in self.endpoints.items()}

    # ----------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start every replica concurrently; if any fails to start, stop all and raise."""
        self._loop = asyncio.get_running_loop()
        # Monarch's fault hook runs on Monarch's thread with Monarch's own context variables;
        # failure handling and restarts must run in the context the service was started in.
        self._context = contextvars.copy_context()
        self._capacity_changed = asyncio.Condition()
        add_fault_listener(self._fault_listener)
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            await self.shutdown()
            raise errors[0]
        if self.options.health_interval_s is not None:
            self._health_task = self._context.copy().run(asyncio.get_running_loop().create_task, self._health_loop())
        logger.info("service %s: %d replica(s) of %s ready", self.name, len(self.replicas), self.actor_cls.__name__)

    async def shutdown(self) -> None:
        """Stop every replica; queued requests fail with ``ServiceStopped``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        error = ServiceStopped(f"service {self.name} was shut down")
        background = [*self._recoveries.values(), *([self._health_task] if self._health_task else [])]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await asyncio.gather(*(r.stop(error) for r in self.replicas), return_exceptions=True)
        remove_fault_listener(self._fault_listener)
        await self._notify_capacity()

    def set_resync(self, resync: Callable[[Any], Awaitable[None]] | None) -> None:
        """``await resync(actor_mesh)`` runs on a restarted replica before it takes traffic,
        so that it rejoins at the service's current state (e.g. the current weight version).
        It may call the replica's endpoints: ``await actor_mesh.load.call(state)``."""
        if resync is not None and not callable(resync):
            raise TypeError(f"set_resync needs an async callable taking the replica's actor mesh, got {resync!r}")
        self._resync = resync

    # ----------------------------------------------------------- failures
    def _on_mesh_failure(self, failure: MeshFailure) -> bool:
        """Monarch's fault hook (called on Monarch's own thread): hand over to our loop."""
        mesh_name = str(getattr(failure, "mesh_name", ""))
        for replica in self.replicas:
            if replica.state is not ReplicaState.STOPPED and mesh_name.startswith(replica.mesh_name + "-"):
                if self._loop is not None and not self._loop.is_closed():
                    self._loop.call_soon_threadsafe(
                        replica.mark_failed, f"its process died ({_first_line(failure)})", context=self._context.copy()
                    )
                return True
        return False

    def _on_replica_failed(self, replica: Replica) -> None:
        """A replica's process died: restart it in the background (with backoff)."""
        if self._stopped or replica.replica_id in self._recoveries:
            return
        loop = asyncio.get_running_loop()
        task = self._context.copy().run(loop.create_task, self._recover(replica), name=f"{replica.mesh_name}-recover")
        self._recoveries[replica.replica_id] = task
        task.add_done_callback(lambda _: self._recoveries.pop(replica.replica_id, None))

    async def _recover(self, replica: Replica) -> None:
        failed_at = replica.failed_at or time.monotonic()
        attempt = 0
        while not self._stopped:
            if replica.restarts >= self.options.max_restarts:
                logger.error("replica %s failed %d times; not restarting it again", replica.mesh_name, replica.restarts)
                await self._notify_capacity()
                return
            await asyncio.sleep(min(self.options.restart_backoff_s * 2**attempt, 30.0))
            await replica.stop(ReplicaFailed(f"replica {replica.replica_id} is restarting"))
            replica.generation += 1
            replica.restarts += 1
            try:
                await replica.start(take_traffic=False)
                if self._resync is not None:
                    await self._resync(replica.actor_mesh)
            except Exception as exc:
                attempt += 1
                replica.state = ReplicaState.FAILED
                logger.warning(
                    "restarting replica %s failed (%s); retrying",
                    replica.mesh_name,
                    _first_line(exc),
                    exc_info=logger.isEnabledFor(logging.DEBUG),
                )
                continue
            replica.state = ReplicaState.HEALTHY
            self.recovery_log.append({"replica": replica.replica_id, "recovery_s": time.monotonic() - failed_at})
            logger.info("replica %s is back after %.1fs", replica.mesh_name, time.monotonic() - failed_at)
            await self._notify_capacity()
            return

    async def _health_loop(self) -> None:
        """Fail replicas that neither answer probes nor finish requests for health_timeout_s.

        Monarch reports a dead *process* by itself; this catches the silent cases, such as a
        host whose worker died and took the replica's process out of Monarch's sight.
        """
        interval, limit = self.options.health_interval_s, self.options.health_timeout_s
        while not self._stopped:
            await asyncio.sleep(interval)
            now = time.monotonic()
            due = [r for r in self.replicas if r.state is ReplicaState.HEALTHY and now - r.last_progress >= interval]
            answers = await asyncio.gather(*(r.probe(limit) for r in due))
            for replica, alive in zip(due, answers):
                if (
                    not alive
                    and replica.state is ReplicaState.HEALTHY
                    and time.monotonic() - replica.last_progress >= limit
                ):
                    if self.options.host_pool is not None and replica.host_index is not None:
                        self.options.host_pool.mark_dead(replica.host_index)
                    replica.mark_failed(f"no answer for {limit:.0f}s")

    async def _notify_capacity(self) -> None:
        if self._capacity_changed is not None:
            async with self._capacity_changed:
                self._capacity_changed.notify_all()

    # ----------------------------------------------------------- routing
    def router(self, endpoint: str) -> Router:
        router = self._routers.get(endpoint)
        if router is None:
            spec = self.options.endpoint_routers.get(endpoint, self._default_router_spec)
            if spec is None:
                spec = "model_aware" if endpoint in self.multiplexed else "round_robin"
            router = self._routers[endpoint] = make_router(spec)
        return router

    def healthy_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.accepting]

    def _candidates(self, exclude: set[tuple[int, int]]) -> list[Replica]:
        limit = self.options.max_in_flight_per_replica
        return [
            r
            for r in self.replicas
            if r.accepting and (r.replica_id, r.generation) not in exclude and (limit is None or r.in_flight < limit)
        ]

    def choose(self, endpoint: str, key: Hashable, candidates: list[Replica]) -> Replica:
        """The replica for one request: its session's replica, else the endpoint's router's pick."""
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

    async def _admit(self, endpoint: str, exclude: set[tuple[int, int]]) -> list[Replica]:
        """Replicas that can take one more request now, waiting (bounded) if there are none."""
        if self._stopped:
            raise ServiceStopped(f"service {self.name} was shut down")
        candidates = self._candidates(exclude)
        if candidates:
            return candidates
        if self._waiting >= self.options.max_queued:
            raise Overloaded(
                f"service {self.name}: {self._waiting} callers already wait for admission "
                f"(max_queued={self.options.max_queued})"
            )
        assert self._capacity_changed is not None
        deadline = time.monotonic() + self.options.queue_timeout_s
        self._waiting += 1
        try:
            async with self._capacity_changed:
                while True:
                    if self._stopped:
                        raise ServiceStopped(f"service {self.name} was shut down")
                    candidates = self._candidates(exclude)
                    if candidates:
                        return candidates
                    if not any(
                        r.state in (ReplicaState.STARTING, ReplicaState.RECOVERING, ReplicaState.HEALTHY)
                        or r.replica_id in self._recoveries
                        for r in self.replicas
                    ):
                        states = {r.replica_id: r.state.value for r in self.replicas}
                        raise NoHealthyReplica(
                            f"service {self.name} has no replica that can take {endpoint!r}: {states}"
                        )
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        if self.healthy_replicas():
                            raise Overloaded(
                                f"service {self.name}: every replica holds max_in_flight_per_replica="
                                f"{self.options.max_in_flight_per_replica} requests; "
                                f"waited {self.options.queue_timeout_s}s"
                            )
                        raise NoHealthyReplica(
                            f"service {self.name}: no replica recovered within {self.options.queue_timeout_s}s"
                        )
                    try:
                        await asyncio.wait_for(self._capacity_changed.wait(), remaining)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self._waiting -= 1

    async def request(
        self,
        endpoint: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        key: Hashable,
        timeout: float | None,
        queued: tuple[Replica, int, asyncio.Future] | None = None,
    ) -> Any:
        """Route one request, resending it elsewhere if its replica dies before answering.

        ``queued``: the first attempt of a batched item that ``queue_batched`` already queued
        (its replica, that replica's generation then, the item's future).
        """
        batched = endpoint in self.batching
        if not batched:
            self._check_call(endpoint, args, kwargs)
        if timeout is None and not batched:
            timeout = self.options.call_timeout_s
        # A batched request without its own timeout arms no timer: each batch's message has
        # call_timeout_s, so every queued item is answered or failed in bounded time anyway,
        # and 2,000 queued singletons don't pay for 2,000 timers.
        retries = self.options.max_retries if retry_allowed(self.endpoints[endpoint]) else 0
        tried: set[tuple[int, int]] = set()
        while True:
            if queued is not None:
                replica, generation, future = queued
                queued = None
            else:
                replica = self.choose(endpoint, key, await self._admit(endpoint, tried))
                generation, future = replica.generation, None
            try:
                if batched:
                    if future is None:
                        future = replica.enqueue(endpoint, args[0], key)
                    return await replica.wait_item(endpoint, future, timeout)
                return await replica.call(endpoint, args, kwargs, timeout)
            except ReplicaFailed as exc:
                tried.add((replica.replica_id, generation))
                if retries <= 0 or self._stopped:
                    raise
                retries -= 1
                self.retried += 1
                logger.info("retrying %s.%s on another replica: %s", self.actor_cls.__name__, endpoint, exc)
            finally:
                if self._waiting:
                    await self._notify_capacity()

    def queue_batched(self, endpoint: str, item: Any, key: Hashable, timeout: float | None) -> Coroutine[Any, Any, Any]:
        """Queue one item of a batched endpoint *now*, and return the coroutine that waits for it.

        Why now: a caller that fires a burst (``gather`` of 2,000 ``route`` calls) makes every
        call before asyncio runs any of them. Queued at call time, the items fill batches and the
        first ones are on their way to the actor while the caller is still making calls;
        queued from each caller's task, nothing would leave until all 2,000 tasks had been
        created and the actor would idle meanwhile. When no replica can take the item at once
        (admission limits, recovery, shutdown), the plain path runs when the coroutine is awaited.
        """
        if self._stopped or self._waiting:  # callers already wait for admission: queue behind them
            return self.request(endpoint, (item,), {}, key, timeout)
        candidates = self._candidates(set())
        if not candidates:
            return self.request(endpoint, (item,), {}, key, timeout)
        try:
            replica = self.choose(endpoint, key, candidates)
            queued = (replica, replica.generation, replica.enqueue(endpoint, item, key))
        except Exception as exc:  # noqa: BLE001 - surfaces when the caller awaits, like any other error
            return _raise(exc)
        return self.request(endpoint, (item,), {}, key, timeout, queued=queued)

    def _check_call(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Wrong arity or keyword names fail here, naming the endpoint's signature."""
        signature = self._signatures.get(endpoint)
        if signature is None:
            return
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.actor_cls.__name__}.{endpoint}{signature}: {exc}") from None

    async def fanout(
        self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any], timeout: float | None, key: Hashable = None
    ) -> list[Any]:
        if timeout is None and endpoint not in self.batching:
            timeout = self.options.call_timeout_s
        if endpoint not in self.batching:
            self._check_call(endpoint, args, kwargs)
        replicas = self.healthy_replicas()
        if not replicas:
            raise NoHealthyReplica(f"service {self.name} has no healthy replica for fanout of {endpoint!r}")
        if endpoint in self.batching:
            calls = [r.submit(endpoint, args[0], key, timeout) for r in replicas]
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
        """Per replica and per endpoint: requests, batches, batch sizes, queue wait, in flight, errors;
        with multiplexed endpoints, ``models``: loads, evictions, hits, per-model batch sizes."""
        replicas = {r.replica_id: r.metrics() for r in self.replicas}
        totals: dict[str, dict[str, float]] = {}
        for rm in replicas.values():
            for ep, stats in rm["endpoints"].items():
                t = totals.setdefault(
                    ep,
                    {
                        "requests": 0,
                        "batches": 0,
                        "items": 0.0,
                        "wait": 0.0,
                        "max_batch_size": 0,
                        "in_flight": 0,
                        "errors": 0,
                    },
                )
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
        result = {
            "service": self.name,
            "replicas": replicas,
            "endpoints": endpoints,
            "retried": self.retried,
            "restarts": sum(r.restarts for r in self.replicas),
        }
        if self.multiplexed:
            result["models"] = aggregate_metrics([rm["models"] for rm in replicas.values() if "models" in rm])
        return result


def _call_signature(prop: Any) -> inspect.Signature | None:
    """The endpoint's signature without ``self``, for checking calls before they are sent."""
    method = getattr(prop, "_forge_method", None)
    if method is None and not getattr(prop, "_explicit_response_port", False):
        method = getattr(prop, "_method", None)
    if method is None:
        return None
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())[1:]  # drop self
    return signature.replace(parameters=params)


async def _raise(exc: BaseException) -> Any:
    """An error found when a call was made, raised when the caller awaits it."""
    raise exc


def _first_line(value: Any) -> str:
    try:
        text = str(value.report())
    except Exception:
        text = str(value)
    return text.strip().splitlines()[-1].strip()[:300] if text.strip() else repr(value)


class EndpointHandle:
    """``svc.<endpoint>``: the ways to call one endpoint of a service."""

    def __init__(self, service: Service, name: str) -> None:
        self._service = service
        self._name = name
        self._batched = name in service.batching
        self._multiplexed = name in service.multiplexed

    def route(
        self, *args: Any, key: Hashable = None, timeout: float | None = None, **kwargs: Any
    ) -> Coroutine[Any, Any, Any]:
        """One request to one replica chosen by the endpoint's router; await it for the result.

        For a batched endpoint pass exactly one item; it is prebatched with others and you get
        its own result back. The item is queued the moment ``route`` is called (as a message is
        sent when you send it), so a burst of calls fills batches before any caller runs.
        ``key`` is the similarity key used by ``key_affinity`` routing and by per-key batch
        queues. A multiplexed endpoint takes ``model_id=`` instead: the model that must serve
        the item.
        """
        if self._batched:
            try:
                if self._multiplexed:
                    key = self._model_id(key, kwargs)
                if len(args) != 1 or kwargs:
                    raise TypeError(
                        f"{self._service.actor_cls.__name__}.{self._name} is batched: route() takes exactly one item "
                        f"(got {len(args)} positional and {sorted(kwargs)} keyword arguments)"
                    )
            except TypeError as exc:
                return _raise(exc)
            return self._service.queue_batched(self._name, args[0], key, timeout)
        return self._service.request(self._name, args, kwargs, key, timeout)

    async def route_many(
        self,
        items: Sequence[Any],
        *,
        keys: Sequence[Hashable] | None = None,
        timeout: float | None = None,
        model_id: Hashable = None,
    ) -> list[Any]:
        """Route each item as its own request, concurrently; results in the items' order.
        ``model_id``: the model of every item, for a multiplexed endpoint."""
        if keys is not None and len(keys) != len(items):
            raise ValueError(f"route_many: {len(keys)} keys for {len(items)} items; give one key per item")
        keys = keys if keys is not None else [None] * len(items)
        extra = {"model_id": model_id} if model_id is not None else {}
        return list(
            await asyncio.gather(*(self.route(item, key=k, timeout=timeout, **extra) for item, k in zip(items, keys)))
        )

    async def fanout(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """The same request to every healthy replica; one result per replica."""
        key = self._model_id(None, kwargs) if self._multiplexed else None
        return await self._service.fanout(self._name, args, kwargs, timeout, key)

    def _model_id(self, key: Hashable, kwargs: dict[str, Any]) -> Hashable:
        """Pop ``model_id`` from a multiplexed endpoint's call: it is the request's key."""
        model_id = kwargs.pop("model_id", None)
        if model_id is None or key is not None:
            raise TypeError(
                f"{self._service.actor_cls.__name__}.{self._name} is multiplexed: name the model that serves the "
                f'item with model_id=... (and no key=), e.g. route(x, model_id="m7")'
            )
        return model_id

    def __repr__(self) -> str:
        kind = " (multiplexed)" if self._multiplexed else " (batched)" if self._batched else ""
        return f"<endpoint {self._service.actor_cls.__name__}.{self._name}{kind}>"


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

    def set_resync(self, resync: Callable[[Any], Awaitable[None]] | None) -> None:
        """See ``Service.set_resync``: the step a restarted replica runs before taking traffic."""
        self._service.set_resync(resync)

    @property
    def service(self) -> Service:
        return self._service

    async def shutdown(self) -> None:
        await self._service.shutdown()

    def __repr__(self) -> str:
        s = self._service
        return f"<service {s.name}: {len(s.healthy_replicas())}/{len(s.replicas)} healthy>"
