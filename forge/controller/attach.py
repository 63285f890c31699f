"""A service seen from another process: ``ServiceView`` (what crosses) and ``AttachedService``.

A service belongs to the process that started it, which restarts its replicas, probes their
health and hears of their deaths from Monarch. A second process, such as a rollout worker that
runs part of the controller's loop, reaches the same replicas through an attached service:

    view = service_view(policy)                              # owner: a snapshot of the replicas
    policy = await attach(view)                              # worker: a ServiceInterface of its own
    group = await policy.generate.route(prompt, key=k)
    await attached_service(policy).apply(service_view(...))  # worker: a restarted replica is back

The attached service routes and prebatches with its own routers and batchers (the endpoint's
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
from forge.controller.replica import Replica, ReplicaState
from forge.controller.service import Service

__all__ = ["AttachedService", "ReplicaView", "ServiceView", "attach", "attached_service", "service_view"]

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


class AttachedService(Service):
    """A ``Service`` over replicas another process owns (see the module's docstring)."""

    def __init__(self, view: ServiceView) -> None:
        super().__init__(view.actor_cls, view.options, (), {})
        self.name = view.name
        for replica in self.replicas:
            replica.spec.service_name = view.name
            replica.state = ReplicaState.FAILED  # until a view shows it live

    async def start(self) -> None:
        """Nothing to spawn: only this process's event loop and admission condition."""
        self._loop = asyncio.get_running_loop()
        self._capacity_changed = asyncio.Condition()

    async def apply(self, view: ServiceView) -> None:
        """Take the owner's newer snapshot: a new generation (restarted) takes traffic here, a
        replica the owner no longer routes to stops taking it (its queued items fail with
        ``ReplicaFailed``, which callers treat as a death)."""
        if self._stopped:
            return
        if len(view.replicas) != len(self.replicas):
            raise ValueError(
                f"view of service {view.name} has {len(view.replicas)} replicas; this attached service has "
                f"{len(self.replicas)}"
            )
        for seen, replica in zip(view.replicas, self.replicas):
            live = replica.accepting and replica.actor_mesh is not None
            if seen.actor_mesh is None:
                if live:
                    replica.mark_failed(f"its owner stopped routing to generation {replica.generation}")
            elif not live or seen.generation != replica.generation:
                await replica.attach(seen.actor_mesh, seen.generation)
        await self._notify_capacity()

    def _on_replica_failed(self, replica: Replica) -> None:
        """Not ours to restart: the owner does, and its next view brings the replica back."""

    def _may_recover(self) -> bool:
        """Any replica may come back in the owner's next view; admission waits (bounded)."""
        return not self._stopped

    async def shutdown(self) -> None:
        """Fail what is queued here; the replicas' processes are the owner's and keep running."""
        if self._stopped:
            return
        self._stopped = True
        error = ServiceStopped(f"attached service {self.name} was shut down")
        await asyncio.gather(*(r.detach(error) for r in self.replicas), return_exceptions=True)
        await self._notify_capacity()


async def attach(view: ServiceView) -> ServiceInterface:
    """A handle to the service of ``view``, for this process: its own routing and batching."""
    service = AttachedService(view)
    await service.start()
    await service.apply(view)
    return ServiceInterface(service)


def attached_service(handle: ServiceInterface) -> AttachedService:
    """The ``AttachedService`` behind ``handle`` (``TypeError`` for a service this process owns)."""
    service = handle.service
    if not isinstance(service, AttachedService):
        raise TypeError(f"service {service.name} is owned by this process, not attached")
    return service
