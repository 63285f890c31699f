"""``ForgeActor``: a Monarch actor that can be started as a plain actor mesh or as a service.

::

    class Scorer(ForgeActor):
        def __init__(self, scale: int = 1):
            self.scale = scale

        @endpoint(batch=Batching(max_size=16, max_wait_s=0.01))
        async def score(self, items: list[int]) -> list[int]:
            return [x * self.scale for x in items]

    svc = await Scorer.options(num_replicas=3, router="key_affinity").as_service(scale=2)
    actor = await Scorer.options(procs=2).as_actor(scale=2)
    await actor.score.call([1, 2])          # Monarch adverbs, one result per rank
    await Scorer.shutdown(actor)             # stops the actor's processes

A ``ForgeActor`` may serve many models: mark its loader with ``@model_loader(max_models=3)``
and its batched endpoints with ``multiplexed=True`` (see ``forge.controller.multiplex``).

Endpoints must be ``async def`` (Monarch cannot mix sync and async endpoints in one actor).
Override ``setup`` (decorated with ``@endpoint``) for async initialisation: it runs once on
every rank before the actor or replica takes traffic.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, TypeVar

from monarch.actor import Actor

from forge.controller.endpoint import endpoint
from forge.controller.errors import ForgeError
from forge.controller.handle import ServiceInterface
from forge.controller.messages import await_with_timeout, translate_error
from forge.controller.multiplex import model_store
from forge.controller.options import ActorOptions
from forge.controller.process_watch import ProcessIdentity, this_process
from forge.controller.provisioner import place_replica, replica_gpus
from forge.controller.service import Service

logger = logging.getLogger("forge.actor")

A = TypeVar("A", bound="ForgeActor")
_actor_ids = itertools.count()


def _undelivered(message: Any) -> str:
    try:
        return f"to {message.dest()}: {message.error_msg()}"
    except Exception:  # noqa: BLE001 - a log line, whatever Monarch's envelope holds
        return repr(message)


class ForgeActor(Actor):
    """Base class of forge actors: Monarch's ``Actor`` plus ``options``/``as_actor``/``as_service``."""

    @endpoint
    async def setup(self) -> None:
        """Async initialisation, run once on every rank before any traffic. Override it."""

    def _handle_undeliverable_message(self, message: Any) -> bool:
        """A message this actor sent could not be delivered, most often its reply to a caller
        whose process died (a rollout worker killed mid-request). Monarch would fail this actor
        for it, taking a healthy replica down with its caller; the caller is gone, so the reply
        is dropped. (A request to an actor that died fails at its caller by supervision.)"""
        logger.info("dropped a message that could not be delivered: %s", _undelivered(message))
        return True

    @endpoint(concurrent=True)
    async def _forge_health(self) -> bool:
        """Liveness probe of the service's health loop (concurrent: never queues behind a
        request that is waiting on I/O)."""
        return True

    @endpoint(concurrent=True)
    async def _forge_process(self) -> ProcessIdentity:
        """Which process this rank runs in, for the service's process watch (``forge.controller.process_watch``)."""
        return this_process()

    @endpoint
    async def drain_metrics(self) -> list[tuple[str, float, str]]:
        """The metric records this process made since the last drain (``forge.observability``'s
        ``record_metric``); a controller gathers them, e.g. once a step."""
        # Imported here: forge.observability imports matplotlib, which only recording actors need.
        from forge.observability.metrics import drain_local_metrics

        return drain_local_metrics()

    @endpoint(concurrent=True)
    async def _forge_load_model(self, model_id: Any, evict: list) -> None:
        """Evict the models in ``evict``, then load ``model_id`` (a service's replica sends this;
        concurrent: other models' batches run while a model loads)."""
        await model_store(self).load(model_id, evict)

    @classmethod
    def options(cls: type[A], **options: Any) -> ActorLauncher[A]:
        """Configure how the actor is started; see ``ActorOptions`` for every option."""
        try:
            opts = ActorOptions(**options)
        except TypeError as exc:
            known = sorted(ActorOptions.__dataclass_fields__)
            raise TypeError(f"{cls.__name__}.options(): {exc}; known options: {known}") from None
        return ActorLauncher(cls, opts)

    @classmethod
    async def as_actor(cls: type[A], *args: Any, **kwargs: Any) -> Any:
        """Spawn one actor mesh with default options (see ``options(...).as_actor``)."""
        return await ActorLauncher(cls, ActorOptions()).as_actor(*args, **kwargs)

    @classmethod
    async def as_service(cls: type[A], *args: Any, **kwargs: Any) -> ServiceInterface:
        """Start a service with default options (see ``options(...).as_service``)."""
        return await ActorLauncher(cls, ActorOptions()).as_service(*args, **kwargs)

    @staticmethod
    async def shutdown(actor: Any, timeout_s: float = 30.0) -> None:
        """Stop an actor mesh made by ``as_actor`` (and its processes), or a service handle.
        ``timeout_s``: longest an actor mesh's stop may take (a dead host's processes never
        answer it)."""
        if isinstance(actor, ServiceInterface):
            await actor.shutdown()
            return
        proc_mesh = getattr(actor, "_proc_mesh", None)
        if proc_mesh is None:
            raise TypeError(f"ForgeActor.shutdown needs an actor mesh from as_actor() or a service, got {actor!r}")
        await await_with_timeout(proc_mesh.stop(), timeout_s)


class ActorLauncher:
    """A ForgeActor class together with its options; ``as_actor``/``as_service`` start it."""

    def __init__(self, actor_cls: type, options: ActorOptions) -> None:
        _check_actor_class(actor_cls)
        self.actor_cls = actor_cls
        self.options = options

    async def as_actor(self, *args: Any, **kwargs: Any) -> Any:
        """Spawn one actor mesh of ``procs`` processes (on each of ``hosts`` hosts of
        ``host_pool``, if given), run ``setup`` on every rank, return it.

        The result is a Monarch ActorMesh: call it with ``call_one``/``call``/``choose``.
        Stop it with ``await ForgeActor.shutdown(actor)``.
        """
        opts = self.options
        if opts.num_replicas != 1:
            raise ValueError(f"as_actor() starts one actor mesh; num_replicas={opts.num_replicas} needs as_service()")
        name = f"{opts.name or self.actor_cls.__name__.lower()}-a{next(_actor_ids)}"
        proc_mesh, _ = place_replica(name, opts, replica_gpus(opts, 1)[0], opts.env)
        try:
            actor = proc_mesh.spawn(name, self.actor_cls, *args, **kwargs)
            await await_with_timeout(actor.setup.call(), opts.setup_timeout_s)
        except BaseException as exc:
            try:
                await await_with_timeout(proc_mesh.stop(), 30.0)
            except Exception:
                pass
            raise translate_error(exc, f"{self.actor_cls.__name__}.setup") from exc
        return actor

    async def as_service(self, *args: Any, **kwargs: Any) -> ServiceInterface:
        """Start ``num_replicas`` replicas, each on its own proc mesh, and return the handle."""
        service = Service(self.actor_cls, self.options, args, kwargs)
        await service.start()
        return ServiceInterface(service)


def _check_actor_class(actor_cls: Any) -> None:
    from monarch._src.actor.endpoint import EndpointProperty

    if not (isinstance(actor_cls, type) and issubclass(actor_cls, ForgeActor)):
        raise TypeError(f"expected a ForgeActor subclass, got {actor_cls!r}")
    if not isinstance(getattr(actor_cls, "setup", None), EndpointProperty):
        raise ForgeError(f"{actor_cls.__name__}.setup must be decorated with @endpoint (it is forge's async init hook)")
