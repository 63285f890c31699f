"""Services: replicas of one ForgeActor behind routers, and the handle callers use.

``Service`` owns the replicas and decides where each request goes; ``ServiceInterface`` is the
handle a caller holds::

    svc = await Scorer.options(num_replicas=3, router="key_affinity").as_service(scale=2)
    y = await svc.score.route(5, key="prompt-17")    # one item in, one result out; key routes
    y = await svc.score.route(5, batch_key="short")  # batch_key: the batch queue on the replica
    ys = await svc.score.route_many([1, 2, 3])       # results in order
    rs = await svc.ping.fanout()                     # one result per healthy replica
    p = await svc.predict.route(x, model_id="m7")   # a multiplexed endpoint: the model routes and batches
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
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any

from monarch.actor import MeshFailure

from forge.controller.endpoint import EndpointSpec, endpoint_specs
from forge.controller.errors import NoHealthyReplica, Overloaded, ReplicaFailed, ServiceStopped, describe
from forge.controller.model_cache import aggregate_metrics, models_view
from forge.controller.multiplex import check_multiplexing
from forge.controller.options import ActorOptions
from forge.controller.provisioner import add_fault_listener, remove_fault_listener, replica_gpus
from forge.controller.replica import QueuedItem, Replica, ReplicaSpec, ReplicaState, aggregate_endpoints, endpoint_view
from forge.controller.routing import Pins, Router, RouteRequest, make_router

logger = logging.getLogger("forge.service")

_current_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("forge_session", default=None)
_service_ids = itertools.count()


class Service:
    """Replicas of one actor class, their routers, and the request paths through them."""

    def __init__(self, actor_cls: type, options: ActorOptions, args: tuple, kwargs: dict) -> None:
        self.actor_cls = actor_cls
        self.options = options
        self.name = f"{options.name or actor_cls.__name__.lower()}{next(_service_ids)}"
        self.endpoints: dict[str, EndpointSpec] = endpoint_specs(actor_cls)
        multiplexed = sorted(n for n, e in self.endpoints.items() if e.multiplexed)
        self.multiplexing = check_multiplexing(actor_cls, multiplexed, options.max_models)
        for name in options.endpoint_routers:
            if name not in self.endpoints:
                raise ValueError(
                    f"options(endpoint_routers=...) names {name!r}, which is not an endpoint of "
                    f"{actor_cls.__name__}; endpoints: {sorted(self.endpoints)}"
                )
        self._default_router_spec = options.router
        self._routers: dict[str, Router] = {}
        gpus = replica_gpus(options, options.num_replicas)
        spec = ReplicaSpec(actor_cls, args, kwargs, options, self.endpoints, self.name, multiplexing=self.multiplexing)
        self.replicas = [
            Replica(i, dataclasses.replace(spec, gpus=gpus[i]), on_failure=self._on_replica_failed)
            for i in range(options.num_replicas)
        ]
        self._sessions = Pins()  # svc.session(): a session's replica
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
            if replica.owns_mesh(mesh_name):
                if self._loop is not None and not self._loop.is_closed():
                    reason = f"its process died ({describe(failure, limit=300)})"
                    self._loop.call_soon_threadsafe(replica.mark_failed, reason, context=self._context.copy())
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
        """The restart policy: back off (doubling per failed try, at most 30 s), give up after
        ``max_restarts``; the replica itself restarts, resyncs and rejoins."""
        failed_at = replica.failed_at or time.monotonic()
        attempt = 0
        while not self._stopped:
            if replica.restarts >= self.options.max_restarts:
                if self.options.max_restarts == 0:
                    logger.error("replica %s failed; max_restarts=0 allows no restart", replica.mesh_name)
                else:
                    logger.error(
                        "replica %s failed again after %d restarts (max_restarts=%d); not restarting it again",
                        replica.mesh_name,
                        replica.restarts,
                        self.options.max_restarts,
                    )
                await self._notify_capacity()
                return
            await asyncio.sleep(min(self.options.restart_backoff_s * 2**attempt, 30.0))
            try:
                await replica.restart(self._resync)
            except Exception as exc:
                attempt += 1
                logger.warning(
                    "restarting replica %s failed (%s); retrying",
                    replica.mesh_name,
                    describe(exc),
                    exc_info=logger.isEnabledFor(logging.DEBUG),
                )
                continue
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
                    reason = f"no answer for {limit:.0f}s"
                    if self.options.host_pool is not None and replica.host_indices:
                        blamed = self.options.host_pool.blame(replica.host_indices)
                        reason += f" ({blamed})" if blamed else ""
                    replica.mark_failed(reason)

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
                spec = "model_aware" if self.endpoints[endpoint].multiplexed else "round_robin"
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

    def choose(self, request: RouteRequest, candidates: list[Replica]) -> Replica:
        """The replica for one request: its session's replica, else the endpoint's router's pick."""
        session = _current_session.get()
        if session is None:
            return self.router(request.endpoint).choose(request, candidates)  # type: ignore[return-value]
        chosen = self._sessions.get(session, candidates)
        if chosen is None:
            chosen = self.router(request.endpoint).choose(request, candidates)
            self._sessions.pin(session, chosen)
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
        batch_key: Hashable,
        timeout: float | None,
        queued: QueuedItem | None = None,
    ) -> Any:
        """Route one request, resending it elsewhere if its replica dies before answering.

        ``queued``: the first attempt of a batched item, already queued by ``queue_batched``
        (which checked the call).
        """
        spec = self.endpoints[endpoint]
        if queued is None:
            args, kwargs, key, batch_key = self._checked_call(spec, args, kwargs, key, batch_key)
        if timeout is None and not spec.batched:
            timeout = self.options.call_timeout_s
        # A batched request without its own timeout arms no timer: each batch's message has
        # call_timeout_s, so every queued item is answered or failed in bounded time anyway,
        # and 2,000 queued singletons don't pay for 2,000 timers.
        retries = self.options.max_retries if spec.retry else 0
        tried: set[tuple[int, int]] = set()
        while True:
            attempt, queued = queued, None
            if attempt is None:
                replica = self.choose(RouteRequest(endpoint, key, batch_key), await self._admit(endpoint, tried))
                origin = (replica.replica_id, replica.generation)
                if spec.batched:  # never raises: an item the batcher refuses fails in its result
                    attempt = replica.enqueue(endpoint, args[0], batch_key)
            else:
                origin = attempt.origin
            try:
                if attempt is not None:
                    return await attempt.result(timeout)
                return await replica.call(endpoint, args, kwargs, timeout)
            except ReplicaFailed as exc:
                tried.add(origin)
                if retries <= 0 or self._stopped:
                    raise
                retries -= 1
                self.retried += 1
                logger.info("retrying %s.%s on another replica: %s", self.actor_cls.__name__, endpoint, exc)
            finally:
                if self._waiting:
                    await self._notify_capacity()

    def queue_batched(
        self,
        endpoint: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        key: Hashable,
        batch_key: Hashable,
        timeout: float | None,
    ) -> Coroutine[Any, Any, Any]:
        """Queue one item of a batched endpoint *now*, and return the coroutine that waits for it.

        Why now: a caller that fires a burst (``gather`` of 2,000 ``route`` calls) makes every
        call before asyncio runs any of them. Queued at call time, the items fill batches and the
        first ones are on their way to the actor while the caller is still making calls;
        queued from each caller's task, nothing would leave until all 2,000 tasks had been
        created and the actor would idle meanwhile. When no replica can take the item at once
        (admission limits, recovery, shutdown), or the call does not fit the endpoint, the plain
        path runs when the coroutine is awaited (and raises there, as any other error does).
        """
        # Callers already waiting for admission go first: then this one queues behind them.
        candidates = [] if self._stopped or self._waiting else self._candidates(set())
        if candidates:
            try:
                (item,), _, rkey, bkey = self._checked_call(self.endpoints[endpoint], args, kwargs, key, batch_key)
                replica = self.choose(RouteRequest(endpoint, rkey, bkey), candidates)
            except Exception:  # noqa: BLE001 - the plain path meets the same error when it is awaited
                pass
            else:
                queued = replica.enqueue(endpoint, item, bkey)
                return self.request(endpoint, (item,), {}, rkey, bkey, timeout, queued=queued)
        return self.request(endpoint, args, kwargs, key, batch_key, timeout)

    def _checked_call(
        self, spec: EndpointSpec, args: Sequence[Any], kwargs: dict[str, Any], key: Hashable, batch_key: Hashable
    ) -> tuple[Sequence[Any], dict[str, Any], Hashable, Hashable]:
        """The call as a replica takes it; a call that does not fit the endpoint fails here,
        naming the endpoint. A multiplexed endpoint's ``model_id=`` becomes both the request's
        key and its batch queue."""
        name = f"{self.actor_cls.__name__}.{spec.name}"
        if spec.multiplexed:
            kwargs = dict(kwargs)
            model_id = kwargs.pop("model_id", None)
            if model_id is None or key is not None or batch_key is not None:
                raise TypeError(
                    f"{name} is multiplexed: name the model that serves the item with model_id=... (it routes the "
                    f'item and picks its batch queue; no key= or batch_key=), e.g. route(x, model_id="m7")'
                )
            key = batch_key = model_id
        elif batch_key is not None and not spec.batched:
            raise TypeError(
                f"{name} is not batched: batch_key= picks a batch queue, which only batched endpoints have "
                f"(got batch_key={batch_key!r})"
            )
        if spec.batched:
            if len(args) != 1 or kwargs:
                raise TypeError(
                    f"{name} is batched: route() takes exactly one item "
                    f"(got {len(args)} positional and {sorted(kwargs)} keyword arguments)"
                )
        elif spec.signature is not None:
            try:
                spec.signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{name}{spec.signature}: {exc}") from None
        return args, kwargs, key, batch_key

    async def fanout(
        self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any], timeout: float | None
    ) -> list[Any]:
        """The same request to every healthy replica; one result per replica, in replica order."""
        spec = self.endpoints[endpoint]
        if timeout is None and not spec.batched:
            timeout = self.options.call_timeout_s
        args, kwargs, _, batch_key = self._checked_call(spec, args, kwargs, None, None)
        replicas = self.healthy_replicas()
        if not replicas:
            raise NoHealthyReplica(f"service {self.name} has no healthy replica for fanout of {endpoint!r}")
        if spec.batched:
            calls = [r.submit(endpoint, args[0], batch_key, timeout) for r in replicas]
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
            self._sessions.forget(session_id)

    # ----------------------------------------------------------- metrics
    def metrics(self) -> dict[str, Any]:
        """Per replica and per endpoint: requests, batches, batch sizes, queue wait, in flight, errors;
        with multiplexed endpoints, ``models``: loads, evictions, hits, per-model batch sizes.

        Replicas report sums; they are added up here, and every mean is computed from sums."""
        sums = {r.replica_id: r.metrics() for r in self.replicas}
        replicas = {}
        for replica_id, rm in sums.items():
            replicas[replica_id] = {**rm, "endpoints": {ep: endpoint_view(st) for ep, st in rm["endpoints"].items()}}
            if "models" in rm:
                replicas[replica_id]["models"] = models_view(rm["models"])
        result = {
            "service": self.name,
            "replicas": replicas,
            "endpoints": aggregate_endpoints([rm["endpoints"] for rm in sums.values()]),
            "retried": self.retried,
            "restarts": sum(r.restarts for r in self.replicas),
        }
        if any(e.multiplexed for e in self.endpoints.values()):
            result["models"] = aggregate_metrics([rm["models"] for rm in sums.values() if "models" in rm])
        return result


class EndpointHandle:
    """``svc.<endpoint>``: the ways to call one endpoint of a service."""

    def __init__(self, service: Service, name: str) -> None:
        self._service = service
        self._name = name
        self._spec = service.endpoints[name]

    def route(
        self,
        *args: Any,
        key: Hashable = None,
        batch_key: Hashable = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Coroutine[Any, Any, Any]:
        """One request to one replica chosen by the endpoint's router; await it for the result.

        For a batched endpoint pass exactly one item; it is prebatched with others and you get
        its own result back. The item is queued the moment ``route`` is called (as a message is
        sent when you send it), so a burst of calls fills batches before any caller runs.

        ``key`` routes: the similarity key of ``key_affinity``, the session of ``sticky``.
        ``batch_key`` (batched endpoints) picks the batch queue on the replica: only items of
        equal batch keys share a batch. Without it the endpoint's ``Batching(key=fn)`` decides,
        and without that every item shares one queue. A multiplexed endpoint takes
        ``model_id=`` instead of both: the model that must serve the item routes it and is its
        batch queue.
        """
        if self._spec.batched:
            return self._service.queue_batched(self._name, args, kwargs, key, batch_key, timeout)
        return self._service.request(self._name, args, kwargs, key, batch_key, timeout)

    async def route_many(
        self,
        items: Sequence[Any],
        *,
        keys: Sequence[Hashable] | None = None,
        batch_keys: Sequence[Hashable] | None = None,
        timeout: float | None = None,
        model_id: Hashable = None,
    ) -> list[Any]:
        """Route each item as its own request, concurrently; results in the items' order.
        ``keys``/``batch_keys``: one per item, as ``route``'s ``key``/``batch_key``.
        ``model_id``: the model of every item, for a multiplexed endpoint."""
        for name, given in (("keys", keys), ("batch_keys", batch_keys)):
            if given is not None and len(given) != len(items):
                raise ValueError(f"route_many: {len(given)} {name} for {len(items)} items; give one per item")
        keys = keys if keys is not None else [None] * len(items)
        batch_keys = batch_keys if batch_keys is not None else [None] * len(items)
        extra = {"model_id": model_id} if model_id is not None else {}
        calls = (
            self.route(item, key=k, batch_key=b, timeout=timeout, **extra)
            for item, k, b in zip(items, keys, batch_keys)
        )
        return list(await asyncio.gather(*calls))

    async def fanout(self, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """The same request to every healthy replica; one result per replica."""
        return await self._service.fanout(self._name, args, kwargs, timeout)

    def __repr__(self) -> str:
        kind = " (multiplexed)" if self._spec.multiplexed else " (batched)" if self._spec.batched else ""
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
