"""Who brings a service's replicas up, back and down: its replica source.

A ``Service`` routes, admits and sends; what happens to its replicas over their lives is its
source's business, chosen once when the service is made:

- ``OwnedReplicas`` (the default): this process spawned the replicas, so it hears of their
  deaths from Monarch, watches their processes, probes their health, and restarts a dead one
  (with backoff, resynced) as a new generation;
- ``AttachedReplicas`` (``forge.controller.attach``): another process owns them; this one takes
  the owner's views of them and never restarts anything.

Each replica still writes its own state (``Replica.mark_failed``, ``restart``, ``attach``); a
source only decides when those happen.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from monarch.actor import MeshFailure

from forge.controller.errors import describe
from forge.controller.options import ActorOptions
from forge.controller.provisioner import add_fault_listener, remove_fault_listener
from forge.controller.replica import Replica, ReplicaState

logger = logging.getLogger("forge.service")


class ReplicaOwner(Protocol):
    """What a source sees of its service (``Service`` is one)."""

    name: str
    actor_cls: type
    options: ActorOptions
    replicas: list[Replica]
    resync: Callable[[Any], Awaitable[Any]] | None

    @property
    def stopped(self) -> bool: ...

    def replicas_changed(self) -> None:
        """Tell the service's replica listeners."""

    async def notify_capacity(self) -> None:
        """Let callers waiting for admission look again."""


class ReplicaSource(Protocol):
    """The lifecycle side of a service's replicas (see the module's docstring)."""

    initial_state: ReplicaState
    """Where a new replica begins, before ``start``."""

    async def start(self, service: ReplicaOwner) -> None:
        """Bring the service's replicas up (or wait for news of them); raise if that fails."""

    def replica_failed(self, replica: Replica) -> None:
        """``replica`` just failed: restart it, or leave that to its owner."""

    def may_recover(self) -> bool:
        """Whether a replica that takes no traffic now may take it again (admission waits)."""

    async def stop(self, error: BaseException) -> None:
        """Stop what the source runs; replicas' queued work fails with ``error``."""


class OwnedReplicas:
    """Replicas this process spawned: started, watched, restarted and stopped here."""

    initial_state = ReplicaState.STARTING

    def __init__(self) -> None:
        self._service: ReplicaOwner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = contextvars.copy_context()
        self._recoveries: dict[int, asyncio.Task] = {}
        self._health_task: asyncio.Task | None = None
        self.recovery_log: list[dict[str, float]] = []
        """One entry per restart that brought a replica back: its id and seconds from failure to back."""

    @property
    def service(self) -> ReplicaOwner:
        assert self._service is not None, "the source has not been started"
        return self._service

    async def start(self, service: ReplicaOwner) -> None:
        """Start every replica concurrently; if any fails to start, raise (the service stops all)."""
        self._service = service
        self._loop = asyncio.get_running_loop()
        # Monarch's fault hook runs on Monarch's thread with Monarch's own context variables;
        # failure handling and restarts must run in the context the service was started in.
        self._context = contextvars.copy_context()
        add_fault_listener(self._on_mesh_failure)
        results = await asyncio.gather(*(r.start() for r in service.replicas), return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            raise errors[0]
        if service.options.health_interval_s is not None:
            self._health_task = self._context.copy().run(self._loop.create_task, self._health_loop())
        logger.info(
            "service %s: %d replica(s) of %s ready", service.name, len(service.replicas), service.actor_cls.__name__
        )

    async def stop(self, error: BaseException) -> None:
        background = [*self._recoveries.values(), *([self._health_task] if self._health_task else [])]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if self._service is not None:
            await asyncio.gather(*(r.stop(error) for r in self._service.replicas), return_exceptions=True)
        remove_fault_listener(self._on_mesh_failure)

    def may_recover(self) -> bool:
        """Whether some replica takes traffic now or may again (starting, resyncing, restarting)."""
        live = (ReplicaState.STARTING, ReplicaState.RECOVERING, ReplicaState.HEALTHY)
        return any(r.state in live or r.replica_id in self._recoveries for r in self.service.replicas)

    # ----------------------------------------------------------- failures
    def _on_mesh_failure(self, failure: MeshFailure) -> bool:
        """Monarch's fault hook (called on Monarch's own thread): hand over to our loop."""
        if self._service is None:
            return False
        mesh_name = str(getattr(failure, "mesh_name", ""))
        for replica in self._service.replicas:
            if replica.owns_mesh(mesh_name):
                if self._loop is not None and not self._loop.is_closed():
                    reason = f"its process died ({describe(failure, limit=300)})"
                    self._loop.call_soon_threadsafe(replica.mark_failed, reason, context=self._context.copy())
                return True
        return False

    def replica_failed(self, replica: Replica) -> None:
        """A replica's process died: restart it in the background (with backoff)."""
        service = self.service
        if service.stopped or replica.replica_id in self._recoveries:
            return
        service.replicas_changed()
        loop = asyncio.get_running_loop()
        task = self._context.copy().run(loop.create_task, self._recover(replica), name=f"{replica.mesh_name}-recover")
        self._recoveries[replica.replica_id] = task
        task.add_done_callback(lambda _: self._recoveries.pop(replica.replica_id, None))

    async def _recover(self, replica: Replica) -> None:
        """The restart policy: back off (doubling per failed try, at most 30 s), give up after
        ``max_restarts``; the replica itself restarts, resyncs and rejoins."""
        service, options = self.service, self.service.options
        failed_at = replica.failed_at or time.monotonic()
        attempt = 0
        while not service.stopped:
            if replica.restarts >= options.max_restarts:
                if options.max_restarts == 0:
                    logger.error("replica %s failed; max_restarts=0 allows no restart", replica.mesh_name)
                else:
                    logger.error(
                        "replica %s failed again after %d restarts (max_restarts=%d); not restarting it again",
                        replica.mesh_name,
                        replica.restarts,
                        options.max_restarts,
                    )
                await service.notify_capacity()
                return
            await asyncio.sleep(min(options.restart_backoff_s * 2**attempt, 30.0))
            try:
                await replica.restart(service.resync)
            except Exception as exc:
                attempt += 1
                logger.warning(
                    "restarting replica %s failed (%s); retrying",
                    replica.mesh_name,
                    describe(exc),
                    exc_info=logger.isEnabledFor(logging.DEBUG),
                )
                continue
            self.recovery_log.append({"replica": replica.replica_id, "recovery_s": time.monotonic() - failed_at})
            logger.info("replica %s is back after %.1fs", replica.mesh_name, time.monotonic() - failed_at)
            service.replicas_changed()
            await service.notify_capacity()
            return

    async def _health_loop(self) -> None:
        """Fail replicas whose process is gone, and those that neither answer probes nor finish
        requests for health_timeout_s.

        Monarch reports a dead *process* by itself, but on a loaded machine its report can lag by
        tens of seconds; a process on this host is seen gone at the next interval instead
        (``forge.controller.process_watch``). The probes catch the silent cases, such as a host
        whose worker died and took the replica's process out of Monarch's sight.
        """
        service, options = self.service, self.service.options
        interval, limit = options.health_interval_s, options.health_timeout_s
        assert interval is not None
        while not service.stopped:
            await asyncio.sleep(interval)
            for replica in service.replicas:
                gone = replica.gone_process() if replica.state is ReplicaState.HEALTHY else None
                if gone is not None:
                    replica.mark_failed(
                        f"its process {gone.pid} on {gone.hostname} is gone (seen by the process watch)"
                    )
            now = time.monotonic()
            due = [r for r in service.replicas if r.state is ReplicaState.HEALTHY and now - r.last_progress >= interval]
            answers = await asyncio.gather(*(r.probe(limit) for r in due))
            for replica, alive in zip(due, answers):
                if (
                    not alive
                    and replica.state is ReplicaState.HEALTHY
                    and time.monotonic() - replica.last_progress >= limit
                ):
                    reason = f"no answer for {limit:.0f}s"
                    if options.host_pool is not None and replica.host_indices:
                        blamed = options.host_pool.blame(replica.host_indices)
                        reason += f" ({blamed})" if blamed else ""
                    replica.mark_failed(reason)
