"""When a GRPO run gives up on a role, and what it says then.

The rollout side (the policy, reference and reward services) heals itself: forge's service
layer restarts a dead or hung replica with backoff, resyncs it (the policy loads the current
weights) before it takes traffic, and resends the requests it never answered. The run gives up
on such a role only when

- one of its replicas died again after using up its restarts (``faults.max_restarts``), or
- it has had no healthy replica for longer than ``faults.max_unhealthy_s``.

The trainer's optimizer state lives only in its processes, so a dead trainer is replaced from
the newest checkpoint (``trainer_restart.py``, up to ``faults.trainer_max_restarts`` times); past
that, or without a checkpoint, its death stops the run and the message says how to continue it.

A role is known by its own handle: each service reports its replicas' states, and the trainer's
process death is matched by the exact name of the trainer's actor mesh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from apps.common.roles import RoleFailed, call_role
from forge.checkpoint import latest_checkpoint
from forge.controller import ReplicaFailed, ReplicaState

if TYPE_CHECKING:
    from apps.grpo.config import GRPOConfig

logger = logging.getLogger("forge.grpo")


def service_gave_up(
    replicas: Sequence[Any], max_restarts: int, unhealthy_s: float, max_unhealthy_s: float
) -> str | None:
    """Why the run must give up on a service role (None: it may still heal).

    ``replicas``: the service's replicas (``state``, ``restarts``, ``replica_id``, ``failure``);
    ``unhealthy_s``: how long the role has had no healthy replica (0 while it has one).
    """
    for r in replicas:
        # A FAILED replica with its restarts used up is left failed by the service for good.
        if r.state is ReplicaState.FAILED and r.restarts >= max_restarts:
            if max_restarts == 0:
                return (
                    f"replica {r.replica_id} failed ({r.failure}) and faults.max_restarts=0 allows no restart; "
                    "raise faults.max_restarts to let the run restart it"
                )
            return (
                f"replica {r.replica_id} failed again ({r.failure}) after {r.restarts} restarts, all that "
                f"faults.max_restarts={max_restarts} allows"
            )
    if unhealthy_s > max_unhealthy_s:
        states = ", ".join(f"r{r.replica_id} {r.state.value}" for r in replicas)
        return (
            f"no healthy replica for {unhealthy_s:.0f}s (faults.max_unhealthy_s={max_unhealthy_s:g}); "
            f"replicas: {states}"
        )
    return None


async def mesh_call(cfg: GRPOConfig, role: str, endpoint: Any, *args: Any) -> Any:
    """A call to every rank of ``role``'s SPMD mesh (the trainer, PPO's critic) that fails as a hang
    (``RequestTimeout``) past ``faults.health_timeout_s``: a stopped rank never answers, and the run
    replaces the mesh as it replaces one that died (``trainer_restart.py``). Keep it above the
    longest step."""
    from forge.distributed import call_spmd

    return await call_role(role, call_spmd(endpoint, *args, timeout_s=cfg.faults.health_timeout_s))


def resume_hint(cfg: GRPOConfig) -> str:
    """How to continue a run whose trainer died: from its newest checkpoint, if there is one."""
    found = latest_checkpoint(cfg.checkpoint_dir)
    if found is not None:
        return f"continue from its newest checkpoint ({found.name}) with the same command plus --resume"
    if cfg.trainer.checkpoint_every:
        return (
            f"no checkpoint was written yet (every {cfg.trainer.checkpoint_every} steps), so it cannot be "
            "resumed: run it again"
        )
    return (
        "no checkpoint was written (trainer.checkpoint_every=0); set trainer.checkpoint_every=N to make a run resumable"
    )


class RoleWatch:
    """Ends the run (``failed`` is set, ``error`` says why) when a role is gone for good.

    It is also Monarch's fault listener for the actors it watches (``watch_actor``): a process
    that dies while nobody calls it, e.g. the trainer while the controller waits for rollouts,
    is then noticed at once rather than at its next call.
    """

    def __init__(self, cfg: GRPOConfig, poll_s: float = 0.5) -> None:
        self.cfg = cfg
        self.poll_s = poll_s
        self.loop = asyncio.get_running_loop()
        self.failed = asyncio.Event()
        self.error: RoleFailed | None = None
        self.stopping = False
        self._actor_meshes: dict[str, str] = {}  # the exact mesh name of each watched actor -> its role
        self._retired: set[str] = set()  # meshes replaced after their death: later reports are expected

    async def watch_actor(self, role: str, actor: Any) -> None:
        """Watch ``actor`` (an actor mesh from ``as_actor``) for process death."""
        # Monarch gives an actor mesh's full name (the name a failure reports) as a future.
        name = getattr(actor, "_name", None)
        if name is None:
            logger.warning("cannot watch %s for process death (no mesh name); its next call will fail instead", role)
            return
        self._actor_meshes[str(await asyncio.wait_for(name, 30.0))] = role

    def retire(self, role: str) -> None:
        """``role``'s actor was replaced: forget its meshes (late reports of their processes are
        silenced) and the failure it caused, so the run watches the new one."""
        for mesh in [m for m, r in self._actor_meshes.items() if r == role]:
            del self._actor_meshes[mesh]
            self._retired.add(mesh)
        if self.error is not None and self.error.role == role:
            self.error = None
            self.failed.clear()

    def fail(self, error: RoleFailed) -> None:
        """The first failure wins: it is the root cause of what follows."""
        if self.error is None:
            self.error = error
            self.failed.set()

    def __call__(self, failure: Any) -> bool:
        """Monarch's fault hook (on Monarch's thread); services see their own replicas' failures."""
        if self.stopping:
            return True  # processes killed at shutdown (past their exit timeout) are expected
        mesh = str(getattr(failure, "mesh_name", ""))
        if mesh in self._retired:
            return True
        role = self._actor_meshes.get(mesh)
        if role is None:
            return False
        self.loop.call_soon_threadsafe(self._mesh_died, mesh, role)
        return True

    def _mesh_died(self, mesh: str, role: str) -> None:
        """On the loop: a report that raced the mesh's replacement (``retire``) is dropped there."""
        if mesh in self._retired:
            return
        died = ReplicaFailed(f"its process died (mesh {mesh})")  # as a call to it would have failed
        self.fail(RoleFailed(role, died))

    async def watch_services(self, services: dict[str, Any]) -> None:
        """Poll each service's replicas until one role is gone for good (``fail``); forever otherwise."""
        f = self.cfg.faults
        healthy_at = {role: time.monotonic() for role in services}
        while True:
            await asyncio.sleep(self.poll_s)
            now = time.monotonic()
            for role, handle in services.items():
                replicas = handle.service.replicas
                if any(r.state is ReplicaState.HEALTHY for r in replicas):
                    healthy_at[role] = now
                why = service_gave_up(replicas, f.max_restarts, now - healthy_at[role], f.max_unhealthy_s)
                if why is not None:
                    self.fail(RoleFailed(role, why))
                    return


def role_processes(app_pid: int, role: str, run: str | None = None) -> list[Any]:
    """The processes of ``role`` (psutil ``Process`` objects) under the app process ``app_pid``:
    the replica processes themselves, not their own children (e.g. a vLLM helper). ``run``: only
    those of that run of a multi-adapter job (``RUN_ENV``)."""
    import psutil

    from apps.common.roles import ROLE_ENV, RUN_ENV

    found = []
    for child in psutil.Process(app_pid).children(recursive=True):
        try:
            env = child.environ()
            if run is not None and env.get(RUN_ENV) != run:
                continue
            if env.get(ROLE_ENV) == role and child.parent().environ().get(ROLE_ENV) != role:
                found.append(child)
        except psutil.Error:  # exited meanwhile, or not ours to read
            continue
    return found
