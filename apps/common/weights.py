"""Trainer -> policy weight sync, owned by one object: what the replicas serve, and how they get it.

``PolicyWeights`` holds the weights every policy replica should serve (``served``) and is the
only writer of it:

- ``fetch`` takes the trainer's current weights, as the transport carries them (``file``: the
  path of a safetensors file the trainer wrote; ``message``: the tensors);
- ``push`` makes them ``served`` first, then loads them into every healthy replica, so a
  replica that is restarting meanwhile loads them in ``resync``;
- ``resync`` is the policy service's resync hook (``svc.set_resync(weights.resync)``): a
  restarted replica loads the served weights before it takes traffic.

A push reaches every healthy replica at once, or, with ``max_updating`` (``weight_sync.mode:
rolling``), at most that many replicas at a time while the others go on serving the previous
version; each replica's version is recorded in the service as its load returns, so a
``NewestVersion`` router sends new groups to the replicas already on the newest one.

A replica that dies while loading does not fail a push: it restarts and resyncs, and the push
waits only for the replicas that are alive.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from apps.common.roles import RoleFailed, call_role
from forge.distributed import call_spmd  # the trainer is one SPMD mesh: every rank gets each call

__all__ = ["PolicyWeights", "ServedWeights"]


@dataclass(frozen=True)
class ServedWeights:
    """Weights the policy replicas serve: a state dict or a safetensors path (None: the model's
    own, version 0)."""

    weights: Any = None
    version: int = 0


class PolicyWeights:
    """The weight sync between one trainer (an SPMD actor mesh) and one policy service."""

    def __init__(
        self,
        trainer: Any,
        policy: Any,
        transport: str,
        folder: str,
        resync_timeout_s: float,
        fetch_timeout_s: float | None = None,
        max_updating: int | None = None,
    ) -> None:
        if transport not in ("file", "message"):
            raise ValueError(f"weight_sync.transport must be 'file' or 'message', got {transport!r}")
        self.trainer = trainer
        self.policy = policy
        self.transport = transport
        self.folder = folder
        self.resync_timeout_s = resync_timeout_s
        self.fetch_timeout_s = fetch_timeout_s
        """Longest a fetch from the trainer may take (None: no bound): past it the trainer is hung."""
        self.max_updating = max_updating
        """Rolling pushes: at most this many replicas load at once (None: all of them together)."""
        self.served = ServedWeights()

    def use_trainer(self, trainer: Any) -> None:
        """Fetch from ``trainer`` from now on: the mesh that replaced a dead one."""
        self.trainer = trainer

    async def fetch(self) -> tuple[Any, int]:
        """The trainer's current weights, as the transport carries them, and their version."""
        if self.transport == "file":
            fetch = call_spmd(self.trainer.publish_weights, self.folder, timeout_s=self.fetch_timeout_s)
        else:
            fetch = call_spmd(self.trainer.weights, timeout_s=self.fetch_timeout_s)
        return await call_role("trainer", fetch)

    async def push(self, weights: Any, version: int) -> int:
        """Serve ``weights`` (from ``fetch``) on every healthy policy replica; returns ``version``."""
        from forge.observability import record_metric

        t0 = time.perf_counter()
        self.served = ServedWeights(weights, version)
        if self.max_updating is not None:
            await self._roll(weights, version)
        else:
            live = list(self._service().healthy_replicas())
            try:
                await call_role("policy", self.policy.update_weights.fanout(weights, version))
            except RoleFailed as exc:
                if not exc.recoverable:
                    raise
                record_metric("weight_sync/interrupted", 1, "sum")
                await self._loads_finished(exc)
            self._record(live, version)
        record_metric("weight_sync/push_s", time.perf_counter() - t0)
        return version

    async def _roll(self, weights: Any, version: int) -> None:
        """Load ``version`` into the healthy replicas ``max_updating`` at a time, the others
        serving on; a replica that dies meanwhile restarts and resyncs to the served version."""
        from forge.observability import record_metric

        service = self._service()
        replicas = list(service.healthy_replicas())
        wave = max(1, self.max_updating)
        for start in range(0, len(replicas), wave):
            group = [r for r in replicas[start : start + wave] if r.accepting]
            for replica in group:  # new work goes to the others while these load
                service.record_updating(replica)
            loads = [r.actor_mesh.update_weights.call(weights, version) for r in group]
            try:
                results = await asyncio.gather(
                    *(asyncio.wait_for(load, self.resync_timeout_s) for load in loads), return_exceptions=True
                )
            finally:
                for replica in group:
                    service.record_updating(replica, False)
            for replica, result in zip(group, results):
                if isinstance(result, BaseException):  # died or hung mid-load: its restart resyncs it
                    record_metric("weight_sync/interrupted", 1, "sum")
                    if replica.accepting:  # alive but failing: a bad update, not a death
                        raise RoleFailed("policy", self._refused(version, replica, replicas, result))
                    continue
                self._record([replica], version)

    @staticmethod
    def _refused(version: int, replica: Any, replicas: list[Any], error: BaseException) -> str:
        """Why a roll stopped: the version a live replica refused, and what each replica serves
        now (a replica refuses an update before loading any of it, so it serves its old one; a
        replica with no version recorded serves the weights it started with, version 0)."""
        from forge.describe import describe

        serving = [0 if r.version is None else r.version for r in replicas]
        return (
            f"weights version {version} refused by replica {replica.replica_id} ({describe(error, limit=400)}); "
            f"the rolling update stopped there: the replicas serve {serving}"
        )

    def _service(self) -> Any:
        """The policy's ``Service`` (the handle's own)."""
        return self.policy.service

    def _record(self, replicas: list[Any], version: int) -> None:
        """These replicas serve ``version`` now (what version-aware routing reads)."""
        service = self._service()
        for replica in replicas:
            if replica.accepting:
                service.record_version(replica, version)

    async def sync(self) -> int:
        """Fetch and push the trainer's weights, and wait; returns their version."""
        return await self.push(*(await self.fetch()))

    async def served_versions(self) -> list[int]:
        """The version each policy replica serves now, as each reports it."""
        return await call_role("policy", self.policy.version.fanout())

    async def probes(self, prompt_ids: list[int]) -> list[tuple[int, list[int], list[float]]]:
        """One sample of ``prompt_ids`` from every policy replica: the version it serves, the
        tokens and their logprobs, for the trainer to score the same tokens (``Policy.probe``)."""
        return await call_role("policy", self.policy.probe.fanout(prompt_ids))

    async def resync(self, actor_mesh: Any) -> int:
        """A restarted policy replica's step before it takes traffic: load the served weights.

        If a new version is pushed while it loads (the push skips replicas that are not healthy
        yet), it loads that one too, so it rejoins at the current version. Returns the version
        loaded (the service records it as the replica's).
        """
        from forge.observability import record_metric

        loaded = 0  # a fresh engine serves the model's own weights, version 0
        for _ in range(5):
            served = self.served
            if served.weights is None or served.version == loaded:
                return loaded
            load = actor_mesh.update_weights.call(served.weights, served.version)
            await asyncio.wait_for(load, self.resync_timeout_s)
            loaded = served.version
            record_metric("weight_sync/resyncs", 1, "sum")
            record_metric("weight_sync/resync_version", loaded, "last")
        return loaded

    async def _loads_finished(self, interrupted: RoleFailed, tries: int = 5) -> None:
        """Wait until the live policy replicas have run their weight loads of an interrupted push.

        The gather of the interrupted fanout gave up at the first dead replica, but the other
        replicas' loads still run; a replica handles one message at a time, so a ``version`` call
        answered by each live replica comes after its load.
        """
        from forge.controller import NoHealthyReplica

        for _ in range(tries):
            try:
                await call_role("policy", self.policy.version.fanout())
                return
            except RoleFailed as exc:
                if not exc.recoverable or isinstance(exc.error, NoHealthyReplica):
                    return  # none is alive: each one resyncs as it comes back
                interrupted = exc  # another replica died meanwhile: ask the live ones again
        raise interrupted
