"""One run of a multi-adapter job: the GRPO app's training of a started run, on the shared policy.

A run owns its trainer, reward service (or environment service, multi-turn), buffer and dataset,
started as the GRPO app starts them (``apps.grpo.roles``), and borrows the policy service
through an ``AdapterView``. It trains as a GRPO run does (``apps.grpo.run_loop``): held-out
evaluation, checkpoints and ``--resume``, a dead trainer replaced from its newest checkpoint. It
ends on its own: its steps done, or its first failure (a reward that raises, a trainer that died
past its restarts, a role that will not start). Either way its roles stop and its adapter is
evicted from every policy replica, and the other runs go on; ``run_one`` never raises, it
returns the run's ``RunResult``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apps.common.launch import Roles, RunResources, start_all, start_role
from apps.common.roles import RoleFailed
from apps.grpo.faults import RoleWatch, resume_hint
from apps.grpo.roles import fault_options, role_specs, start_local
from apps.grpo.run_loop import TrainingRun, eval_plan
from apps.multi_lora.adapters import AdapterView, AdapterWeights, SharedAdapters
from apps.multi_lora.config import RunConfig
from forge.controller.errors import describe

__all__ = ["RunResult", "RunRoles", "run_one"]

logger = logging.getLogger("forge.multi_lora")

RUN_ROLES = ("reward", "trainer", "env")
"""The roles each run starts on processes of its own (the reference is the trainer's base; the
environment service only for a multi-turn run)."""


class RunRoles(Roles):
    """A run's roles: ``policy`` is its view of the shared service, not a service it owns, so it is
    neither drained for the run's metrics nor stopped with the run (``services``)."""

    def services(self) -> dict[str, Any]:
        return {n: s for n, s in super().services().items() if n != "policy"}


@dataclass
class RunResult:
    """How one run ended."""

    name: str
    ok: bool
    steps: int
    """Steps logged (``metrics.jsonl`` rows)."""
    seconds: float
    error: str = ""
    summary: str = ""
    evicted_from: int = 0
    """Policy replicas that held its adapter in vLLM when it ended (it was evicted from them)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def run_one(
    run: RunConfig, adapters: SharedAdapters, model_path: str, terminal: Any, resume_from: Path | None = None
) -> RunResult:
    """Train one run to its end on the shared policy (from checkpoint ``resume_from`` if given),
    as the GRPO app trains (``apps.grpo.run_loop``: evaluation, checkpoints, trainer restarts,
    multi-turn); its failure is returned, not raised."""
    from forge.controller.provisioner import add_fault_listener

    cfg = run.grpo
    t0 = time.perf_counter()
    roles = RunRoles()
    watch = RoleWatch(cfg)
    add_fault_listener(watch)  # this run's trainer: the watch knows its mesh by name
    training: TrainingRun | None = None
    result = RunResult(run.name, ok=False, steps=0, seconds=0.0)
    try:
        plan = eval_plan(cfg, model_path)  # its held-out prompts, checked before its roles start
        await adapters.add(run.name)
        roles.policy = AdapterView(adapters.policy, run.name, cfg.faults.health_timeout_s)
        await start_run_roles(run, model_path, roles)
        # Its own processes, no hosts' job or weight folder: its adapter reaches the shared policy by message.
        resources = RunResources(weights=AdapterWeights(roles.trainer, adapters, run.name, cfg.faults.health_timeout_s))
        training = TrainingRun(
            cfg, model_path, roles, resources, watch, terminal, started=t0, resume_from=resume_from, plan=plan
        )
        await training.run()
        result.ok = True
        result.summary = training.summary()
    except Exception as exc:
        root = watch.error if watch.error is not None else exc  # a role gone for good is the root cause
        result.error = describe(root, limit=600, typed=True)
        if isinstance(root, RoleFailed) and root.role == "trainer" and "the run stopped:" not in root.detail:
            result.error += f"; the run stopped: {resume_hint(cfg)}"
        logger.warning("run %s failed; the other runs go on: %s", run.name, result.error)
    finally:
        if training is not None and training.log is not None:
            result.steps = len(training.log.rows)
        result.evicted_from = await adapters.retire(run.name)
        watch.stopping = True  # stays installed: late reports of this run's stopped processes are silenced
        await roles.stop()
        result.seconds = time.perf_counter() - t0
    return result


async def start_run_roles(run: RunConfig, model_path: str, roles: RunRoles) -> None:
    """The run's reward service and trainer (the GRPO app's specs) and its buffer and dataset."""
    cfg = run.grpo
    specs = [s for s in role_specs(cfg, model_path) if s.name in RUN_ROLES]
    starts: dict[str, Any] = {
        spec.name: start_role(spec, cfg, {}, None, **(fault_options(cfg) if spec.service else {})) for spec in specs
    }
    starts["local"] = start_local(cfg, model_path, roles)
    await start_all(roles, starts)
