"""The handle a caller holds: ``ServiceInterface`` (``svc``) and one ``EndpointHandle`` per endpoint.

A narrow facade over the engine (``forge.controller.service.Service``)::

    y = await svc.score.route(5, key="prompt-17")      # one request; key routes
    ys = await svc.score.route_many([1, 2, 3])         # one request per item, results in order
    rs = await svc.ping.fanout()                       # one result per healthy replica
    async with svc.session(): ...                      # calls inside stick to one replica
    svc.metrics(); await svc.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any

from forge.controller.routing import RouteTrace
from forge.controller.service import Service


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
        retry: bool = True,
        trace: RouteTrace | None = None,
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

        A request whose replica dies is sent to another (``max_retries``) unless ``retry=False``
        (then it fails with ``ReplicaFailed``: a caller that already passed part of the answer on).
        ``trace`` (a ``RouteTrace``) records the replica each try was sent to.
        """
        return self._service.submit(self._name, args, kwargs, key, batch_key, timeout, retry=retry, trace=trace)

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

    async def fanout(
        self, *args: Any, timeout: float | None = None, by_replica: bool = False, **kwargs: Any
    ) -> list[Any] | dict[int, Any]:
        """The same request to every healthy replica; one result per replica (``by_replica``: a
        dict by replica id)."""
        return await self._service.fanout(self._name, args, kwargs, timeout, by_replica=by_replica)

    def __repr__(self) -> str:
        kind = " (multiplexed)" if self._spec.multiplexed else " (batched)" if self._spec.batched else ""
        return f"<endpoint {self._service.actor_cls.__name__}.{self._name}{kind}>"


class ServiceInterface:
    """The handle a caller holds: ``svc.<endpoint>.route(...)``, ``session()``, ``metrics()``, ``shutdown()``."""

    def __init__(self, service: Service) -> None:
        self._service = service
        self._handles = {name: EndpointHandle(service, name) for name in service.endpoints}
        # Found without __getattr__ (one call less per route), unless the class has the name.
        self.__dict__.update({name: h for name, h in self._handles.items() if not hasattr(type(self), name)})

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

    async def retire_model(self, model_id: Hashable, timeout_s: float = 60.0) -> int:
        """See ``Service.retire_model``: evict a model no caller will name again from every replica."""
        return await self._service.retire_model(model_id, timeout_s)

    def set_resync(self, resync: Callable[[Any], Awaitable[None]] | None) -> None:
        """See ``Service.set_resync``: the step a restarted replica runs before taking traffic."""
        self._service.set_resync(resync)

    def add_replica_listener(self, listener: Callable[[], None]) -> None:
        """See ``Service.add_replica_listener``: ``listener()`` after a replica fails or is back."""
        self._service.add_replica_listener(listener)

    @property
    def service(self) -> Service:
        return self._service

    async def shutdown(self) -> None:
        await self._service.shutdown()

    def __repr__(self) -> str:
        s = self._service
        return f"<service {s.name}: {len(s.healthy_replicas())}/{len(s.replicas)} healthy>"
