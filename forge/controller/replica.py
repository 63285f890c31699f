"""One replica of a service: its proc mesh, its actor mesh, its batchers, its state.

The replica owns its lifecycle: it starts, fails (``mark_failed``), restarts as a new
generation that takes traffic only after the service's resync, and stops. The service decides
only *when* to restart it (backoff, limits).

Its request paths turn a service request into Monarch messages (``send``; the call records and
the batch executor are in ``forge.controller.messages``). Plain endpoints get one message per
request; batched endpoints go through one ``Batcher`` each, which sends one message per batch.
Multiplexed endpoints share one ``ReplicaModels``, which loads and evicts the replica's models
and holds a model's queue back while it loads. Every message has a timeout, and Monarch's
errors become forge's: the endpoint's own exception becomes ``EndpointError``, a dead process
``ReplicaFailed``, no answer ``RequestTimeout``. Its metrics are sums (counts and totals), so
that the service can add replicas up before it computes any mean (``forge.controller.metrics``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from monarch.actor import ActorError, ProcMesh

from forge.controller.batching import Batcher
from forge.controller.endpoint import EndpointSpec
from forge.controller.errors import ReplicaFailed, RequestTimeout, ServiceStopped, describe
from forge.controller.messages import BatchSender, Call, PlainCall, QueuedItem, await_with_timeout, translate_error
from forge.controller.metrics import EndpointCounters, endpoint_sums
from forge.controller.model_cache import ReplicaModels
from forge.controller.multiplex import LOAD_ENDPOINT, Multiplexing
from forge.controller.options import ActorOptions
from forge.controller.process_watch import ProcessIdentity, first_gone, watchable
from forge.controller.provisioner import place_replica
from forge.controller.waiters import TIMED_OUT, Waiters

logger = logging.getLogger("forge.replica")
_ABORT = "forge: replica failed"


def _uncancel(task: asyncio.Task) -> None:
    """The cancel was ours, and is answered with an error instead (3.11+: the task forgets it)."""
    if hasattr(task, "uncancel"):
        task.uncancel()


class ReplicaState(str, enum.Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    RECOVERING = "recovering"
    FAILED = "failed"
    STOPPED = "stopped"


_SERVING = frozenset((ReplicaState.HEALTHY, ReplicaState.RECOVERING))
"""States in which a replica's actor mesh takes messages (RECOVERING: its resync's)."""


@dataclass
class ReplicaSpec:
    """What every replica of a service is made from."""

    actor_cls: type
    args: tuple
    kwargs: dict
    options: ActorOptions
    endpoints: dict[str, EndpointSpec]
    service_name: str
    gpus: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    multiplexing: Multiplexing | None = None


class Replica:
    """A replica's lifecycle (start, serve, fail, stop) and its request paths."""

    state_changes = 0
    """Bumped on every state change of any replica: a service keeps its list of healthy replicas
    until this moves, instead of scanning all of them per request (1,000 replicas)."""

    def __init__(
        self,
        replica_id: int,
        spec: ReplicaSpec,
        on_failure: Callable[[Replica], None] | None = None,
        state: ReplicaState = ReplicaState.STARTING,
    ) -> None:
        """``on_failure(replica)`` runs when the replica fails (the service schedules its restart).
        ``state``: where it begins (an attached replica is FAILED until a view shows it live)."""
        self.replica_id = replica_id
        self.spec = spec
        self.actor_name = spec.actor_cls.__name__
        self._one_rank = spec.options.ranks == 1
        self.state = state
        self.generation = 0
        self.proc_mesh: ProcMesh | None = None
        self.actor_mesh: Any = None
        self.batchers: dict[str, Batcher] = {}
        self.models: ReplicaModels | None = None  # the replica's models, if it multiplexes
        self.counters: dict[str, EndpointCounters] = {}
        self.started_at: float | None = None
        self.failure: str | None = None
        self.restarts = 0
        self.failed_at: float | None = None
        self.on_failure = on_failure
        self.host_indices: list[int] = []  # its hosts' indices in the service's HostPool, if any
        self.processes: list[ProcessIdentity] = []
        """Its live generation's processes that the controller's host can see (``gone_process``)."""
        self.last_progress = time.monotonic()  # last answer of any kind from the replica
        self._waiters = Waiters(spec.options.call_timeout_s)  # tasks awaiting this replica's answers
        self.version: int | None = None
        """The version it serves (of weights, say), as the service recorded it; None: not known.
        Version-aware routers read it (``forge.controller.versions``)."""
        self.updating = False
        """Whether its caller is loading a new version into it now (``Service.record_updating``):
        version-aware routers send new work elsewhere meanwhile."""

    # ----------------------------------------------------------- identity
    @property
    def state(self) -> ReplicaState:
        return self._state

    @state.setter
    def state(self, value: ReplicaState) -> None:
        self._state = value
        Replica.state_changes += 1

    @property
    def mesh_name(self) -> str:
        return f"{self.spec.service_name}-r{self.replica_id}-g{self.generation}"

    @property
    def in_flight(self) -> int:
        """Requests it holds now, counted once: per endpoint (``EndpointCounters.in_flight``)."""
        return sum([c.in_flight for c in self.counters.values()])

    @property
    def accepting(self) -> bool:
        return self.state is ReplicaState.HEALTHY

    def owns_mesh(self, mesh_name: str) -> bool:
        """Whether a Monarch mesh of this name belongs to this replica's live generation."""
        return self.state is not ReplicaState.STOPPED and mesh_name.startswith(self.mesh_name + "-")

    def has_forming(self, endpoint: str, key: Hashable) -> bool:
        batcher = self.batchers.get(endpoint)
        return batcher is not None and batcher.has_forming(key)

    def has_model(self, model_id: Hashable) -> bool:
        return self.models is not None and self.models.holds(model_id)

    @property
    def num_models(self) -> int:
        return self.models.count if self.models is not None else 0

    # ----------------------------------------------------------- lifecycle
    async def start(self, take_traffic: bool = True) -> None:
        """Spawn the proc mesh and actor, run ``setup`` on every rank, then take traffic
        (or, with ``take_traffic=False``, stay RECOVERING until the service resyncs it)."""
        self.state = ReplicaState.STARTING
        self.failure = None
        opts = self.spec.options
        t0 = time.monotonic()
        try:
            # A restart prefers hosts other than the ones the replica died on.
            self.proc_mesh, self.host_indices = place_replica(
                self.mesh_name,
                opts,
                self.spec.gpus,
                {**opts.env, **self.spec.env},
                avoid=self.host_indices if self.generation else (),
            )
            self.actor_mesh = self.proc_mesh.spawn(
                self.mesh_name, self.spec.actor_cls, *self.spec.args, **self.spec.kwargs
            )
            await await_with_timeout(self.actor_mesh.setup.call(), opts.setup_timeout_s)
            if opts.health_interval_s is not None:  # the health loop watches its processes
                identities = await await_with_timeout(self.actor_mesh._forge_process.call(), opts.setup_timeout_s)
                self.processes = watchable(list(identities.values()))
        except BaseException as exc:
            self.state = ReplicaState.FAILED
            self.failure = describe(exc)
            await self._stop_mesh()
            raise translate_error(exc, f"{self.spec.actor_cls.__name__} replica {self.replica_id} setup") from exc
        self._make_batchers()
        self.started_at = self.last_progress = time.monotonic()
        self.state = ReplicaState.HEALTHY if take_traffic else ReplicaState.RECOVERING
        logger.debug("replica %s ready in %.2fs", self.mesh_name, self.started_at - t0)

    def _make_batchers(self) -> None:
        """A new generation's batchers, one per batched endpoint; multiplexed ones share the models."""
        cls_name = self.spec.actor_cls.__name__
        batched = [ep for ep in self.spec.endpoints.values() if ep.batching is not None]
        self.models = None
        if any(ep.multiplexed for ep in batched):
            self.models = ReplicaModels(self.spec.multiplexing, self._load_model, name=f"{cls_name}@r{self.replica_id}")
        self.batchers = {}
        for ep in batched:
            label = f"{cls_name}.{ep.name}@r{self.replica_id}"
            if self.models is not None and ep.multiplexed:
                self.batchers[ep.name] = self.models.batcher(ep.batching, self._batch_sender(ep), name=label)
            else:
                self.batchers[ep.name] = Batcher(
                    ep.batching, self._batch_sender(ep), name=label, send_full=ep.send_full
                )

    def _batch_sender(self, endpoint: EndpointSpec) -> BatchSender:
        return BatchSender(self, endpoint, self.spec.actor_cls, self.spec.options.call_timeout_s)

    def mark_failed(self, reason: str) -> None:
        """The process died: stop taking traffic; queued batch items fail with ``ReplicaFailed``."""
        if self.state in (ReplicaState.FAILED, ReplicaState.STOPPED):
            return
        self.state = ReplicaState.FAILED
        self.failure = reason
        self.failed_at = time.monotonic()
        logger.warning("replica %s failed: %s", self.mesh_name, reason)
        error = ReplicaFailed(f"replica {self.replica_id} of {self.spec.service_name} failed: {reason}")
        for batcher in self.batchers.values():
            asyncio.get_running_loop().create_task(batcher.close(error))
        self._waiters.cancel_all(_ABORT)  # answers that will never come: stop waiting for them
        if self.on_failure is not None:
            self.on_failure(self)

    async def restart(self, resync: Callable[[Any], Awaitable[Any]] | None = None) -> None:
        """Replace the processes with a new generation; it takes traffic once ``resync`` is done.

        ``await resync(actor_mesh)`` brings the new generation to the service's current state
        (e.g. the weight version) while the replica is RECOVERING, so no request reaches it
        before that; an int it returns is the version the replica then serves (``version``).
        If the start or the resync fails, the replica is FAILED and the error raised; the caller
        decides whether to try again.
        """
        await self.stop(ReplicaFailed(f"replica {self.replica_id} is restarting"))
        self.processes = []
        self.generation += 1
        self.restarts += 1
        self.version = None
        self.updating = False
        try:
            await self.start(take_traffic=False)
            if resync is not None:
                loaded = await resync(self.actor_mesh)
                if isinstance(loaded, int) and not isinstance(loaded, bool):
                    self.version = loaded  # what the resync brought it to
        except Exception:
            self.state = ReplicaState.FAILED
            raise
        self.state = ReplicaState.HEALTHY

    async def stop(self, error: BaseException | None = None) -> None:
        """Fail anything still queued with ``error`` and stop the processes."""
        previous = self.state
        self.state = ReplicaState.STOPPED
        error = error or ServiceStopped(f"{self.spec.service_name} was shut down")
        await asyncio.gather(*(b.close(error) for b in self.batchers.values()), return_exceptions=True)
        if previous is not ReplicaState.STOPPED:
            # A failed replica's processes may sit on a dead host: don't wait long for them.
            await self._stop_mesh(5.0 if previous is ReplicaState.FAILED else 30.0)

    async def attach(self, actor_mesh: Any, generation: int) -> None:
        """Serve through an actor mesh that another process owns (``forge.controller.attach``):
        fresh batchers, traffic at once; whatever was queued for the previous generation fails
        with ``ReplicaFailed``."""
        stale = ReplicaFailed(f"replica {self.replica_id} of {self.spec.service_name} is now generation {generation}")
        await asyncio.gather(*(b.close(stale) for b in self.batchers.values()), return_exceptions=True)
        self.generation = generation
        self.proc_mesh, self.actor_mesh = None, actor_mesh
        self.processes = []  # the owner's processes: its own service watches them
        self.failure = None
        self._make_batchers()
        self.started_at = self.last_progress = time.monotonic()
        self.state = ReplicaState.HEALTHY

    async def detach(self, error: BaseException) -> None:
        """Stop serving through an attached mesh: fail what is queued with ``error``; the
        processes are the owner's and keep running."""
        self.state = ReplicaState.STOPPED
        self.actor_mesh = None
        await asyncio.gather(*(b.close(error) for b in self.batchers.values()), return_exceptions=True)

    async def _stop_mesh(self, timeout: float = 30.0) -> None:
        mesh, self.proc_mesh, self.actor_mesh = self.proc_mesh, None, None
        if mesh is None:
            return
        try:
            await await_with_timeout(mesh.stop(), timeout)
        except Exception as exc:  # a failed or hung mesh: its processes are reaped at exit
            logger.debug("stopping %s: %r", self.mesh_name, exc)

    # ----------------------------------------------------------- requests
    def send(self, spec: EndpointSpec, args: Sequence[Any], kwargs: dict[str, Any], batch_key: Hashable = None) -> Call:
        """One request to this replica: a batched endpoint's item joins its batch queue
        (``batch_key``) now; a plain endpoint's message leaves when the result is awaited."""
        if spec.batched:
            return self.enqueue(spec.name, args[0], batch_key)
        return PlainCall(self, spec.name, args, kwargs)

    async def call(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any], timeout: float | None) -> Any:
        """One plain-endpoint request: one Monarch message."""
        counters = self.counters.get(endpoint) or self._counters(endpoint)
        counters.requests += 1
        counters.in_flight += 1
        try:
            reply = self._message(endpoint, args, kwargs)
            counters.messages += 1
            return await self.await_reply(endpoint, reply, timeout)
        except BaseException:
            counters.errors += 1
            raise
        finally:
            counters.in_flight -= 1

    def enqueue(self, endpoint: str, item: Any, batch_key: Hashable) -> QueuedItem:
        """One batched-endpoint request: queued here, sent as part of a batch.

        No task per item, so a burst of singletons stays cheap. Never raises: an item the
        batcher refuses (closed, too large, a failing key function) is a ``QueuedItem`` whose
        ``result`` raises that error, as if the batch had failed it.
        """
        try:
            future = self.batchers[endpoint].enqueue(item, batch_key)
        except Exception as exc:  # noqa: BLE001 - the caller sees it when it awaits the result
            future = asyncio.get_running_loop().create_future()
            future.set_exception(exc)
        counters = self._counters(endpoint)
        counters.in_flight += 1

        def done(_: asyncio.Future) -> None:
            counters.in_flight -= 1

        future.add_done_callback(done)
        return QueuedItem(self, endpoint, future)

    async def _load_model(self, model_id: Hashable, evict: list) -> None:
        reply = self.dispatch(LOAD_ENDPOINT, (model_id, evict), {})
        await self.await_reply(LOAD_ENDPOINT, reply, self.spec.options.call_timeout_s)

    def dispatch(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Send one message now (Monarch sends on call); return the future of its reply."""
        reply = self._message(endpoint, args, kwargs)
        self._counters(endpoint).messages += 1
        return reply

    def _message(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if self.actor_mesh is None or self._state not in _SERVING:
            raise ReplicaFailed(f"{self._where(endpoint)}: replica is {self.state.value}")
        ep = getattr(self.actor_mesh, endpoint)
        try:
            return ep.call_one(*args, **kwargs) if self._one_rank else ep.call(*args, **kwargs)
        except BaseException as exc:
            raise self._failed_call(exc, self._where(endpoint)) from exc

    async def await_reply(self, endpoint: str, reply: Any, timeout: float | None) -> Any:
        """Wait for a reply, turning Monarch's failures into forge's (see ``translate_error``).

        The waiting task is registered while it waits (``forge.controller.waiters``): so that
        ``mark_failed`` can stop it at once (``_ABORT``) instead of leaving it to a timeout for
        an answer that will never come, and so that the usual timeout costs no timer of its own.
        """
        task = asyncio.current_task()
        assert task is not None
        try:
            if self._waiters.add(task, timeout):
                result = await await_with_timeout(reply, timeout)
            else:
                result = await reply
            if not self._one_rank:
                result = next(iter(result.values()))  # rank 0's result
            self.last_progress = time.monotonic()
            return result
        except asyncio.CancelledError as exc:
            if exc.args == (TIMED_OUT,):
                _uncancel(task)
                raise RequestTimeout(f"{self._where(endpoint)}: no answer within {timeout}s") from None
            if exc.args == (_ABORT,) and self.state is ReplicaState.FAILED:
                _uncancel(task)
                raise ReplicaFailed(
                    f"{self._where(endpoint)}: the replica failed while this request was in flight: {self.failure}"
                ) from None
            raise
        except BaseException as exc:
            self._waiters.discard(task)  # don't abort ourselves below
            if isinstance(exc, ActorError):  # the replica answered, with an error
                self.last_progress = time.monotonic()
            raise self._failed_call(exc, self._where(endpoint)) from exc
        finally:
            self._waiters.discard(task)

    def gone_process(self) -> ProcessIdentity | None:
        """One of its processes that no longer runs, seen by this host's OS (None: all run, or none
        is visible from here). A dead process is seen here at once, where Monarch's report of it
        may take a supervision poll or more (``forge.controller.process_watch``)."""
        return first_gone(self.processes)

    async def probe(self, timeout: float) -> bool:
        """Whether the replica answers a health probe within ``timeout`` seconds."""
        try:
            await await_with_timeout(self.actor_mesh._forge_health.call(), timeout)
        except Exception:
            return False
        self.last_progress = time.monotonic()
        return True

    def _where(self, endpoint: str) -> str:
        return f"{self.actor_name}.{endpoint}@r{self.replica_id}"

    def _failed_call(self, exc: BaseException, where: str) -> BaseException:
        if isinstance(exc, asyncio.CancelledError):
            return exc
        error = translate_error(exc, where)
        if isinstance(error, ReplicaFailed):
            self.mark_failed(str(error))
        return error

    # ----------------------------------------------------------- metrics
    def _counters(self, endpoint: str) -> EndpointCounters:
        counters = self.counters.get(endpoint)
        if counters is None:
            counters = self.counters[endpoint] = EndpointCounters()
        return counters

    def metrics(self) -> dict[str, Any]:
        """State, and per endpoint its sums: requests, batches, items, queue wait, errors (the
        fields of ``BatchStats``; a plain endpoint's message is a batch of one). Means are left
        to the reader, who may add several replicas up first (``Service.metrics``)."""
        names = set(self.counters) | set(self.batchers)
        result = {
            "state": self.state.value,
            "generation": self.generation,
            "in_flight": self.in_flight,
            "endpoints": {name: endpoint_sums(self._counters(name), self.batchers.get(name)) for name in names},
        }
        if self.models is not None:
            result["models"] = self.models.metrics()
        return result
