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
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from monarch.actor import concurrent_endpoint as _monarch_concurrent_endpoint
from monarch.actor import endpoint as _monarch_endpoint

from forge.controller.batching import Batching
from forge.controller.multiplex import multiplexed_method

_BATCHING_ATTR = "_forge_batching"
_RETRY_ATTR = "_forge_retry"
_MULTIPLEXED_ATTR = "_forge_multiplexed"
_CONCURRENT_ATTR = "_forge_concurrent"


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
    user_method = method
    if multiplexed:
        method = multiplexed_method(method)
    decorate = _monarch_concurrent_endpoint if concurrent else _monarch_endpoint
    prop = decorate(method, **monarch_options)
    setattr(prop, _BATCHING_ATTR, batch)
    setattr(prop, _RETRY_ATTR, retry)
    setattr(prop, _MULTIPLEXED_ATTR, multiplexed)
    setattr(prop, _CONCURRENT_ATTR, concurrent)
    prop._forge_method = user_method  # the undecorated method, for checking calls' arguments
    return prop


def batching_of(prop: Any) -> Batching | None:
    """The ``Batching`` declared on an endpoint property, or None for plain endpoints."""
    return getattr(prop, _BATCHING_ATTR, None)


def retry_allowed(prop: Any) -> bool:
    return getattr(prop, _RETRY_ATTR, True)


def is_concurrent(prop: Any) -> bool:
    """Whether the actor runs calls of this endpoint at the same time (``concurrent=True``)."""
    return getattr(prop, _CONCURRENT_ATTR, False)


def is_multiplexed(prop: Any) -> bool:
    return getattr(prop, _MULTIPLEXED_ATTR, False)
