"""A GRPO run once its roles are up: resume, evaluate, roll out and train to the last step, and
outlive a dead trainer.

The GRPO app runs it once (``main.py``); a multi-adapter job runs it once per run, on the shared
policy (``apps.multi_lora.run``), so that every run of either gets checkpoints and ``--resume``,
trainer restarts, held-out evaluation and multi-turn rollouts from the same code. The caller owns
the roles (it starts and stops them), the run's ``RunResources`` (its weight sync set) and its
``RoleWatch``; everything made here (the
evaluations, the rollouts, the step log, the background tasks) is closed here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.common.evaluation import EvalPlan, EvalRuns
from apps.common.launch import Roles, RunResources, job_gone
from apps.common.roles import RoleFailed
from apps.grpo.faults import RoleWatch
from apps.grpo.rollouts import Rollouts
from apps.grpo.run_log import RunLog
from apps.grpo.trainer_restart import TrainerRestarts, trainer_died
from apps.grpo.training import resume, train

if TYPE_CHECKING:
    from apps.grpo.config import GRPOConfig

__all__ = ["TrainingRun", "eval_plan", "trainer_death"]


def eval_plan(cfg: GRPOConfig, model_path: str) -> EvalPlan | None:
    """The run's held-out evaluation (``eval`` section), or None when ``eval.every`` is 0. Made
    before any role starts: a missing or empty held-out split fails the run at once."""
    if not cfg.eval.every:
        return None
    return EvalPlan.from_config(
        cfg.eval,
        cfg.data,
        model_path,
        temperature=cfg.policy.temperature,
        max_tokens=cfg.policy.max_tokens,
        reward_fns=dict(cfg.reward.fns),
    )


@dataclass(eq=False)
class TrainingRun:
    """One run's training, once its roles are up (module docstring). ``log`` is its step log (the
    rows logged so far, after a failure too); ``summary`` says how it went."""

    cfg: GRPOConfig
    model_path: str
    roles: Roles
    resources: RunResources
    """The run's hosts, weight folder and weight sync (``resources.weights`` set before ``run``)."""
    watch: RoleWatch
    terminal: Any
    started: float = field(kw_only=True)
    """When the run started (``time.perf_counter``): rows' ``wall_s`` and the start-up count from it."""
    resume_from: Path | None = field(default=None, kw_only=True)
    plan: EvalPlan | None = field(default=None, kw_only=True)
    log: RunLog | None = field(default=None, init=False)
    startup_s: float = field(default=0.0, init=False)

    def summary(self) -> str:
        if self.log is None:
            return "grpo: no step completed"
        plot = self.log.plot()
        summary = self.log.summary(time.perf_counter() - self.started, self.startup_s)
        return summary + (f"; plot {plot}" if plot else "")

    async def run(self, watches: list[asyncio.Task] | None = None) -> None:
        """Train the roles (started, their weight sync set) from checkpoint ``resume_from`` if
        given to ``cfg.steps``; a trainer that dies is replaced from the newest checkpoint and
        training rewinds to it (``trainer_restart.py``). ``watches``: the caller's own background
        tasks (a job's watch), cancelled here with the others; the first to fail fails the run.
        Raises the run's error (``watch.error`` first: a role gone for good is the root cause)."""
        cfg, roles, watch = self.cfg, self.roles, self.watch
        weights = self.resources.weights
        if weights is None:
            raise ValueError("TrainingRun needs the run's weight sync: set resources.weights before run()")
        evals: EvalRuns | None = None
        rollouts: Rollouts | None = None
        tasks = list(watches or [])
        try:
            await watch.watch_actor("trainer", roles.trainer)
            if roles.critic is not None:
                await watch.watch_actor("critic", roles.critic)
            resume_from = self.resume_from
            step, version = (0, 0) if resume_from is None else await resume(cfg, roles, weights, resume_from)
            if self.plan is not None:  # the first evaluation: the weights training starts from
                evals = EvalRuns(self.plan, roles.policy, cfg.eval.every)
                await evals.now(step)
            self.startup_s = time.perf_counter() - self.started
            resume_after = None if resume_from is None else step
            self.log = RunLog(cfg, self.terminal, resume_after=resume_after, started=self.started)
            rollouts = Rollouts.from_config(cfg, roles, self.model_path)  # its groups: groups.py
            restarts = TrainerRestarts(cfg, self.model_path, roles, self.resources, watch)
            tasks += [asyncio.create_task(watch.watch_services(roles.services()), name="service-watch")]
            tasks += rollouts.start()
            while True:  # once, plus once more after each dead trainer is replaced (trainer_restart.py)
                loop = train(cfg, roles, weights, rollouts, self.log, step, version, evals)
                training = asyncio.create_task(loop, name="train")
                watcher = asyncio.create_task(watch.failed.wait(), name="failure-watch")
                tasks += [training, watcher]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                gone = await job_gone(self.resources)  # a dead job's roles die too: the job is the cause, not them
                if gone is not None:
                    raise gone
                died = trainer_death(watch, training)
                if died is None:
                    break
                for task in (training, watcher):
                    task.cancel()
                    tasks.remove(task)
                await asyncio.gather(training, watcher, return_exceptions=True)
                step, version = await restarts.restart(died)
                self.log.close()
                # The steps after the checkpoint are logged again.
                self.log = RunLog(cfg, self.terminal, resume_after=step, started=self.started)
                self.log.trainer_restarts = restarts.restarts
            if watch.error is not None:
                raise watch.error
            for task in done:
                task.result()  # the training loop's error, or a rollout worker's (they never return)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if evals is not None:
                await evals.close()
            if rollouts is not None:
                await rollouts.close()
            if self.log is not None:
                self.log.close()


def trainer_death(watch: RoleWatch, training: asyncio.Task) -> RoleFailed | None:
    """The trainer's process death that stopped ``training`` or that ``watch`` saw, if that is
    what happened (``trainer_died``); None for anything else (the run ends or fails as it is)."""
    if watch.error is not None:
        return watch.error if trainer_died(watch.error) else None
    if training.done() and not training.cancelled():
        error = training.exception()
        if error is not None and trainer_died(error):
            return error
    return None
