"""What a replica's request paths are made of: one request's call record, one batch's message,
and Monarch's failures as forge's errors.

- ``Call``: one request on one replica incarnation, awaited with ``result(timeout)``. A batched
  endpoint's ``QueuedItem`` joins its batch when it is made (as a Monarch message leaves when it
  is sent, not when it is awaited); a plain endpoint's ``PlainCall`` sends its message when it
  is awaited. ``origin`` names the incarnation, so that a retry can avoid it.
- ``BatchSender``: a replica batcher's executor for one batched endpoint, one message per batch.
- ``translate_error``: the exception Monarch raises for a failed call -> the forge error the
  caller should see (``EndpointError``, ``ReplicaFailed``, ``RequestTimeout``, ...).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle
from monarch.actor import ActorError

from forge.controller.endpoint import EndpointSpec
from forge.controller.errors import (
    BatchResultError,
    EndpointError,
    ReplicaFailed,
    RequestTimeout,
    UnsendableArgument,
    describe,
)

if TYPE_CHECKING:
    from forge.controller.replica import Replica

try:  # the type Monarch raises when a process of the mesh died
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
except ImportError:  # pragma: no cover - layout of a future Monarch
    SupervisionError = RuntimeError  # type: ignore[misc,assignment]


async def await_with_timeout(awaitable: Any, timeout: float | None) -> Any:
    """Await a Monarch future (or anything awaitable) with a timeout.

    ``asyncio.timeout`` (3.11+) costs no extra task per call, which matters on the hot path,
    where the timer would otherwise cost more than a local Monarch call.
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


class Call(abc.ABC):
    """One request on one replica incarnation; ``await call.result(timeout)`` for its answer."""

    __slots__ = ("replica", "generation", "endpoint")

    def __init__(self, replica: Replica, endpoint: str) -> None:
        self.replica = replica
        self.generation = replica.generation
        self.endpoint = endpoint

    @property
    def origin(self) -> tuple[int, int]:
        """(replica id, generation) of the incarnation that holds the request."""
        return self.replica.replica_id, self.generation

    @abc.abstractmethod
    async def result(self, timeout: float | None) -> Any:
        """The request's own result, waiting up to ``timeout`` seconds (None: no timer of its own)."""


class QueuedItem(Call):
    """A batched endpoint's item, already in the replica's batcher: it joined a batch when made."""

    __slots__ = ("future",)

    def __init__(self, replica: Replica, endpoint: str, future: asyncio.Future) -> None:
        super().__init__(replica, endpoint)
        self.future = future

    async def result(self, timeout: float | None) -> Any:
        if timeout is None:  # the batch's message has call_timeout_s: answered in bounded time anyway
            return await self.future
        try:
            return await await_with_timeout(self.future, timeout)
        except asyncio.TimeoutError as exc:
            name = f"{self.replica.spec.actor_cls.__name__}.{self.endpoint}"
            raise RequestTimeout(f"{name}: no result within {timeout}s") from exc


class PlainCall(Call):
    """A plain endpoint's request: one message, sent when the result is awaited."""

    __slots__ = ("args", "kwargs")

    def __init__(self, replica: Replica, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        super().__init__(replica, endpoint)
        self.args = args
        self.kwargs = kwargs

    async def result(self, timeout: float | None) -> Any:
        return await self.replica.call(self.endpoint, self.args, self.kwargs, timeout)


class BatchSender:
    """A replica batcher's executor for one batched endpoint: each batch is one message.

    Called with a batch, it sends the message at once (so the batch is on the wire when the
    batcher's call returns) and returns the awaitable of the results, split per item by the
    endpoint's ``debatch``. A multiplexed endpoint's message carries the model id (the batch's
    key) first. A batch that cannot be pickled is sent again without the items to blame, which
    fail alone with ``UnsendableArgument``.
    """

    def __init__(self, replica: Replica, spec: EndpointSpec) -> None:
        assert spec.batching is not None
        self.replica = replica
        self.endpoint = spec.name
        self.name = f"{replica.spec.actor_cls.__name__}.{spec.name}"
        self.multiplexed = spec.multiplexed
        self.enbatch, self.debatch = spec.batching.resolve_assembly(replica.spec.actor_cls)
        self.timeout = replica.spec.options.call_timeout_s

    def __call__(self, items: list[Any], key: Hashable) -> Awaitable[Sequence[Any]]:
        try:
            reply = self._send(items, key)
        except UnsendableArgument:
            if self.enbatch is not None or len(items) == 1:
                raise  # one payload, or one caller: nothing to split off
            return self._without_unsendable(items, key)
        return self._results(reply, len(items))

    def _send(self, items: list[Any], key: Hashable) -> Any:
        """Send the batch's message now; return the future of its reply."""
        payload = self.enbatch(items) if self.enbatch is not None else items
        return self.replica.dispatch(self.endpoint, (key, payload) if self.multiplexed else (payload,), {})

    async def _results(self, reply: Any, n: int) -> Sequence[Any]:
        result = await self.replica.await_reply(self.endpoint, reply, self.timeout)
        return self.debatch(result, n) if self.debatch is not None else result

    async def _without_unsendable(self, items: list[Any], key: Hashable) -> list[Any]:
        """One caller's unpicklable item must not fail its batch-mates: fail just it."""
        results: list[Any] = [self._pickling_error(item) for item in items]  # None where it pickles
        good = [i for i, error in enumerate(results) if error is None]
        if len(good) == len(items):
            raise UnsendableArgument(f"{self.name}: the batch cannot be sent to the replica")
        if good:
            sent = await self._results(self._send([items[i] for i in good], key), len(good))
            if not isinstance(sent, (list, tuple)) or len(sent) != len(good):
                raise BatchResultError(f"{self.name}: a batch of {len(good)} items must return {len(good)} results")
            for i, value in zip(good, sent):
                results[i] = value
        return results

    def _pickling_error(self, item: Any) -> UnsendableArgument | None:
        try:
            cloudpickle.dumps(item)
        except Exception as exc:
            return UnsendableArgument(
                f"{self.name}: this request cannot be sent to the replica (it must be picklable): "
                f"{type(item).__name__}: {exc}"
            )
        return None
