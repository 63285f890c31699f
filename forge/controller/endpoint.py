"""``endpoint``: Monarch's endpoint decorator, plus the batched form.

``@endpoint`` marks a plain endpoint exactly as in Monarch. ``@endpoint(batch=Batching(...))``
marks a *batched* endpoint: its method takes a list and returns a list of the same length,
and a forge service prebatches singleton ``route`` calls into those lists (one Monarch message
per batch). Called directly on an actor mesh (``actor.ep.call_one([...])``) it is an ordinary
endpoint that takes a list: caller batching and actor batching share one method.

``@endpoint(batch=Batching(...), multiplexed=True)`` marks a batched endpoint that serves many
models (see ``forge.controller.multiplex``): its method takes ``(model, batch)``, every batch
holds one model's requests, and callers name the model: ``svc.ep.route(x, model_id="m7")``.
Called directly on an actor mesh it takes ``(model_id, batch)``.

``@endpoint(concurrent=True)`` lets the actor run several calls of that endpoint at once
(Monarch runs one message at a time otherwise). A batched endpoint's
``max_concurrent_batches`` is how many of its batches may be in flight to one replica: without
``concurrent=True`` the extra ones wait in the actor's mailbox, which hides the round trip
between batches; with it (e.g. an async engine) they also run at the same time. Without
``concurrent=True`` a batch that is already *full* is sent even when those slots are taken (it
cannot grow by waiting, and the actor runs one message at a time anyway), so a burst keeps the
actor busy; only batches that could still grow wait for a slot.

The decorator records what it was told in one ``EndpointSpec`` on Monarch's endpoint property;
``endpoint_specs(actor_cls)`` collects them, and services and replicas read them from there.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from monarch.actor import concurrent_endpoint as _monarch_concurrent_endpoint
from monarch.actor import endpoint as _monarch_endpoint

from forge.controller.batching import Batching
from forge.controller.multiplex import multiplexed_method

_SPEC_ATTR = "_forge_endpoint"


@dataclass(frozen=True)
class EndpointSpec:
    """Everything forge knows about one endpoint, declared once by ``@endpoint``.

    Services, replicas and handles read an endpoint's facts from here; an endpoint marked with
    Monarch's own decorator gets the defaults (plain, retried, not concurrent).
    """

    name: str
    batching: Batching | None = None
    """How singleton requests are prebatched; None for a plain endpoint."""
    retry: bool = True
    """Whether a request that a dead replica never answered may be resent elsewhere."""
    multiplexed: bool = False
    """A batched endpoint of many models: its batches hold one model's requests."""
    concurrent: bool = False
    """Whether the actor runs several calls of it at once."""
    signature: inspect.Signature | None = None
    """The user's signature without ``self``, to check a call before it is sent."""

    @functools.cached_property
    def batched(self) -> bool:
        return self.batching is not None

    def check_call(self, actor_name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """``TypeError`` naming the endpoint (of ``actor_name``'s class) if ``args``/``kwargs`` do
        not fit its signature.

        Why not always ``Signature.bind``: on a plain route it costs more than the rest of the
        request's path in Python; a call of positional arguments only is checked by their count.
        """
        if self.signature is None:
            return
        counts = self._positional_counts
        if not kwargs and counts is not None and counts[0] <= len(args) <= counts[1]:
            return
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{actor_name}.{self.name}{self.signature}: {exc}") from None

    @functools.cached_property
    def _positional_counts(self) -> tuple[int, int] | None:
        """(fewest, most) positional arguments that bind with no keywords; None when a required
        keyword-only parameter means no such call binds."""
        assert self.signature is not None
        fewest = most = 0
        for parameter in self.signature.parameters.values():
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                most += 1
                if parameter.default is parameter.empty:
                    fewest = most
            elif parameter.kind is parameter.VAR_POSITIONAL:
                most = sys.maxsize
            elif parameter.kind is parameter.KEYWORD_ONLY and parameter.default is parameter.empty:
                return None
        return fewest, most

    @property
    def send_full(self) -> bool:
        """Whether full batches go out past the execution slots (``Batcher(send_full=)``): an actor
        that runs one message at a time queues them in its mailbox; a concurrent endpoint would
        run them at once, and a multiplexed one waits for its model, so those wait for a slot."""
        return self.batched and not self.concurrent and not self.multiplexed


def endpoint(
    method: Callable[..., Any] | None = None,
    *,
    batch: Batching | None = None,
    concurrent: bool = False,
    retry: bool = True,
    multiplexed: bool = False,
    **monarch_options: Any,
) -> Any:
    """Mark a ``ForgeActor`` method as an endpoint, optionally batched.

    Args:
        batch: make this a batched endpoint (list in, list out) prebatched by services.
        concurrent: run calls of this endpoint concurrently inside the actor.
        retry: a service may resend a request that a dead replica never answered; set False
            for endpoints that are not idempotent (the caller then gets ``ReplicaFailed``).
        multiplexed: a batched endpoint of many models: the method takes ``(model, batch)``
            and the actor needs a ``@model_loader`` (see ``forge.controller.multiplex``).
        monarch_options: passed to Monarch's ``endpoint`` (e.g. ``instrument=False``).
    """
    if method is None:
        return lambda fn: endpoint(
            fn, batch=batch, concurrent=concurrent, retry=retry, multiplexed=multiplexed, **monarch_options
        )
    if batch is not None and not isinstance(batch, Batching):
        raise TypeError(f"endpoint(batch=...) must be a forge Batching, got {batch!r}")
    if not inspect.iscoroutinefunction(method):
        raise TypeError(
            f"forge endpoints must be 'async def' ({method.__qualname__} is not): Monarch cannot mix "
            f"sync and async endpoints in one actor, and ForgeActor's own endpoints are async"
        )
    if multiplexed and batch is None:
        raise TypeError(
            f"multiplexed endpoint {method.__qualname__} needs batch=Batching(...) (use Batching(max_size=1) "
            f"for one request per call)"
        )
    if multiplexed and batch.key is not None:  # type: ignore[union-attr]
        raise TypeError(
            f"multiplexed endpoint {method.__qualname__}: its batching key is the model id, "
            "so Batching(key=...) must be None"
        )
    if batch is not None:
        params = [p for p in inspect.signature(method).parameters.values() if p.name != "self"]
        required = [
            p
            for p in params
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(required) != 1 + multiplexed:
            wanted = (
                "two required arguments (the model, the batch)" if multiplexed else "one required argument (the batch)"
            )
            raise TypeError(
                f"{'multiplexed' if multiplexed else 'batched'} endpoint {method.__qualname__} must take exactly "
                f"{wanted}, got {[p.name for p in required]}"
            )
    spec = EndpointSpec(method.__name__, batch, retry, multiplexed, concurrent, _signature_without_self(method))
    if multiplexed:
        method = multiplexed_method(method)
    decorate = _monarch_concurrent_endpoint if concurrent else _monarch_endpoint
    prop = decorate(method, **monarch_options)
    setattr(prop, _SPEC_ATTR, spec)
    return prop


def endpoint_specs(actor_cls: type) -> dict[str, EndpointSpec]:
    """Name -> ``EndpointSpec`` of every endpoint of ``actor_cls`` (Monarch's own included).

    A batched endpoint's ``enbatch``/``debatch`` names are looked up here, so that a bad name
    fails when the service is made, not on its first batch.
    """
    from monarch._src.actor.endpoint import EndpointProperty

    specs: dict[str, EndpointSpec] = {}
    for name in dir(actor_cls):
        prop = getattr(actor_cls, name, None)
        if not isinstance(prop, EndpointProperty):
            continue
        spec = getattr(prop, _SPEC_ATTR, None)
        if spec is None:  # declared with Monarch's decorator: a plain endpoint
            method = None if getattr(prop, "_explicit_response_port", False) else getattr(prop, "_method", None)
            spec = EndpointSpec(name, signature=_signature_without_self(method) if method is not None else None)
        elif spec.name != name:  # the same property bound under another name
            spec = dataclasses.replace(spec, name=name)
        if spec.batching is not None:
            spec.batching.resolve_assembly(actor_cls)
        specs[name] = spec
    return specs


def _signature_without_self(method: Callable[..., Any]) -> inspect.Signature | None:
    """The method's signature without ``self``, for checking calls before they are sent."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return None
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def with_concurrent_batches(
    endpoints: dict[str, EndpointSpec], overrides: dict[str, int], cls_name: str
) -> dict[str, EndpointSpec]:
    """``endpoints`` with ``options(concurrent_batches=...)`` applied: how many batches of each
    named batched endpoint may be in flight to one replica (``Batching.max_concurrent_batches``)."""
    out = dict(endpoints)
    for name, batches in overrides.items():
        spec = endpoints.get(name)
        if spec is None or spec.batching is None:
            batched = sorted(n for n, e in endpoints.items() if e.batching is not None)
            raise ValueError(
                f"options(concurrent_batches=...) names {name!r}, which is not a batched endpoint of {cls_name}; "
                f"batched endpoints: {batched}"
            )
        out[name] = dataclasses.replace(
            spec, batching=dataclasses.replace(spec.batching, max_concurrent_batches=batches)
        )
    return out
