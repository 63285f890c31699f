"""A GRPO run outlives its trainer (and PPO's critic): a dead trainer or critic mesh is replaced,
and training rewinds to the newest checkpoint, both meshes to its step.

The trainer's state (weights, optimizer moments, RNG) lives only in its processes; a checkpoint
(``trainer.checkpoint_every``) is the only copy outside them. So when the trainer's process, or
one rank's of a ``trainer.procs`` mesh, dies, or hangs (a call to it unanswered past
``faults.health_timeout_s``):

1. the whole mesh is stopped, its processes on this host killed (a rank cannot rejoin its
   process group alone, and a hung one never stops by itself);
2. a new mesh of the same shape starts, as the run started it (``roles.start_role``), or on
   fewer hosts when hosts were lost and ``trainer.min_hosts`` allows it;
3. it loads the newest complete checkpoint (resharded if need be); the step counter rewinds to
   its step, and every step after it is trained again and logged once (the run's log rewinds
   too, as on ``--resume``);
4. every policy replica loads that checkpoint's weights, at its version; what the trainer holds
   and what each replica serves then, measured where they live (the trainer's weights
   fingerprint; the logprobs of a probe each replica samples against the trainer's of the same
   tokens), are in the next step's row (``weight_sync/restore/*``).

The rollout side never stops: the policy, reference and reward services go on filling the buffer
while the trainer is replaced. Groups sampled by versions newer than the restored one (the dead
trainer's last pushes) train under the usual ``max_policy_age`` rules; the buffer and the
rollouts keep counting every group. The dataset is not rewound: the prompts after the
checkpoint are not drawn again.

A trainer that raises from its own code (a bug, a bad batch) is not restarted: the same step
would fail again. Past ``faults.trainer_max_restarts`` deaths, or without a checkpoint, the run
stops with a message naming every death and how to continue.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from apps.common.launch import Roles, RunResources, assign_gpus, start_role
from apps.common.roles import RUN_ENV, RoleFailed
from apps.grpo.faults import RoleWatch, mesh_call, resume_hint, role_processes
from apps.grpo.roles import role_specs
from forge.checkpoint import latest_checkpoint
from forge.controller import ForgeActor, ReplicaFailed, RequestTimeout
from forge.controller.errors import describe
from forge.controller.hosts import NotEnoughHosts
from forge.observability import record_metric

if TYPE_CHECKING:
    from apps.common.weights import PolicyWeights
    from apps.grpo.config import GRPOConfig

logger = logging.getLogger("forge.grpo")

STOP_TIMEOUT_S = 30.0
"""Longest the dead mesh's stop may take before the new one starts anyway (its processes are
reaped at exit)."""
PROBE_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
"""Token ids each policy replica samples from after a restore, for the trainer to score the same
tokens: any ids of any vocabulary; the logprobs, not the text, are compared."""
LOST_HOST_STOP_TIMEOUT_S = 5.0
"""The same when a host of the pool is lost: its ranks cannot answer, the live ones stop at once."""


TRAINING_ROLES = ("trainer", "critic")
"""The meshes whose state only checkpoints hold: the trainer and PPO's critic."""


def trainer_died(failure: BaseException) -> bool:
    """Whether ``failure`` is the trainer's (or PPO's critic's) process dying, or hanging (a call
    unanswered past ``faults.health_timeout_s``): restartable, unlike its own code failing."""
    return (
        isinstance(failure, RoleFailed)
        and failure.role in TRAINING_ROLES
        and isinstance(failure.error, (ReplicaFailed, RequestTimeout))
    )


def _named(failure: RoleFailed) -> str:
    """A death's detail, prefixed with its role when it is not the trainer's."""
    return failure.detail if failure.role == "trainer" else f"{failure.role}: {failure.detail}"


class TrainerRestarts:
    """Replaces a dead trainer from the newest checkpoint, up to ``faults.trainer_max_restarts`` times."""

    def __init__(
        self, cfg: GRPOConfig, model_path: str, roles: Roles, resources: RunResources, watch: RoleWatch
    ) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.roles = roles
        self.resources = resources
        """The run's hosts (a new trainer starts on them), weight folder and weight sync."""
        self.watch = watch
        self.limit = cfg.faults.trainer_restarts(cfg.trainer.checkpoint_every)
        self.deaths: list[str] = []
        """What each death of the trainer was, in order (the final message names them all)."""
        self.restarts = 0
        """New trainer meshes started (``restarts/trainer``); a death while restoring counts too."""

    @property
    def weights(self) -> PolicyWeights:
        """The run's weight sync, which the new trainer's weights reach the policy through."""
        if self.resources.weights is None:
            raise ValueError("TrainerRestarts needs the run's weight sync: set resources.weights first")
        return self.resources.weights

    def give_up(self, role: str = "trainer") -> RoleFailed:
        """The error that stops the run: every death of the trainer (or critic), and how to continue."""
        deaths = "; ".join(f"death {i + 1}: {d}" for i, d in enumerate(self.deaths))
        return RoleFailed(role, f"{deaths}; the run stopped: {resume_hint(self.cfg)}")

    async def restart(self, failure: RoleFailed) -> tuple[int, int]:
        """Replace the trainer after ``failure`` (``trainer_died``); returns (step, policy version)
        of the checkpoint training goes on from. Raises the run's final ``RoleFailed`` when no
        restart is left, there is no checkpoint, or the new trainer dies while it restores."""
        lost = self._lost_hosts()
        detail = _named(failure)
        self.deaths.append(f"{detail} (hosts lost: {', '.join(lost)})" if lost else detail)
        while True:
            path = latest_checkpoint(self.cfg.checkpoint_dir)
            if len(self.deaths) > self.limit or path is None:
                self.watch.retire(failure.role)  # this error, naming every death, is the run's
                raise self.give_up(failure.role)
            logger.warning(
                "the %s died or hung (%s); replacing it from %s (restart %d of %d)",
                failure.role,
                self.deaths[-1],
                path.name,
                len(self.deaths),
                self.limit,
            )
            t0 = time.perf_counter()
            self.restarts += 1
            try:
                step, version = await self._replace(str(path), failure.role)
            except RoleFailed as again:
                if not trainer_died(again):
                    raise
                failure = again
                self.deaths.append(f"{_named(again)} (while restoring {path.name})")
                continue
            logger.warning(
                "the %s is back at step %d (policy version %d) after %.1fs; steps after it are trained again",
                failure.role,
                step,
                version,
                time.perf_counter() - t0,
            )
            return step, version

    async def _replace(self, checkpoint: str, dead: str = "trainer") -> tuple[int, int]:
        """Stop the ``dead`` mesh (the trainer or the critic), start a new one, rewind both to
        ``checkpoint`` (the critic to its checkpoint of that step), push its weights to the policy."""
        roles, cfg, weights = self.roles, self.cfg, self.weights
        await self._stop_dead(dead)
        if dead == "critic":
            roles.critic = await self._start_critic()
            await self.watch.watch_actor("critic", roles.critic)
        else:
            trainer = await self._start()
            roles.trainer = trainer
            weights.use_trainer(trainer)
            await self.watch.watch_actor("trainer", trainer)
        step, version, _ = await mesh_call(cfg, "trainer", roles.trainer.load_checkpoint, checkpoint)
        if roles.critic is not None:  # both meshes at the checkpoint's step, as on --resume
            from apps.grpo.ppo import load_critic

            await load_critic(cfg, roles, Path(checkpoint))
        before = await self._policy_call(weights.served_versions())
        await weights.sync()
        await self._report_served(max(before or [0]), version)
        return step, version

    async def _stop_dead(self, role: str) -> None:
        """Kill ``role``'s processes on this host (a hung, stopped rank never stops by itself) and
        stop its mesh, without waiting long for ranks that cannot answer."""
        cfg = self.cfg
        old = getattr(self.roles, role)
        self.watch.retire(role)
        run = cfg.trainer.env.get(RUN_ENV)  # a multi-adapter job's run: its own trainer's processes only
        for process in role_processes(os.getpid(), role, run):
            with contextlib.suppress(psutil.Error):
                process.kill()
        lost = self._lost_hosts()
        if old is not None:
            try:
                # A lost host's ranks never answer the stop: only the live ones' is waited for.
                await ForgeActor.shutdown(old, timeout_s=LOST_HOST_STOP_TIMEOUT_S if lost else STOP_TIMEOUT_S)
            except Exception as exc:  # a dead rank's mesh may not stop cleanly: its processes are reaped at exit
                logger.info("the dead %s's mesh did not stop cleanly: %s", role, exc)

    async def _start_critic(self) -> ForgeActor:
        """A new critic mesh, as the run started it."""
        (spec,) = [s for s in role_specs(self.cfg, self.model_path, self.resources.weights_dir) if s.name == "critic"]
        try:
            return await start_role(spec, self.cfg, assign_gpus(self.cfg), self.resources.host_pool)
        except Exception as exc:  # as for the trainer's: a death while restoring
            died = ReplicaFailed(f"the new critic mesh failed to start: {describe(exc, limit=600, typed=True)}")
            raise RoleFailed("critic", died) from exc

    @staticmethod
    async def _policy_call(call: Any) -> Any:
        """A report's call to the policy replicas; None if none answers (they are restarting: each
        resyncs before it serves), which leaves the report out and the restore going on."""
        try:
            return await call
        except RoleFailed as exc:
            if not exc.recoverable:
                raise
            logger.info("the policy replicas could not report their weights after the restore: %s", exc)
            return None

    async def _report_served(self, rolled_back_from: int, version: int) -> None:
        """Record what the restored trainer holds and what every policy replica serves after the
        resync, each measured where it lives, in the next step's row (``weight_sync/restore/*``):
        the trainer's ``weights_fingerprint``; each replica's version and the largest difference
        between the logprobs of a probe it sampled and the trainer's of the same tokens (near 0:
        it serves the trainer's weights). ``rolled_back_from``: the newest version a replica
        served before (the dead trainer's). A replica at another version is named in a warning."""
        cfg, roles = self.cfg, self.roles
        record_metric("weight_sync/restore/rolled_back_from", rolled_back_from, "last")
        fingerprint = await mesh_call(cfg, "trainer", roles.trainer.weights_fingerprint)
        for name, value in zip(("sum", "sumsq"), fingerprint):
            record_metric(f"weight_sync/restore/trainer_{name}", value, "last")
        samples = await self._policy_call(self.weights.probes(PROBE_PROMPT))
        if not samples:
            return
        pairs = [(PROBE_PROMPT, tokens) for _, tokens, _ in samples]
        scored = await mesh_call(cfg, "trainer", roles.trainer.probe_logprobs, pairs)
        for i, ((served, _, got), want) in enumerate(zip(samples, scored)):
            gap = max((abs(g - w) for g, w in zip(got, want)), default=float("nan"))  # nan: no token sampled
            record_metric(f"weight_sync/restore/policy{i}_version", served, "last")
            record_metric(f"weight_sync/restore/policy{i}_logprob_gap", gap, "last")
            if served != version:
                logger.warning("policy replica %d serves version %d after the restore, not %d", i, served, version)

    def _lost_hosts(self) -> list[str]:
        """The pool's hosts whose worker stopped answering, now marked dead (each named in a warning)."""
        pool = self.resources.host_pool
        if pool is None:
            return []
        pool.mark_unreachable()
        return [pool.describe(i) for i in sorted(pool.dead)]

    async def _start(self) -> ForgeActor:
        """A new trainer mesh: of the run's shape, or on fewer hosts when hosts were lost and
        ``trainer.min_hosts`` allows it (the largest count the live hosts hold, whose ranks split
        the step equally)."""
        cfg = self.cfg
        (spec,) = [s for s in role_specs(cfg, self.model_path, self.resources.weights_dir) if s.name == "trainer"]
        wanted, fewest = cfg.trainer.hosts, cfg.trainer.min_hosts or cfg.trainer.hosts
        episodes = cfg.prompts_per_step * cfg.group_size
        counts = [h for h in range(wanted, fewest - 1, -1) if episodes % (h * cfg.trainer.procs) == 0]
        for hosts in counts:
            try:
                trainer = await start_role(spec, cfg, assign_gpus(cfg), self.resources.host_pool, hosts=hosts)
                break
            except NotEnoughHosts as exc:
                if hosts == counts[-1]:
                    hint = "" if fewest < wanted else "; set trainer.min_hosts to let it restart on fewer hosts"
                    raise RoleFailed("trainer", f"{exc}{hint}") from exc
            except Exception as exc:
                # A process of the new mesh that dies while it starts (killed as the last one was,
                # or its host's) is a death while restoring: the next restart, if any is left,
                # may come up. The same spec started the run, so a start cannot fail for good here.
                died = ReplicaFailed(f"the new trainer mesh failed to start: {describe(exc, limit=600, typed=True)}")
                raise RoleFailed("trainer", died) from exc
        if hosts < wanted:
            logger.warning(
                "the trainer restarts on %d host(s) instead of %d (trainer.min_hosts=%d): the checkpoint reshards "
                "to %d ranks",
                hosts,
                wanted,
                fewest,
                hosts * cfg.trainer.procs,
            )
        return trainer
