"""The service engine: replicas of one ForgeActor behind routers, and the path of each request.

``Service`` owns the replicas and decides where each request goes; callers hold its handle,
``ServiceInterface`` (``forge.controller.handle``)::

    svc = await Scorer.options(num_replicas=3, router="key_affinity").as_service(scale=2)
    y = await svc.score.route(5, key="prompt-17")    # one item in, one result out; key routes
    y = await svc.score.route(5, batch_key="short")  # batch_key: the batch queue on the replica
    ys = await svc.score.route_many([1, 2, 3])       # results in order
    rs = await svc.ping.fanout()                     # one result per healthy replica
    p = await svc.predict.route(x, model_id="m7")   # a multiplexed endpoint: the model routes and batches
    async with svc.session():                        # calls inside stick to one replica
        ...
    svc.metrics(); await svc.shutdown()

A request's path, top to bottom (``submit``, then ``_serve``): the call is checked against the
endpoint and becomes one ``_Request``; it is admitted (bounded wait for a replica with room),
routed (its session's replica, else the endpoint's router) and sent (``Replica.send``). A
request that a replica never answered because its process died (``ReplicaFailed``) is sent
again to another healthy replica, up to ``max_retries`` times, unless the endpoint is declared
``retry=False``; every other error reaches the caller as raised: the endpoint's own exception
as ``EndpointError``, never retried.
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
from dataclasses import dataclass, field
from typing import Any

from forge.controller.endpoint import EndpointSpec, endpoint_specs, with_concurrent_batches
from forge.controller.errors import NoHealthyReplica, Overloaded, ReplicaFailed, ServiceStopped
from forge.controller.lifecycle import OwnedReplicas, ReplicaSource
from forge.controller.messages import Call
from forge.controller.metrics import service_metrics
from forge.controller.multiplex import check_multiplexing
from forge.controller.options import ActorOptions
from forge.controller.provisioner import replica_gpus
from forge.controller.replica import Replica, ReplicaSpec
from forge.controller.routing import Pins, Router, RouteRequest, RouteTrace, make_router

logger = logging.getLogger("forge.service")

_current_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("forge_session", default=None)
_service_ids = itertools.count()


@dataclass(eq=False, slots=True)
class _Request:
    """One caller's request, from ``route`` to its answer, resends included."""

    spec: EndpointSpec
    args: Sequence[Any]
    kwargs: dict[str, Any]
    route: RouteRequest
    """Its keys: ``key`` routes, ``batch_key`` picks the batch queue."""
    timeout: float | None
    """The caller's own limit on each try; None: no timer of its own."""
    retries: int
    """Times it may still be sent again after its replica died."""
    tried: set[tuple[int, int]] = field(default_factory=set)
    """The replica incarnations that died holding it: a resend avoids them."""
    sent: Call | None = None
    """The try in flight on a replica, until ``_serve`` awaits it."""
    trace: RouteTrace | None = None
    """The caller's record of where each try went."""


async def _raise(error: BaseException) -> Any:
    raise error


class Service:
    """Replicas of one actor class, their routers, and the request paths through them."""

    def __init__(
        self,
        actor_cls: type,
        options: ActorOptions,
        args: tuple,
        kwargs: dict,
        *,
        source: ReplicaSource | None = None,
        name: str | None = None,
    ) -> None:
        """``source``: who starts, restarts and stops the replicas (``forge.controller.lifecycle``;
        default: this process, ``OwnedReplicas``). ``name``: the service's, when it has one already
        (an attached service takes its owner's)."""
        self.actor_cls = actor_cls
        self.options = options
        self.source: ReplicaSource = source if source is not None else OwnedReplicas()
        self.name = name or f"{options.name or actor_cls.__name__.lower()}{next(_service_ids)}"
        self.endpoints: dict[str, EndpointSpec] = with_concurrent_batches(
            endpoint_specs(actor_cls), options.concurrent_batches, actor_cls.__name__
        )
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
        state = self.source.initial_state
        self.replicas = [
            Replica(i, dataclasses.replace(spec, gpus=gpus[i]), on_failure=self.source.replica_failed, state=state)
            for i in range(options.num_replicas)
        ]
        self._healthy: list[Replica] = []
        self._healthy_as_of = -1  # the Replica.state_changes that _healthy was computed at
        self._sessions = Pins()  # svc.session(): each open session's replica
        self._stopped = False
        self.resync: Callable[[Any], Awaitable[Any]] | None = None
        """Runs on a restarted replica before it takes traffic (``set_resync``)."""
        self._capacity_changed: asyncio.Condition | None = None
        self._waiting = 0
        self.retried = 0  # requests resent after their replica died
        self._replica_listeners: list[Callable[[], None]] = []

    # ----------------------------------------------------------- lifecycle
    @property
    def stopped(self) -> bool:
        return self._stopped

    async def start(self) -> None:
        """Bring the replicas up through the source; if that fails, stop everything and raise."""
        self._capacity_changed = asyncio.Condition()
        try:
            await self.source.start(self)
        except BaseException:
            await self.shutdown()
            raise

    async def shutdown(self) -> None:
        """Stop every replica; queued requests fail with ``ServiceStopped``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.source.stop(ServiceStopped(f"service {self.name} was shut down"))
        await self.notify_capacity()

    def set_resync(self, resync: Callable[[Any], Awaitable[Any]] | None) -> None:
        """``await resync(actor_mesh)`` runs on a restarted replica before it takes traffic,
        so that it rejoins at the service's current state (e.g. the current weight version).
        It may call the replica's endpoints: ``await actor_mesh.load.call(state)``; an int it
        returns is the version the replica serves then (``record_version``)."""
        if resync is not None and not callable(resync):
            raise TypeError(f"set_resync needs an async callable taking the replica's actor mesh, got {resync!r}")
        self.resync = resync

    def record_version(self, replica: Replica, version: int) -> None:
        """``replica`` serves ``version`` now (its caller loaded it there): version-aware routers
        (``forge.controller.versions.NewestVersion``) prefer the replicas on the newest one."""
        self._check_own(replica)
        replica.version = version
        replica.updating = False

    def record_updating(self, replica: Replica, updating: bool = True) -> None:
        """``replica`` is loading a new version now (or no longer is, ``updating=False``):
        version-aware routers send new work to the others meanwhile."""
        self._check_own(replica)
        replica.updating = updating

    def _check_own(self, replica: Replica) -> None:
        if replica not in self.replicas:
            raise ValueError(f"replica {replica.replica_id} is not one of service {self.name}'s")

    def add_replica_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs on the service's loop whenever a replica fails and whenever one is
        back after a restart: how processes attached to the service (``forge.controller.attach``)
        learn of new generations. It must not block; an exception it raises is logged."""
        if not callable(listener):
            raise TypeError(f"add_replica_listener needs a callable taking no arguments, got {listener!r}")
        self._replica_listeners.append(listener)

    def replicas_changed(self) -> None:
        """A replica failed, or is back: tell the listeners (``add_replica_listener``)."""
        for listener in list(self._replica_listeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener's bug must not stop a restart
                logger.exception("service %s: a replica listener failed", self.name)

    async def notify_capacity(self) -> None:
        """A replica has room again, or came back, or will not: callers waiting for admission look again."""
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
        """The replicas taking traffic, computed again only after a replica changed state (the
        list is shared: callers must not change it)."""
        if self._healthy_as_of != Replica.state_changes:
            self._healthy = [r for r in self.replicas if r.accepting]
            self._healthy_as_of = Replica.state_changes
        return self._healthy

    def _candidates(self, exclude: set[tuple[int, int]]) -> list[Replica]:
        healthy = self._healthy if self._healthy_as_of == Replica.state_changes else self.healthy_replicas()
        limit = self.options.max_in_flight_per_replica
        if not exclude and limit is None:
            return healthy
        return [
            r for r in healthy if (r.replica_id, r.generation) not in exclude and (limit is None or r.in_flight < limit)
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

    # ----------------------------------------------------------- requests
    def submit(
        self,
        endpoint: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        key: Hashable,
        batch_key: Hashable,
        timeout: float | None,
        *,
        retry: bool = True,
        trace: RouteTrace | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """Start one request and return the coroutine that waits for its answer.

        ``retry=False``: a request whose replica dies fails with ``ReplicaFailed`` instead of
        being sent again (a caller that has already passed on part of its answer, a stream).
        ``trace``: written with the replica of each try as it is sent.

        A batched item is queued *now* when a replica can take it at once. Why now: a caller
        that fires a burst (``gather`` of 2,000 ``route`` calls) makes every call before asyncio
        runs any of them. Queued at call time, the items fill batches and the first ones are on
        their way to the actor while the caller is still making calls; queued from each
        caller's task, nothing would leave until all 2,000 tasks had been created. Otherwise
        (a plain endpoint, admission limits, recovery, shutdown) the request is admitted and
        sent when the coroutine runs. A call that does not fit the endpoint, or a router that
        fails, raises where the caller awaits, as every other error does.
        """
        try:
            request = self._request(self.endpoints[endpoint], args, kwargs, key, batch_key, timeout)
            request.trace = trace
            if not retry:
                request.retries = 0
            # Callers already waiting for admission go first: then this one queues behind them.
            if request.spec.batched and not self._stopped and not self._waiting:
                candidates = self._candidates(request.tried)
                if candidates:
                    request.sent = self._send(request, candidates)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who meets it on await
            return _raise(exc)
        return self._serve(request)

    async def _serve(self, request: _Request) -> Any:
        """The request's answer: admitted, routed and sent unless already queued, then awaited;
        sent again to another replica when the one that held it died (``ReplicaFailed``)."""
        while True:
            call, request.sent = request.sent, None
            if call is None:
                # The common case without a coroutine of its own: a replica has room, no one waits.
                candidates = None if self._stopped or self._waiting else self._candidates(request.tried)
                call = self._send(request, candidates or await self._admit(request))
            try:
                return await call.result(request.timeout)
            except ReplicaFailed as exc:
                request.tried.add(call.origin)
                if request.retries <= 0 or self._stopped:
                    raise
                request.retries -= 1
                self.retried += 1
                logger.info("retrying %s.%s on another replica: %s", self.actor_cls.__name__, request.spec.name, exc)
            finally:
                if self._waiting:  # a replica has room again: let a caller waiting for admission in
                    await self.notify_capacity()

    def _send(self, request: _Request, candidates: list[Replica]) -> Call:
        """Route the request among ``candidates`` and send it (a batched item joins its queue)."""
        replica = self.choose(request.route, candidates)
        call = replica.send(request.spec, request.args, request.kwargs, request.route.batch_key)
        if request.trace is not None:
            request.trace.replica_id = replica.replica_id
            request.trace.tries += 1
        return call

    async def _admit(self, request: _Request) -> list[Replica]:
        """Replicas that can take the request now, waiting (bounded) if there are none."""
        endpoint, exclude = request.spec.name, request.tried
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
                    if not self.source.may_recover():
                        states = {r.replica_id: r.state.value for r in self.replicas}
                        raise NoHealthyReplica(
                            f"service {self.name} has no replica that can take {endpoint!r}: {states}"
                        )
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._admission_timeout()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._capacity_changed.wait(), remaining)
        finally:
            self._waiting -= 1

    def _admission_timeout(self) -> Exception:
        """The error of a caller that waited ``queue_timeout_s`` for admission in vain."""
        if self.healthy_replicas():
            return Overloaded(
                f"service {self.name}: every replica holds max_in_flight_per_replica="
                f"{self.options.max_in_flight_per_replica} requests; waited {self.options.queue_timeout_s}s"
            )
        return NoHealthyReplica(f"service {self.name}: no replica recovered within {self.options.queue_timeout_s}s")

    def _request(
        self,
        spec: EndpointSpec,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        key: Hashable,
        batch_key: Hashable,
        timeout: float | None,
    ) -> _Request:
        """The call as one ``_Request``; a call that does not fit the endpoint fails here, naming it."""
        if spec.multiplexed:  # the model that must serve the item routes it and is its batch queue
            kwargs = dict(kwargs)
            model_id = kwargs.pop("model_id", None)
            if model_id is None or key is not None or batch_key is not None:
                raise TypeError(
                    f"{self._qualified(spec)} is multiplexed: name the model that serves the item with "
                    f"model_id=... (it routes the item and picks its batch queue; no key= or batch_key=), "
                    f'e.g. route(x, model_id="m7")'
                )
            key = batch_key = model_id
        elif batch_key is not None and not spec.batched:
            raise TypeError(
                f"{self._qualified(spec)} is not batched: batch_key= picks a batch queue, which only batched "
                f"endpoints have (got batch_key={batch_key!r})"
            )
        if spec.batched:
            if len(args) != 1 or kwargs:
                raise TypeError(
                    f"{self._qualified(spec)} is batched: route() takes exactly one item "
                    f"(got {len(args)} positional and {sorted(kwargs)} keyword arguments)"
                )
        else:
            spec.check_call(self.actor_cls.__name__, args, kwargs)
        # A batched request without its own timeout arms no timer: each batch's message has
        # call_timeout_s, so every queued item is answered or failed in bounded time anyway,
        # and 2,000 queued singletons don't pay for 2,000 timers.
        if timeout is None and not spec.batched:
            timeout = self.options.call_timeout_s
        retries = self.options.max_retries if spec.retry else 0
        return _Request(spec, args, kwargs, RouteRequest(spec.name, key, batch_key), timeout, retries)

    def _qualified(self, spec: EndpointSpec) -> str:
        return f"{self.actor_cls.__name__}.{spec.name}"

    async def fanout(
        self,
        endpoint: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        timeout: float | None,
        *,
        by_replica: bool = False,
    ) -> list[Any] | dict[int, Any]:
        """The same request to every healthy replica; one result per replica, in replica order
        (``by_replica``: a dict by replica id instead)."""
        request = self._request(self.endpoints[endpoint], args, kwargs, None, None, timeout)
        replicas = self.healthy_replicas()
        if not replicas:
            raise NoHealthyReplica(f"service {self.name} has no healthy replica for fanout of {endpoint!r}")
        calls = [r.send(request.spec, request.args, request.kwargs, request.route.batch_key) for r in replicas]
        results = list(await asyncio.gather(*(c.result(request.timeout) for c in calls)))
        return {r.replica_id: x for r, x in zip(replicas, results)} if by_replica else results

    async def retire_model(self, model_id: Hashable, timeout_s: float) -> int:
        """Evict ``model_id`` from every replica that holds it, once its work there is done
        (``ReplicaModels.retire``); returns how many held it. ``TimeoutError`` past ``timeout_s``."""
        if self.multiplexing is None:
            raise TypeError(f"service {self.name} has no multiplexed endpoint, so it holds no models to retire")
        held = [r.models.retire(model_id) for r in self.replicas if r.models is not None]
        return sum(await asyncio.wait_for(asyncio.gather(*held), timeout_s))

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
        multiplexed = any(e.multiplexed for e in self.endpoints.values())
        return service_metrics(self.name, self.replicas, self.retried, multiplexed)
