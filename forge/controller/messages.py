"""What a replica's request paths are made of: one request's call record, one batch's message,
and Monarch's failures as forge's errors.

- ``Call``: one request on one replica incarnation, awaited with ``result(timeout)``. A batched
  endpoint's ``QueuedItem`` joins its batch when it is made (as a Monarch message leaves when it
  is sent, not when it is awaited); a plain endpoint's ``PlainCall`` sends its message when it
  is awaited. ``origin`` names the incarnation, so that a retry can avoid it.
- ``BatchSender``: a replica batcher's executor for one batched endpoint, one message per batch.
- ``ReplicaChannel``: all that the call records and the batch sender use of the replica they
  go through (``Replica`` is one), so that this module knows nothing of replicas' lifecycles.
- ``translate_error``: the exception Monarch raises for a failed call -> the forge error the
  caller should see (``EndpointError``, ``ReplicaFailed``, ``RequestTimeout``, ...).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Hashable, Sequence
from typing import Any, Protocol

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

try:  # the type Monarch raises when a process of the mesh died
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
except ImportError:  # pragma: no cover - layout of a future Monarch
    SupervisionError = RuntimeError  # type: ignore[misc,assignment]


_timeout = getattr(asyncio, "timeout", None)  # 3.11+


async def await_with_timeout(awaitable: Any, timeout: float | None) -> Any:
    """Await a Monarch future (or anything awaitable) with a timeout.

    ``asyncio.timeout`` (3.11+) costs no extra task per call, which matters on the hot path,
    where the timer would otherwise cost more than a local Monarch call.
    """
    if _timeout is not None:
        async with _timeout(timeout):
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


class ReplicaChannel(Protocol):
    """The way to one replica: what a call record or a batch sender needs of it, and no more."""

    replica_id: int
    generation: int
    actor_name: str
    """The actor class's name, for messages."""

    def dispatch(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Send one message now; return the future of its reply."""

    async def await_reply(self, endpoint: str, reply: Any, timeout: float | None) -> Any:
        """Wait for a reply, Monarch's failures turned into forge's."""

    async def call(self, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any], timeout: float | None) -> Any:
        """One plain-endpoint request: one message, counted."""


class Call(abc.ABC):
    """One request on one replica incarnation; ``await call.result(timeout)`` for its answer."""

    __slots__ = ("channel", "origin", "endpoint")
    channel: ReplicaChannel
    origin: tuple[int, int]
    """(replica id, generation) of the incarnation that holds the request (each subclass sets it:
    no ``super().__init__`` on the hot path)."""
    endpoint: str

    @abc.abstractmethod
    async def result(self, timeout: float | None) -> Any:
        """The request's own result, waiting up to ``timeout`` seconds (None: no timer of its own)."""


class QueuedItem(Call):
    """A batched endpoint's item, already in the replica's batcher: it joined a batch when made."""

    __slots__ = ("future",)

    def __init__(self, channel: ReplicaChannel, endpoint: str, future: asyncio.Future) -> None:
        self.channel, self.endpoint, self.future = channel, endpoint, future
        self.origin = (channel.replica_id, channel.generation)

    async def result(self, timeout: float | None) -> Any:
        if timeout is None:  # the batch's message has call_timeout_s: answered in bounded time anyway
            return await self.future
        try:
            return await await_with_timeout(self.future, timeout)
        except asyncio.TimeoutError as exc:
            raise RequestTimeout(f"{self.channel.actor_name}.{self.endpoint}: no result within {timeout}s") from exc


class PlainCall(Call):
    """A plain endpoint's request: one message, sent when the result is awaited."""

    __slots__ = ("args", "kwargs")

    def __init__(self, channel: ReplicaChannel, endpoint: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        self.channel, self.endpoint, self.args, self.kwargs = channel, endpoint, args, kwargs
        self.origin = (channel.replica_id, channel.generation)

    def result(self, timeout: float | None) -> Awaitable[Any]:
        return self.channel.call(self.endpoint, self.args, self.kwargs, timeout)  # no frame of its own


class BatchSender:
    """A replica batcher's executor for one batched endpoint: each batch is one message.

    Called with a batch, it sends the message at once (so the batch is on the wire when the
    batcher's call returns) and returns the awaitable of the results, split per item by the
    endpoint's ``debatch``. A multiplexed endpoint's message carries the model id (the batch's
    key) first. A batch that cannot be pickled is sent again without the items to blame, which
    fail alone with ``UnsendableArgument``.
    """

    def __init__(self, channel: ReplicaChannel, spec: EndpointSpec, actor_cls: type, timeout: float | None) -> None:
        """``actor_cls``: where the endpoint's own batch assembly is found; ``timeout``: each batch's message's."""
        assert spec.batching is not None
        self.channel = channel
        self.endpoint = spec.name
        self.name = f"{actor_cls.__name__}.{spec.name}"
        self.multiplexed = spec.multiplexed
        self.enbatch, self.debatch = spec.batching.resolve_assembly(actor_cls)
        self.timeout = timeout

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
        return self.channel.dispatch(self.endpoint, (key, payload) if self.multiplexed else (payload,), {})

    async def _results(self, reply: Any, n: int) -> Sequence[Any]:
        result = await self.channel.await_reply(self.endpoint, reply, self.timeout)
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
