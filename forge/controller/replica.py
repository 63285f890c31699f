"""One replica of a service: its proc mesh, its actor mesh, its batchers, its state.

A replica turns a service request into Monarch messages. Plain endpoints get one message per
request; batched endpoints go through one ``Batcher`` each, which sends one message per batch.
Multiplexed endpoints share one ``ReplicaModels``, which loads and evicts the replica's models
and holds a model's queue back while it loads. Every message has a timeout, and Monarch's
errors become forge's: the endpoint's own exception becomes ``EndpointError``, a dead process
``ReplicaFailed``, no answer ``RequestTimeout``.

The replica owns its lifecycle: it starts, fails (``mark_failed``), restarts as a new
generation that takes traffic only after the service's resync, and stops. The service decides
only *when* to restart it (backoff, limits). Its metrics are sums (counts and totals), so that
the service can add replicas up before it computes any mean.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
from monarch.actor import ActorError, ProcMesh

from forge.controller.batching import Batcher, BatchStats
from forge.controller.endpoint import EndpointSpec
from forge.controller.errors import (
    EndpointError,
    ReplicaFailed,
    RequestTimeout,
    ServiceStopped,
    UnsendableArgument,
    describe,
)
from forge.controller.model_cache import ReplicaModels
from forge.controller.multiplex import LOAD_ENDPOINT, Multiplexing
from forge.controller.options import ActorOptions
from forge.controller.provisioner import place_replica

try:  # the type Monarch raises when a process of the mesh died
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
except ImportError:  # pragma: no cover - layout of a future Monarch
    SupervisionError = RuntimeError  # type: ignore[misc,assignment]

logger = logging.getLogger("forge.replica")
_ABORT = "forge: replica failed"


class ReplicaState(str, enum.Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    RECOVERING = "recovering"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class _EndpointCounters:
    requests: int = 0
    errors: int = 0
    in_flight: int = 0
    messages: int = 0


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


async def await_with_timeout(awaitable: Any, timeout: float | None) -> Any:
    """Await a Monarch future (or anything awaitable) with a timeout.

    ``asyncio.timeout`` (3.11+) costs no extra task per call, which matters on the hot path
    where a local Monarch call takes well under a millisecond.
    """
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout):
            return await awaitable

    async def _await() -> Any:
        return await awaitable

    return await asyncio.wait_for(_await(), timeout)


def translate_error(exc: BaseException, where: str) -> BaseException:
    """Monarch's exception for a failed call -> the forge error a caller should see."""
    if isinstance(exc, ActorError):
        remote = getattr(exc, "exception", None)
        if isinstance(remote, SupervisionError):
            return ReplicaFailed(f"{where}: the replica's process failed: {describe(remote)}")
        if remote is None:
            return EndpointError(where, "ActorError", describe(exc))
        return EndpointError(where, type(remote).__name__, str(remote), remote)
    if isinstance(exc, SupervisionError):
        return ReplicaFailed(f"{where}: the replica's process failed: {describe(exc)}")
    if isinstance(exc, TypeError) and "pickle" in str(exc):
        return UnsendableArgument(f"{where}: an argument cannot be sent to the replica (it must be picklable): {exc}")
    if isinstance(exc, asyncio.TimeoutError):
        return RequestTimeout(f"{where}: no answer within the timeout")
    if isinstance(exc, RuntimeError) and ("stopped" in str(exc) or "supervision" in str(exc).lower()):
        return ReplicaFailed(f"{where}: the replica is gone: {describe(exc)}")
    return exc


class QueuedItem:
    """One item of a batched endpoint, already in a replica's batcher, awaited later.

    Like a Monarch ``Future`` (the message leaves when the call is made, not when it is
    awaited), the item joins a batch when it is queued; ``result`` waits for its own answer. It
    remembers the replica's generation then, so that a retry can avoid that incarnation.
    """

    __slots__ = ("replica", "generation", "endpoint", "future")

    def __init__(self, replica: Replica, endpoint: str, future: asyncio.Future) -> None:
        self.replica = replica
        self.generation = replica.generation
        self.endpoint = endpoint
        self.future = future

    @property
    def origin(self) -> tuple[int, int]:
        """(replica id, generation) of the incarnation that holds the item."""
        return self.replica.replica_id, self.generation

    async def result(self, timeout: float | None) -> Any:
        """The item's own result, up to ``timeout`` seconds (None: no timer)."""
        if timeout is None:
            return await self.future
        try:
            return await await_with_timeout(self.future, timeout)
        except asyncio.TimeoutError as exc:
            name = f"{self.replica.spec.actor_cls.__name__}.{self.endpoint}"
            raise RequestTimeout(f"{name}: no result within {timeout}s") from exc


class Replica:
    """A replica's lifecycle (start, serve, fail, stop) and its request paths."""

    def __init__(self, replica_id: int, spec: ReplicaSpec, on_failure: Callable[[Replica], None] | None = None) -> None:
        """``on_failure(replica)`` runs when the replica fails (the service schedules its restart)."""
        self.replica_id = replica_id
        self.spec = spec
        self.state = ReplicaState.STARTING
        self.generation = 0
        self.proc_mesh: ProcMesh | None = None
        self.actor_mesh: Any = None
        self.batchers: dict[str, Batcher] = {}
        self.models: ReplicaModels | None = None  # the replica's models, if it multiplexes
        self.counters: dict[str, _EndpointCounters] = {}
        self.started_at: float | None = None
        self.failure: str | None = None
        self.restarts = 0
        self.failed_at: float | None = None
        self.on_failure = on_failure
        self.host_indices: list[int] = []  # its hosts' indices in the service's HostPool, if any
        self.last_progress = time.monotonic()  # last answer of any kind from the replica
        self._calls: set[asyncio.Task] = set()  # tasks awaiting this replica's answers
        self._in_flight = 0

    # ----------------------------------------------------------- identity
    @property
    def mesh_name(self) -> str:
        return f"{self.spec.service_name}-r{self.replica_id}-g{self.generation}"

    @property
    def host_index(self) -> int | None:
        """Index of the replica's first host in the service's HostPool; None on this host."""
        return self.host_indices[0] if self.host_indices else None

    @property
    def in_flight(self) -> int:
        return self._in_flight

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
        except BaseException as exc:
            self.state = ReplicaState.FAILED
            self.failure = describe(exc)
            await self._stop_mesh()
            raise translate_error(exc, f"{self.spec.actor_cls.__name__} replica {self.replica_id} setup") from exc
        cls_name = self.spec.actor_cls.__name__
        batched = [ep for ep in self.spec.endpoints.values() if ep.batching is not None]
        models = None
        if any(ep.multiplexed for ep in batched):
            models = ReplicaModels(self.spec.multiplexing, self._load_model, name=f"{cls_name}@r{self.replica_id}")
        self.models = models
        self.batchers = {}
        for ep in batched:
            label = f"{cls_name}.{ep.name}@r{self.replica_id}"
            execute = self._batch_executor(ep)
            if models is not None and ep.multiplexed:
                self.batchers[ep.name] = models.batcher(ep.batching, execute, name=label)
            else:
                self.batchers[ep.name] = Batcher(ep.batching, execute, name=label, send_full=ep.send_full)
        self.started_at = self.last_progress = time.monotonic()
        self.state = ReplicaState.HEALTHY if take_traffic else ReplicaState.RECOVERING
        logger.debug("replica %s ready in %.2fs", self.mesh_name, self.started_at - t0)

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
        for task in list(self._calls):  # answers that will never come: stop waiting for them
            task.cancel(msg=_ABORT)
        if self.on_failure is not None:
            self.on_failure(self)

    async def restart(self, resync: Callable[[Any], Awaitable[None]] | None = None) -> None:
        """Replace the processes with a new generation; it takes traffic once ``resync`` is done.

        ``await resync(actor_mesh)`` brings the new generation to the service's current state
        (e.g. the weight version) while the replica is RECOVERING, so no request reaches it
        before that. If the start or the resync fails, the replica is FAILED and the error
        raised; the caller decides whether to try again.
        """
        await self.stop(ReplicaFailed(f"replica {self.replica_id} is restarting"))
        self.generation += 1
        self.restarts += 1
        try:
            await self.start(take_traffic=False)
            if resync is not None:
                await resync(self.actor_mesh)
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

    async def _stop_mesh(self, timeout: float = 30.0) -> None:
        mesh, self.proc_mesh, self.actor_mesh = self.proc_mesh, None, None
        if mesh is None:
            return
        try:
            await await_with_timeout(mesh.stop(), timeout)
        except Exception as exc:  # a failed or hung mesh: its processes are reaped at exit
            logger.debug("stopping %s: %r", self.mesh_name, exc)

    # ----------------------------------------------------------- requests
    async def call(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any], timeout: float | None) -> Any:
        """One plain-endpoint request: one Monarch message."""
        counters = self._counters(endpoint)
        counters.requests += 1
        counters.in_flight += 1
        self._in_flight += 1
        try:
            return await self._send(endpoint, args, kwargs, timeout)
        except BaseException:
            counters.errors += 1
            raise
        finally:
            counters.in_flight -= 1
            self._in_flight -= 1

    def enqueue(self, endpoint: str, item: Any, key: Hashable) -> QueuedItem:
        """One batched-endpoint request: queued here, sent as part of a batch.

        No task per item, so a burst of singletons stays cheap. Never raises: an item the
        batcher refuses (closed, too large, a failing key function) is a ``QueuedItem`` whose
        ``result`` raises that error, as if the batch had failed it.
        """
        try:
            future = self.batchers[endpoint].enqueue(item, key)
        except Exception as exc:  # noqa: BLE001 - the caller sees it when it awaits the result
            future = asyncio.get_running_loop().create_future()
            future.set_exception(exc)
        counters = self._counters(endpoint)
        counters.in_flight += 1
        self._in_flight += 1

        def done(_: asyncio.Future) -> None:
            counters.in_flight -= 1
            self._in_flight -= 1

        future.add_done_callback(done)
        return QueuedItem(self, endpoint, future)

    async def submit(self, endpoint: str, item: Any, key: Hashable, timeout: float | None) -> Any:
        """``enqueue`` and wait for the result, up to ``timeout`` seconds (None: no timer)."""
        return await self.enqueue(endpoint, item, key).result(timeout)

    async def broadcast_call(
        self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any], timeout: float | None
    ) -> list[Any]:
        """Call every rank of this replica and return all their results (rank order)."""
        where = f"{self.spec.actor_cls.__name__}.{endpoint}@r{self.replica_id}"
        try:
            values = await await_with_timeout(getattr(self.actor_mesh, endpoint).call(*args, **kwargs), timeout)
        except BaseException as exc:
            raise self._failed_call(exc, where) from exc
        return list(values.values())

    async def _load_model(self, model_id: Hashable, evict: list) -> None:
        await self._send(LOAD_ENDPOINT, (model_id, evict), {}, self.spec.options.call_timeout_s)

    def _batch_executor(self, spec: EndpointSpec) -> Callable[[list[Any], Hashable], Awaitable[Sequence[Any]]]:
        """The Batcher's executor for one batched endpoint: one message per batch."""
        endpoint = spec.name
        enbatch, debatch = spec.batching.resolve_assembly(self.spec.actor_cls)  # type: ignore[union-attr]
        timeout = self.spec.options.call_timeout_s
        multiplexed = spec.multiplexed  # the key is the model id: sent first

        def execute(items: list[Any], key: Hashable) -> Awaitable[Sequence[Any]]:
            """Sends the batch's message now; the returned awaitable gives its results."""
            payload = enbatch(items) if enbatch is not None else items
            try:
                reply = self._dispatch(endpoint, (key, payload) if multiplexed else (payload,), {})
            except UnsendableArgument:
                if enbatch is not None or len(items) == 1:
                    raise
                return execute_without_unsendable(items, key)  # raises if none is to blame
            return finish(reply, len(items))

        async def finish(reply: Any, n: int) -> Sequence[Any]:
            result = await self._await_reply(endpoint, reply, timeout)
            return debatch(result, n) if debatch is not None else result

        async def execute_without_unsendable(items: list[Any], key: Hashable) -> list[Any]:
            """One caller's unpicklable item must not fail its batch-mates: fail just it."""
            results: list[Any] = [None] * len(items)
            good: list[int] = []
            for i, item in enumerate(items):
                try:
                    cloudpickle.dumps(item)
                    good.append(i)
                except Exception as exc:
                    results[i] = UnsendableArgument(
                        f"{self.spec.actor_cls.__name__}.{endpoint}: this request cannot be sent to the replica "
                        f"(it must be picklable): {type(item).__name__}: {exc}"
                    )
            if len(good) == len(items):
                raise UnsendableArgument(
                    f"{self.spec.actor_cls.__name__}.{endpoint}: the batch cannot be sent to the replica"
                )
            if good:
                sent = await execute([items[i] for i in good], key)
                for i, value in zip(good, sent):
                    results[i] = value
            return results

        return execute

    async def _send(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any], timeout: float | None) -> Any:
        return await self._await_reply(endpoint, self._dispatch(endpoint, args, kwargs), timeout)

    def _dispatch(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Send one message now (Monarch sends on call); return the future of its reply."""
        where = f"{self.spec.actor_cls.__name__}.{endpoint}@r{self.replica_id}"
        if self.actor_mesh is None or self.state not in (ReplicaState.HEALTHY, ReplicaState.RECOVERING):
            raise ReplicaFailed(f"{where}: replica is {self.state.value}")
        ep = getattr(self.actor_mesh, endpoint)
        self._counters(endpoint).messages += 1
        try:
            return ep.call_one(*args, **kwargs) if self.spec.options.ranks == 1 else ep.call(*args, **kwargs)
        except BaseException as exc:
            raise self._failed_call(exc, where) from exc

    async def _await_reply(self, endpoint: str, reply: Any, timeout: float | None) -> Any:
        """Wait for a reply, turning Monarch's failures into forge's (see ``translate_error``)."""
        where = f"{self.spec.actor_cls.__name__}.{endpoint}@r{self.replica_id}"
        task = asyncio.current_task()
        self._calls.add(task)  # type: ignore[arg-type]
        try:
            result = await await_with_timeout(reply, timeout)
            if self.spec.options.ranks != 1:
                result = next(iter(result.values()))  # rank 0's result
            self.last_progress = time.monotonic()
            return result
        except asyncio.CancelledError as exc:
            if exc.args == (_ABORT,) and self.state is ReplicaState.FAILED:
                if hasattr(task, "uncancel"):
                    task.uncancel()  # type: ignore[union-attr]
                raise ReplicaFailed(
                    f"{where}: the replica failed while this request was in flight: {self.failure}"
                ) from None
            raise
        except BaseException as exc:
            self._calls.discard(task)  # type: ignore[arg-type]  # don't abort ourselves below
            if isinstance(exc, ActorError):  # the replica answered, with an error
                self.last_progress = time.monotonic()
            raise self._failed_call(exc, where) from exc
        finally:
            self._calls.discard(task)  # type: ignore[arg-type]

    async def probe(self, timeout: float) -> bool:
        """Whether the replica answers a health probe within ``timeout`` seconds."""
        try:
            await await_with_timeout(self.actor_mesh._forge_health.call(), timeout)
        except Exception:
            return False
        self.last_progress = time.monotonic()
        return True

    def _failed_call(self, exc: BaseException, where: str) -> BaseException:
        if isinstance(exc, asyncio.CancelledError):
            return exc
        error = translate_error(exc, where)
        if isinstance(error, ReplicaFailed):
            self.mark_failed(str(error))
        return error

    # ----------------------------------------------------------- metrics
    def _counters(self, endpoint: str) -> _EndpointCounters:
        counters = self.counters.get(endpoint)
        if counters is None:
            counters = self.counters[endpoint] = _EndpointCounters()
        return counters

    def metrics(self) -> dict[str, Any]:
        """State, and per endpoint its sums: requests, batches, items, queue wait, errors (the
        fields of ``BatchStats``; a plain endpoint's message is a batch of one). Means are left
        to the reader, who may add several replicas up first (``Service.metrics``)."""
        endpoints: dict[str, dict[str, Any]] = {}
        for name in set(self.counters) | set(self.batchers):
            c = self._counters(name)
            batcher = self.batchers.get(name)
            if batcher is not None:
                stats = dataclasses.asdict(batcher.stats)
                stats.update(queued=batcher.queued, open_keys=len(batcher.keys))
            else:
                one_per_message = BatchStats(
                    requests=c.requests,
                    batches=c.messages,
                    items_batched=c.messages,
                    max_batch_size=min(c.messages, 1),
                    errors=c.errors,
                )
                stats = dataclasses.asdict(one_per_message)
            endpoints[name] = {**stats, "in_flight": c.in_flight}
        result = {
            "state": self.state.value,
            "generation": self.generation,
            "in_flight": self._in_flight,
            "endpoints": endpoints,
        }
        if self.models is not None:
            result["models"] = self.models.metrics()
        return result


_SUMMED = ("requests", "batches", "items_batched", "queue_wait_s_total", "in_flight", "errors")


def aggregate_endpoints(replica_endpoints: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per endpoint, the replicas' sums (``Replica.metrics()["endpoints"]``) added up, with the
    means computed from the totals (never a mean of means)."""
    totals: dict[str, dict[str, Any]] = {}
    for endpoints in replica_endpoints:
        for name, sums in endpoints.items():
            total = totals.setdefault(name, dict.fromkeys(_SUMMED, 0) | {"max_batch_size": 0})
            for key in _SUMMED:
                total[key] += sums[key]
            total["max_batch_size"] = max(total["max_batch_size"], sums["max_batch_size"])
    return {name: endpoint_view(total) for name, total in totals.items()}


def endpoint_view(sums: dict[str, Any]) -> dict[str, Any]:
    """An endpoint's metrics as reported: its sums, with mean batch size and mean queue wait
    in place of the item and wait totals."""
    items = sums["items_batched"]
    view = {k: v for k, v in sums.items() if k not in ("items_batched", "queue_wait_s_total")}
    view["mean_batch_size"] = items / sums["batches"] if sums["batches"] else 0.0
    view["mean_queue_wait_s"] = sums["queue_wait_s_total"] / items if items else 0.0
    return view
