"""Per-step metrics of the GRPO app: to metrics.jsonl (and TensorBoard), a progress bar, a plot
and a one-line summary."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.common.launch import Roles
from apps.common.roles import RoleFailed, call_role
from apps.common.step_log import StepLog

if TYPE_CHECKING:
    from apps.grpo.config import GRPOConfig

logger = logging.getLogger("forge.grpo")


class RunLog:
    """Per-step metrics: the roles' records and the step's own, reduced, to every sink."""

    def __init__(
        self, cfg: GRPOConfig, terminal: Any, resume_after: int | None = None, started: float | None = None
    ) -> None:
        """``resume_after``: the checkpoint's step when resuming; the earlier steps' rows are
        kept (and count in the summary), later ones dropped. None starts a fresh record.
        ``started``: the run's start (``time.perf_counter``), from which each row's ``wall_s`` counts."""
        from forge.observability import MetricAggregator

        self.cfg = cfg
        self.started = time.perf_counter() if started is None else started
        self.aggregator = MetricAggregator()
        self.log = StepLog(cfg, terminal, cfg.steps, resume_after, desc="grpo")
        self.metrics_path = self.log.metrics_path
        self.rows = self.log.rows  # the same list: every written row, the resumed run's first
        self.resume_after = resume_after
        self.trainer_restarts = 0
        """Dead trainers replaced so far in this run (``restarts/trainer``; ``trainer_restart.py``)."""
        self._drain: asyncio.Task | None = None

    async def step(self, step: int, metrics: dict[str, float], roles: Roles) -> None:
        """Log one step: ``metrics``, what the services recorded and each service's restarts
        and resent requests so far (``restarts/<role>``, ``retried/<role>``), to every sink.

        The services' records are drained in the background: a drain message queues behind
        the batch a replica is running (a policy's generate), and awaiting it every step added
        that wait to every step of the tiny run (``docs/benchmarks.md``). So a step's row holds the records of the
        last drain that had finished by then, and a new drain starts when none is in flight;
        the last step waits for a final drain, so no record is lost.
        """
        from forge.observability import drain_local_metrics

        final = step >= self.cfg.steps
        if self._drain is not None and (self._drain.done() or final):
            self._absorb(await self._drain)
            self._drain = None
        if final:
            self._absorb(await self._drain_services(roles))
        elif self._drain is None:
            self._drain = asyncio.create_task(self._drain_services(roles), name="drain-metrics")
        self.aggregator.extend(drain_local_metrics())
        for name, value in metrics.items():
            self.aggregator.record(name, value, "last")
        for role, svc in roles.services().items():
            totals = svc.metrics()
            self.aggregator.record(f"restarts/{role}", float(totals["restarts"]), "last")
            self.aggregator.record(f"retried/{role}", float(totals["retried"]), "last")
        self.aggregator.record("restarts/trainer", float(self.trainer_restarts), "last")
        self.aggregator.record("wall_s", time.perf_counter() - self.started, "last")  # since the run started
        row = self.aggregator.flush(step)
        self.log.write(step, row, show=("reward_mean", "loss", "step_time_s", "eval/accuracy"))

    @staticmethod
    async def _drain_services(roles: Roles) -> list[list[Any]]:
        """Every service's records. A replica that dies meanwhile loses its records (metrics,
        never groups): its service restarts it, and the run goes on."""

        async def drain(name: str, svc: Any) -> list[Any]:
            try:
                return await call_role(name, svc.drain_metrics.fanout())
            except RoleFailed as exc:
                if not exc.recoverable:
                    raise
                logger.info("metrics of %s not drained this step: %s", name, exc)
                return []

        return list(await asyncio.gather(*(drain(n, s) for n, s in roles.services().items())))

    def _absorb(self, drained: list[list[Any]]) -> None:
        for records in drained:
            for replica_records in records:
                self.aggregator.extend(replica_records)

    def close(self) -> None:
        if self._drain is not None:
            self._drain.cancel()  # the run ended early: its records are not logged
            self._drain = None
        self.log.close()

    def plot(self) -> Path | None:
        # The held-out accuracy is drawn next to the training reward.
        return self.log.plot(
            "reward_loss.png", ("reward_mean", "loss", "kl"), beside={"reward_mean": ["eval/accuracy"]}
        )

    def eval_summary(self) -> str:
        """The held-out accuracy at the first and the last evaluation, e.g. ``"held-out accuracy
        0.210 -> 0.455 (step 0 -> 200); "``; empty without evaluations."""
        evals = [r for r in self.rows if isinstance(r.get("eval/accuracy"), (int, float))]
        if not evals:
            return ""
        first, last = evals[0], evals[-1]
        return (
            f"held-out accuracy {first['eval/accuracy']:.3f} -> {last['eval/accuracy']:.3f} "
            f"(step {first.get('eval/step', 0):.0f} -> {last.get('eval/step', 0):.0f}); "
        )

    def summary(self, elapsed_s: float, startup_s: float) -> str:
        rewards = [r["reward_mean"] for r in self.rows]
        if not rewards:
            return f"grpo: no step completed in {elapsed_s:.1f}s"
        k = min(10, len(rewards))
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        resumed = f" (resumed after step {self.resume_after})" if self.resume_after is not None else ""
        return (
            f"grpo: {len(rewards)} steps{resumed} in {elapsed_s:.1f}s (startup {startup_s:.1f}s); "
            f"reward first-{k} {first:.3f} -> last-{k} {last:.3f}; final loss {self.rows[-1]['loss']:.4f}; "
            f"{self.eval_summary()}{self.uniform_groups_summary()}metrics {self.metrics_path}"
        )

    def uniform_groups_summary(self) -> str:
        """The share of groups whose rewards were all equal (they teach nothing; the mean over steps
        of ``zero_std_fraction``) and how many dynamic sampling dropped, e.g. ``"uniform groups
        31%, 40 dropped; "``; empty if no row has it (every step's groups were cut off, or the
        rows are of a run from before these metrics)."""
        fractions = [f for r in self.rows if isinstance(f := r.get("zero_std_fraction"), (int, float)) and f == f]
        if not fractions:
            return ""
        dropped = sum(r.get("dropped_uniform_groups") or 0 for r in self.rows)
        return f"uniform groups {100 * sum(fractions) / len(fractions):.0f}%, {dropped:.0f} dropped; "
