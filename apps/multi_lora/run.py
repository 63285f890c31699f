"""One run of a multi-adapter job: the GRPO app's rollouts and step loop, on the shared policy.

A run owns its trainer, reward service, buffer and dataset, started as the GRPO app starts them
(``apps.grpo.roles``), and borrows the policy service through an ``AdapterView``. It ends on its
own: its steps done, or its first failure (a reward that raises, a trainer that died, a role that
will not start). Either way its roles stop and its adapter is evicted from every policy replica,
and the other runs go on; ``run_one`` never raises, it returns the run's ``RunResult``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from apps.grpo.roles import Roles, fault_options, role_specs, start_all, start_local, start_role
from apps.grpo.rollouts import Rollouts
from apps.grpo.run_log import RunLog
from apps.grpo.training import train
from apps.multi_lora.adapters import AdapterView, AdapterWeights, SharedAdapters
from apps.multi_lora.config import RunConfig
from forge.controller.errors import describe

__all__ = ["RunResult", "RunRoles", "run_one"]

logger = logging.getLogger("forge.multi_lora")

RUN_ROLES = ("reward", "trainer")
"""The roles each run starts on processes of its own (the reference is the trainer's base)."""


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


async def run_one(run: RunConfig, adapters: SharedAdapters, model_path: str, terminal: Any) -> RunResult:
    """Train one run to its end on the shared policy; its failure is returned, not raised."""
    cfg = run.grpo
    t0 = time.perf_counter()
    roles = RunRoles()
    log: RunLog | None = None
    rollouts: Rollouts | None = None
    tasks: list[asyncio.Task] = []
    result = RunResult(run.name, ok=False, steps=0, seconds=0.0)
    try:
        await adapters.add(run.name)
        roles.policy = AdapterView(adapters.policy, run.name, cfg.faults.health_timeout_s)
        await start_run_roles(run, model_path, roles)
        roles.weights = AdapterWeights(roles.trainer, adapters, run.name, cfg.faults.health_timeout_s)
        log = RunLog(cfg, terminal, started=t0)
        rollouts = Rollouts.from_config(cfg, roles)
        tasks = [*rollouts.start(), asyncio.create_task(train(cfg, roles, rollouts, log), name=f"train-{run.name}")]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # the step loop's error, or a rollout worker's (they never return)
        log.close()
        result.ok = True
        result.summary = log.summary(time.perf_counter() - t0, 0.0)
    except Exception as exc:
        result.error = describe(exc, limit=600, typed=True)
        logger.warning("run %s failed; the other runs go on: %s", run.name, result.error)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if rollouts is not None:
            await rollouts.close()
        if log is not None:
            log.close()
            result.steps = len(log.rows)
        result.evicted_from = await adapters.retire(run.name)
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
