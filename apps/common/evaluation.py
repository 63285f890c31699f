"""The apps' held-out evaluation: which prompts, how they are sampled and judged, and when.

``EvalPlan`` turns an app's ``eval`` section into what ``forge.evaluation.evaluate`` needs: the
held-out prompts (formatted exactly as the training prompts), the sampling settings and the
reward that judges them. ``EvalRuns`` runs it beside training: one evaluation at a time, in
the background, its figures handed to the next logged step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apps.common.config import EvalSamplingSection, RecordsSection
from forge.actors.reward import WeightedReward
from forge.data.datasets import DataSource, load_prompts
from forge.evaluation import EvalSettings, evaluate, judged_samples
from forge.observability import EVAL_STEP
from forge.types import QUESTION, Prompt

logger = logging.getLogger("forge.eval")


def eval_source(section: EvalSamplingSection, data: RecordsSection | None) -> DataSource:
    """The held-out records' source: ``eval.data``, or the run data's files when its path is empty."""
    fields = {f.name for f in dataclasses.fields(DataSource)}
    own = {name: getattr(section.data, name) for name in fields}
    if not own["path"]:
        if data is None or not data.path:
            raise ValueError("eval.data.path is required (the run has no data.path to take it from)")
        inherited = {name: getattr(data, name) for name in fields if name != "split"}
        own = {**inherited, "split": section.data.split}
    return DataSource(**own)


@dataclass
class EvalPlan:
    """What one evaluation asks and how it judges the answers."""

    prompts: list[Prompt]
    settings: EvalSettings
    score: WeightedReward

    @classmethod
    def from_config(
        cls,
        section: EvalSamplingSection,
        data: RecordsSection | None,
        model_path: str,
        *,
        temperature: float,
        max_tokens: int,
        reward_fns: dict[str, float],
    ) -> EvalPlan:
        """Load and check the held-out prompts now (a missing file, split or key, or an empty
        split, fails before any role starts); format them as ``data`` formats training prompts."""
        from forge.data.formatting import PromptFormat

        records = load_prompts(eval_source(section, data))[: section.max_prompts]
        template = data.prompt_template if data is not None else "{text}"
        chat = data.chat_template if data is not None else True
        fmt = PromptFormat.from_model(model_path, template, chat)
        prompts = [dataclasses.replace(p, text=fmt.prompt(p.text), meta={**p.meta, QUESTION: p.text}) for p in records]
        settings = EvalSettings(
            samples=section.samples,
            temperature=section.temperature or temperature,
            max_tokens=section.max_tokens or max_tokens,
            correct_at=section.correct_at,
        )
        return cls(prompts, settings, WeightedReward(dict(section.reward) or dict(reward_fns)))

    async def run(self, policy: Any, step: int, samples_file: Path | None = None) -> dict[str, float]:
        """Evaluate the weights ``policy`` serves, which are those of training step ``step``;
        with ``samples_file``, write every sampled completion there with its reward (JSON lines,
        ``forge.evaluation.judged_samples``)."""
        groups: list | None = [] if samples_file is not None else None
        metrics = await evaluate(policy, self.prompts, self.score, self.settings, keep=groups)
        if samples_file is not None:
            lines = [json.dumps(record) for record in judged_samples(groups or [], self.score)]
            samples_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return {**metrics, EVAL_STEP: float(step)}


class EvalRuns:
    """Evaluations beside training: at most one in flight. A due one is skipped while the last
    still runs, and ``now`` (the final evaluation) supersedes one that has not been logged yet;
    both count in ``eval/skipped``. ``collect`` hands over the figures of the evaluation that
    finished since it was last called."""

    def __init__(self, plan: EvalPlan, policy: Any, every: int) -> None:
        self.plan = plan
        self.policy = policy
        self.every = every
        self.skipped = 0
        self._running: asyncio.Task | None = None
        self._done: list[dict[str, float]] = []
        self._warned = False

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    async def now(self, step: int) -> None:
        """Evaluate step ``step``'s weights and wait (the first and the last evaluation). An earlier
        evaluation not logged yet is superseded: a row holds one evaluation's figures."""
        if self._running is not None and not self._running.done():
            self._running.cancel()
            await asyncio.gather(self._running, return_exceptions=True)
            self._running = None
            self.skipped += 1
        self._reap()
        self.skipped += len(self._done)
        self._done = [await self.plan.run(self.policy, step)]

    def start(self, step: int, ready: asyncio.Task | None = None) -> None:
        """Evaluate step ``step``'s weights in the background, once ``ready`` (their push to the
        policy replicas) is done."""
        if self._running is not None and not self._running.done():
            self.skipped += 1
            return
        self._reap()

        async def run() -> dict[str, float]:
            if ready is not None:
                await asyncio.shield(ready)  # the push is the training loop's; never cancel it here
            return await self.plan.run(self.policy, step)

        self._running = asyncio.create_task(run(), name=f"eval-step-{step}")

    def collect(self, step_s: float | None = None) -> dict[str, float]:
        """The newest finished evaluation's figures (empty if none finished since the last call);
        ``step_s``, the training step's time, is what an evaluation's cost is compared with."""
        self._reap()
        if not self._done:
            return {}
        self.skipped += len(self._done) - 1  # a row holds one evaluation: the newest
        metrics = {**self._done[-1], "eval/skipped": float(self.skipped)}
        self._done.clear()
        self._warn_if_long(metrics["eval/s"], step_s)
        return metrics

    def _reap(self) -> None:
        if self._running is not None and self._running.done():
            task, self._running = self._running, None
            if not task.cancelled():
                self._done.append(task.result())  # an evaluation that failed fails the run, with its cause

    def _warn_if_long(self, eval_s: float, step_s: float | None) -> None:
        if self._warned or not step_s or eval_s <= step_s or not self.every:
            return
        self._warned = True
        share = eval_s / (eval_s + self.every * step_s)
        logger.warning(
            "one held-out evaluation (%d prompts) takes %.1fs, longer than a training step (%.1fs): at eval.every=%d "
            "it is busy about %.0f%% of the run, sharing the policy with rollouts; evaluate less often "
            "(eval.every) or fewer prompts (eval.max_prompts, eval.samples)",
            len(self.plan.prompts),
            eval_s,
            step_s,
            self.every,
            100 * share,
        )

    async def close(self) -> None:
        if self._running is not None and not self._running.done():
            self._running.cancel()
            await asyncio.gather(self._running, return_exceptions=True)
        self._running = None
