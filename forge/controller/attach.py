"""A service seen from another process: ``ServiceView`` (what crosses) and ``AttachedReplicas``.

A service belongs to the process that started it, which restarts its replicas, probes their
health and hears of their deaths from Monarch. A second process, such as a rollout worker that
runs part of the controller's loop, reaches the same replicas through an attached service:

    view = service_view(policy)                              # owner: a snapshot of the replicas
    policy = await attach(view)                              # worker: a ServiceInterface of its own
    group = await policy.generate.route(prompt, key=k)
    await attached_replicas(policy).apply(service_view(...))  # worker: a restarted replica is back

The attached service is a plain ``Service`` whose replica source is ``AttachedReplicas``: it
routes and prebatches with its own routers and batchers (the endpoint's
``Batching``), so a worker's requests cost the owner nothing. A call to a replica whose process
died fails at once with ``ReplicaFailed`` (Monarch tells every caller), and the attached
service stops routing there; it never restarts anything. The owner restarts the replica and
sends the new generation in a fresh view (``Service.add_replica_listener``), which ``apply``
puts back into rotation. Meanwhile a caller with no replica to go to waits for one, up to the
options' ``queue_timeout_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from forge.controller.errors import ServiceStopped
from forge.controller.handle import ServiceInterface
from forge.controller.lifecycle import ReplicaOwner
from forge.controller.replica import Replica, ReplicaState
from forge.controller.service import Service

__all__ = ["AttachedReplicas", "ReplicaView", "ServiceView", "attach", "attached_replicas", "service_view"]

logger = logging.getLogger("forge.service")


@dataclass
class ReplicaView:
    """One replica as its owner sees it now."""

    replica_id: int
    generation: int
    actor_mesh: Any
    """The live generation's actor mesh; None while the replica takes no traffic (failed,
    restarting, resyncing or stopped)."""


@dataclass
class ServiceView:
    """What another process needs to call a service's replicas: picklable, no processes owned."""

    actor_cls: type
    options: Any  # ActorOptions, less what only the owner uses (hosts, GPUs, health probes)
    name: str
    replicas: list[ReplicaView]


def service_view(service: Service | ServiceInterface) -> ServiceView:
    """A snapshot of ``service``'s replicas, to send to a process that will ``attach`` it."""
    service = service.service if isinstance(service, ServiceInterface) else service
    options = dataclasses.replace(service.options, host_pool=None, with_gpus=False, gpus=None, health_interval_s=None)
    replicas = [
        ReplicaView(r.replica_id, r.generation, r.actor_mesh if r.state is ReplicaState.HEALTHY else None)
        for r in service.replicas
    ]
    return ServiceView(service.actor_cls, options, service.name, replicas)


class AttachedReplicas:
    """The replica source of a service whose replicas another process owns (see the module's
    docstring): they begin FAILED, take traffic once a view shows them live, and are never
    restarted here."""

    initial_state = ReplicaState.FAILED

    def __init__(self) -> None:
        self._service: ReplicaOwner | None = None

    async def start(self, service: ReplicaOwner) -> None:
        """Nothing to spawn: the owner's views bring the replicas (``apply``)."""
        self._service = service

    async def apply(self, view: ServiceView) -> None:
        """Take the owner's newer snapshot: a new generation (restarted) takes traffic here, a
        replica the owner no longer routes to stops taking it (its queued items fail with
        ``ReplicaFailed``, which callers treat as a death)."""
        service = self._service
        if service is None:
            raise RuntimeError("apply() before the attached service started")
        if service.stopped:
            return
        if len(view.replicas) != len(service.replicas):
            raise ValueError(
                f"view of service {view.name} has {len(view.replicas)} replicas; this attached service has "
                f"{len(service.replicas)}"
            )
        for seen, replica in zip(view.replicas, service.replicas):
            live = replica.accepting and replica.actor_mesh is not None
            if seen.actor_mesh is None:
                if live:
                    replica.mark_failed(f"its owner stopped routing to generation {replica.generation}")
            elif not live or seen.generation != replica.generation:
                await replica.attach(seen.actor_mesh, seen.generation)
        await service.notify_capacity()

    def replica_failed(self, replica: Replica) -> None:
        """Not ours to restart: the owner does, and its next view brings the replica back."""

    def may_recover(self) -> bool:
        """Any replica may come back in the owner's next view; admission waits (bounded)."""
        return True

    async def stop(self, error: BaseException) -> None:
        """Fail what is queued here; the replicas' processes are the owner's and keep running."""
        if self._service is not None:
            detached = ServiceStopped(f"attached service {self._service.name} was shut down")
            await asyncio.gather(*(r.detach(detached) for r in self._service.replicas), return_exceptions=True)


async def attach(view: ServiceView) -> ServiceInterface:
    """A handle to the service of ``view``, for this process: its own routing and batching."""
    replicas = AttachedReplicas()
    service = Service(view.actor_cls, view.options, (), {}, source=replicas, name=view.name)
    await service.start()
    await replicas.apply(view)
    return ServiceInterface(service)


def attached_replicas(handle: ServiceInterface) -> AttachedReplicas:
    """The replica source of an attached service's handle, to ``apply`` its owner's newer views
    (``TypeError`` for a service this process owns)."""
    source = handle.service.source
    if not isinstance(source, AttachedReplicas):
        raise TypeError(f"service {handle.service.name} is owned by this process, not attached")
    return source
