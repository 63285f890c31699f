"""The run of a preference app (``apps.rm``, ``apps.dpo``): pairs in, one trainer step per batch.

Both apps train on preference pairs (``forge.data.preferences``) with the same trainer actor as
GRPO and SFT (``Trainer.preference_step``: a scalar head's Bradley-Terry loss, or DPO's), the
same checkpoints and ``--resume``, the same step log and export. What differs is given by an
``PreferenceApp``: the roles beside the trainer, each pair's reference logprobs (DPO's), and
what else an evaluation measures (DPO's policy samples the held-out prompts).

The loop, top to bottom:

1. ``batch_size`` pairs of the training split (reshuffled every epoch), each tokenised as SFT
   writes an example (``PromptFormat.preference_example``: the prompt as the policy sees it,
   each response ending with the end-of-answer token);
2. with DPO, their reference logprobs (the reference service, once per pair, then cached);
3. one optimizer step; before the first (``eval/step`` 0, in the first step's row: the starting
   point), every ``eval.every`` steps and after the last one, the held-out pairs' loss and
   pairwise accuracy (``eval/loss``, ``eval/pairwise_accuracy``) and the app's own figures;
4. checkpoints every ``trainer.checkpoint_every`` steps, and ``final_model`` at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.common import cli
from apps.common.config import (
    LoggingSection,
    OptimizerSection,
    RecordsSection,
    TrainingSections,
    check_batch_run,
    rank_shares,
)
from apps.common.inputs import make_model, prepare_data, records_source
from apps.common.launch import Roles, RoleSpec, RunResources, assign_gpus, open_run, start_all, start_role
from apps.common.roles import call_role
from apps.common.step_log import StepLog
from forge.data.datasets import PromptEpochs
from forge.data.preferences import PreferenceKeys, PreferencePair, load_preference_pairs
from forge.distributed import call_spmd
from forge.observability import EVAL_STEP
from forge.types import PreferenceBatch, PreferenceExample

if TYPE_CHECKING:
    from forge.data.formatting import PromptFormat

logger = logging.getLogger("forge.preferences")

__all__ = [
    "PairEvalSection",
    "PreferenceApp",
    "PreferenceRecords",
    "PreferenceSections",
    "run_preferences",
]


@dataclass(kw_only=True)
class PreferenceRecords(RecordsSection):
    """Preference records (TRL's format: a prompt, the chosen and the rejected response, each a
    string) from local files, and how their prompts are shown to the model. ``answer_key`` is
    read only where an evaluation checks sampled answers (DPO's ``eval.generate``)."""

    question_key: str = "prompt"
    """The field with the prompt's text."""
    chosen_key: str = "chosen"
    """The field with the preferred response."""
    rejected_key: str = "rejected"
    """The field with the response it is preferred to."""

    def keys(self) -> PreferenceKeys:
        return PreferenceKeys(self.question_key, self.chosen_key, self.rejected_key)


@dataclass(kw_only=True)
class PairEvalSection:
    """Held-out pairs scored every ``every`` steps and after the last one."""

    every: int = 0
    """Steps between evaluations; 0: only after the last step."""
    split: str = "test"
    """The held-out split of ``data.path`` (or ``held_out`` for its ``held_out_fraction``)."""
    pairs: int = 512
    """The first this many held-out pairs (rounded down to a multiple of the trainer's ranks)."""


@dataclass(kw_only=True)
class PreferenceSections(TrainingSections):
    """The root config of a preference app: steps and batch, the pairs, held-out pairs, the trainer."""

    steps: int = 500
    """Optimizer steps."""
    batch_size: int = 32
    """Pairs per optimizer step."""
    data: PreferenceRecords = field(default_factory=PreferenceRecords)
    eval: PairEvalSection = field(default_factory=PairEvalSection)
    trainer: OptimizerSection = field(default_factory=OptimizerSection)
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(output_dir="outputs/preferences"))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_batch_run(self, "pairs", "the preference records (prompt, chosen, rejected)")
        for name in ("every", "pairs"):
            value = getattr(self.eval, name)
            if value < 0:
                raise ValueError(f"eval.{name} must be >= 0, got {value}")


References = Callable[[list[PreferencePair], list[PreferenceExample]], Awaitable[list[tuple[float, float]]]]
"""Each pair's ``(chosen, rejected)`` reference logprobs (DPO), given the pairs and their ids."""


@dataclass
class PreferenceApp:
    """What one preference app adds to the shared run."""

    name: str
    """The app (``rm``, ``dpo``): the log's and the summary's name."""
    role_specs: Callable[[Any, str, RunResources], list[RoleSpec]]
    """``(cfg, model_path, resources)`` -> the roles to start (the trainer among them)."""
    references: Callable[[Any, Roles], References] | None = None
    """``(cfg, roles)`` -> the reference scorer; None: the loss needs no reference (a reward model)."""
    on_started: Callable[[Any, Roles, RunResources], Awaitable[None]] | None = None
    """Called once the roles are up (e.g. set the trainer -> policy weight sync)."""
    evaluate: Callable[[Any, Roles, RunResources, int], Awaitable[dict[str, float]]] | None = None
    """More held-out figures of step ``step`` (DPO's sampled accuracy), beside the pairs'."""
    after_export: Callable[[Any, Path], None] | None = None
    """Called with ``final_model``'s folder once it is written (a reward model's prompt format)."""
    show: tuple[str, ...] = ("loss", "eval/pairwise_accuracy")
    """The progress bar's figures."""


class PairData:
    """The run's pairs: the training epochs, the format that tokenises them, the held-out batch."""

    def __init__(self, cfg: PreferenceSections, model_path: str) -> None:
        from forge.data.formatting import PromptFormat

        prepare_data(cfg.data)
        self.fmt: PromptFormat = PromptFormat.from_model(model_path, cfg.data.prompt_template, cfg.data.chat_template)
        source = records_source(cfg.data)
        self.epochs: PromptEpochs = PromptEpochs(load_preference_pairs(source, cfg.data.keys()), cfg.seed)
        self.held_out: list[PreferencePair] = []
        if cfg.eval.pairs:
            held = dataclasses.replace(source, split=cfg.eval.split)
            pairs = load_preference_pairs(held, cfg.data.keys())[: cfg.eval.pairs]
            self.held_out = rank_shares(pairs, cfg, "pairs")

    def examples(self, pairs: list[PreferencePair]) -> list[PreferenceExample]:
        return [self.fmt.preference_example(p.prompt, p.chosen, p.rejected) for p in pairs]


async def batch_of(pairs: list[PreferencePair], data: PairData, references: References | None) -> PreferenceBatch:
    """The pairs tokenised and packed, with their reference logprobs when the loss needs them."""
    examples = data.examples(pairs)
    refs = None if references is None else await references(pairs, examples)
    return PreferenceBatch.pack(examples, refs)


async def run_preferences(app: PreferenceApp, cfg: PreferenceSections, terminal: Any, resume_from: Path | None) -> str:
    """Prepare the model and the pairs (checked before any process starts), start the roles,
    train, evaluate, export; returns the summary line."""
    t_start = time.perf_counter()
    cli.record_config(cfg, terminal, app.name)
    model_path = str(make_model(cfg.model).resolve())
    data = PairData(cfg, model_path)
    roles, resources = Roles(), RunResources()
    log: StepLog | None = None
    try:
        resources = await open_run(cfg, cfg.weight_sync if app.evaluate else None)
        specs = app.role_specs(cfg, model_path, resources)
        gpus = assign_gpus(cfg, roles=tuple(s.name for s in specs))
        await start_all(roles, {s.name: start_role(s, cfg, gpus, resources.host_pool) for s in specs})
        if app.on_started is not None:
            await app.on_started(cfg, roles, resources)
        references = None if app.references is None else app.references(cfg, roles)
        held_out = await batch_of(data.held_out, data, references) if data.held_out else None
        done = 0
        if resume_from is not None:
            done, _, extra = await call_role("trainer", call_spmd(roles.trainer.load_checkpoint, str(resume_from)))
            data.epochs.seek(int(extra.get("data_position", 0)))
        # The starting point's figures (eval/step 0), in the first step's row: what training gains.
        start = await evaluate(app, cfg, roles, resources, held_out, 0) if cfg.eval.every and not done else {}
        startup_s = time.perf_counter() - t_start
        log = StepLog(cfg, terminal, cfg.steps, resume_after=None if resume_from is None else done, desc=app.name)
        for step in range(done + 1, cfg.steps + 1):
            await train_step(app, cfg, roles, resources, data, references, held_out, log, step, t_start, start)
            start = {}
        if cfg.trainer.export_final_model:
            folder = Path(cfg.logging.output_dir) / "final_model"
            await call_role("trainer", call_spmd(roles.trainer.export_model, str(folder)))
            if app.after_export is not None:
                app.after_export(cfg, folder)
        log.close()
        plot = log.plot("loss.png", ("loss", "eval/pairwise_accuracy"), beside={"loss": ["eval/loss"]})
        return summary(app, cfg, log, time.perf_counter() - t_start, startup_s) + (f"; plot {plot}" if plot else "")
    finally:
        if log is not None:
            log.close()
        await roles.stop()
        resources.close()  # after the roles: their processes run on its hosts


async def train_step(
    app: PreferenceApp,
    cfg: PreferenceSections,
    roles: Roles,
    resources: RunResources,
    data: PairData,
    references: References | None,
    held_out: PreferenceBatch | None,
    log: StepLog,
    step: int,
    started: float,
    evaluated: dict[str, float],
) -> None:
    """One step: a batch of pairs, the trainer's step, a due evaluation, a due checkpoint, the row
    (with ``evaluated``, figures measured before the step, unless the step evaluates itself)."""
    t0 = time.perf_counter()
    batch = await batch_of(data.epochs.take(cfg.batch_size), data, references)
    stats = await call_role("trainer", call_spmd(roles.trainer.preference_step, batch))
    keep = ("loss", "accuracy", "margin", "grad_norm", "lr", "tokens", "train_s")
    row = {name: stats[name] for name in keep if name in stats}
    row.update(evaluated)
    row["epoch"] = data.epochs.epoch
    last = step == cfg.steps
    if last or (cfg.eval.every and step % cfg.eval.every == 0):
        row.update(await evaluate(app, cfg, roles, resources, held_out, step))
    row["step_time_s"] = time.perf_counter() - t0
    row["wall_s"] = time.perf_counter() - started
    log.write(step, row, show=app.show)
    every = cfg.trainer.checkpoint_every
    if every and (step % every == 0 or last):
        await call_role(
            "trainer", call_spmd(roles.trainer.save_checkpoint, step, {"data_position": data.epochs.position})
        )
        if last:  # the last checkpoint, written in the background, is in place
            await call_role("trainer", call_spmd(roles.trainer.wait_checkpoint))


async def evaluate(
    app: PreferenceApp,
    cfg: PreferenceSections,
    roles: Roles,
    resources: RunResources,
    held_out: PreferenceBatch | None,
    step: int,
) -> dict[str, float]:
    """The held-out pairs' loss and pairwise accuracy, and the app's own figures, of step ``step``."""
    t0 = time.perf_counter()
    out: dict[str, float] = {EVAL_STEP: float(step)}
    if held_out is not None:
        held = await call_role("trainer", call_spmd(roles.trainer.preference_eval, held_out))
        out.update(
            {"eval/loss": held["loss"], "eval/pairwise_accuracy": held["accuracy"], "eval/margin": held["margin"]}
        )
    if app.evaluate is not None:
        out.update(await app.evaluate(cfg, roles, resources, step))
    out["eval/s"] = time.perf_counter() - t0
    return out


def summary(app: PreferenceApp, cfg: PreferenceSections, log: StepLog, elapsed_s: float, startup_s: float) -> str:
    rows = log.rows
    if not rows:
        return f"{app.name}: no step completed in {elapsed_s:.1f}s"
    k = min(10, len(rows))
    first = sum(r["loss"] for r in rows[:k]) / k
    last = sum(r["loss"] for r in rows[-k:]) / k
    evals = [r for r in rows if EVAL_STEP in r]
    held = ""
    if evals:
        final = evals[-1]
        names = (("eval/pairwise_accuracy", "pairwise accuracy"), ("eval/loss", "loss"), ("eval/accuracy", "accuracy"))
        parts = [f"{name} {final[key]:.3f}" for key, name in names if key in final]
        held = f"held-out {', '.join(parts)} at step {final[EVAL_STEP]:.0f}; "
    exported = f"final model {Path(cfg.logging.output_dir) / 'final_model'}; " if cfg.trainer.export_final_model else ""
    return (
        f"{app.name}: {len(rows)} steps in {elapsed_s:.1f}s (startup {startup_s:.1f}s); "
        f"loss first-{k} {first:.3f} -> last-{k} {last:.3f}; {held}{exported}metrics {log.metrics_path}"
    )
