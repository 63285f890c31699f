"""Supervised fine-tuning on Monarch actors: the GRPO app's trainer, on question/answer records.

Run (the tiny model and the addition task are made on the fly if missing):

    python -m apps.sft.main --config configs/sft_addition.yaml
    python -m apps.sft.main --config configs/sft_addition.yaml trainer.lr=1e-3 steps=2000
    python -m apps.sft.main --config configs/sft_addition.yaml --resume      # a killed run continues

The loop, top to bottom:

1. ``batch_size`` records of the training split (reshuffled every epoch), each one prompt (the
   question, through the chat template where the model has one: ``forge.data.PromptFormat``,
   exactly as GRPO and evaluation prompt it) and one target (the answer and the token that
   ends it).
2. One optimizer step on the trainer actor (``Trainer.sft_step``): the mean negative
   log-likelihood of the answer tokens; prompt tokens are masked out. The trainer is the same
   actor as GRPO's: ``trainer.procs``/``hosts`` shard it with FSDP2, ``pack_sequences`` packs.
3. Every ``eval.every`` steps and after the last: the held-out answers' loss (``eval/loss``)
   and, with ``eval.generate``, the policy service's greedy accuracy on the held-out prompts
   (``eval/accuracy``; ``forge.evaluation``, the weights synced first). With
   ``eval.stop_at_accuracy`` the run stops at the first evaluation that reaches it.
4. Checkpoints every ``trainer.checkpoint_every`` steps (DCP; ``--resume`` continues with the same
   step numbers and data position), and ``final_model`` at the end: a Hugging Face folder that
   vLLM and the GRPO app's ``model.path`` load as they are.

Outputs in ``logging.output_dir``: ``config.yaml``, ``metrics.jsonl`` (one line per step),
``loss.png`` (training and held-out loss, held-out accuracy), TensorBoard events or a W&B run
(``logging.sinks``), ``checkpoints/`` and ``final_model/``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import forge.controller  # noqa: F401  (before anything imports monarch)
from apps.common import cli
from apps.common.config import rank_shares, settings
from apps.common.evaluation import EvalPlan, eval_source
from apps.common.inputs import make_model, prepare_data, records_source
from apps.common.launch import (
    Roles,
    RoleSpec,
    RunResources,
    assign_gpus,
    open_run,
    policy_config,
    start_all,
    start_role,
)
from apps.common.roles import POLICY_ENV, QUIET_ENV, RoleFailed, call_role
from apps.common.step_log import StepLog
from apps.common.weights import PolicyWeights
from forge.actors import Policy
from forge.data.datasets import PromptEpochs, load_prompts
from forge.distributed import call_spmd
from forge.observability import EVAL_STEP
from forge.types import SFTBatch

if TYPE_CHECKING:
    from apps.sft.config import SFTConfig
    from forge.data.formatting import PromptFormat

logger = logging.getLogger("forge.sft")

SFT_ROLES = ("policy", "trainer")


def role_specs(cfg: SFTConfig, model_path: str, weights_dir: str | None = None) -> list[RoleSpec]:
    """The trainer actor, and the policy service that samples held-out prompts (``eval.generate``)."""
    from forge.actors import Trainer, TrainerConfig
    from forge.actors.trainer import OptimizerSettings

    t = cfg.trainer
    trainer = TrainerConfig(
        **settings(t, OptimizerSettings),
        model_path=model_path,
        seed=cfg.seed,
        checkpoint_dir=cfg.checkpoint_dir if t.checkpoint_every else None,
        total_steps=cfg.steps,
    )
    specs = [RoleSpec("trainer", Trainer, trainer, QUIET_ENV, service=False)]
    if cfg.eval.generate:
        policy = policy_config(cfg, model_path, group_size=1, weights_dir=weights_dir)
        specs.append(RoleSpec("policy", Policy, policy, POLICY_ENV))
    return specs


async def start_roles(cfg: SFTConfig, model_path: str, resources: RunResources) -> Roles:
    """Start the roles concurrently (on ``resources``' hosts) and, with a policy, set the run's
    weight sync on ``resources``; if one fails, stop the other and raise naming it."""
    roles = Roles()
    gpus = assign_gpus(cfg, roles=SFT_ROLES)
    await start_all(
        roles,
        {
            spec.name: start_role(spec, cfg, gpus, resources.host_pool)
            for spec in role_specs(cfg, model_path, resources.weights_dir)
        },
    )
    if roles.policy is not None:
        transport, folder = cfg.weight_sync.transport, resources.weights_dir
        resources.weights = PolicyWeights(roles.trainer, roles.policy, transport, folder, 300.0)
        roles.policy.set_resync(resources.weights.resync)  # a restarted replica loads the served weights
    return roles


# ----------------------------------------------------------------------------- the run
async def run(cfg: SFTConfig, terminal: Any, resume_from: Path | None = None) -> str:
    """Prepare the data, start the roles, train, evaluate, export; returns the summary line."""
    from forge.data.formatting import PromptFormat

    t_start = time.perf_counter()
    cli.record_config(cfg, terminal, "sft")
    model_path = prepare_model(cfg)
    # Everything read from disk is checked before any process starts.
    prepare_data(cfg.data)
    fmt = PromptFormat.from_model(model_path, cfg.data.prompt_template, cfg.data.chat_template)
    records = PromptEpochs(load_prompts(records_source(cfg.data)), cfg.seed)
    held_out = held_out_batch(cfg, fmt)
    plan = eval_plan(cfg, model_path)
    roles, resources = Roles(), RunResources()
    log: StepLog | None = None
    try:
        resources = await open_run(cfg, cfg.weight_sync if cfg.eval.generate else None)
        roles = await start_roles(cfg, model_path, resources)
        step = 0
        if resume_from is not None:
            step, _, extra = await call_role("trainer", call_spmd(roles.trainer.load_checkpoint, str(resume_from)))
            records.seek(int(extra.get("data_position", 0)))
        startup_s = time.perf_counter() - t_start
        log = StepLog(cfg, terminal, cfg.steps, resume_after=None if resume_from is None else step, desc="sft")
        stopped_at = await train(cfg, roles, resources.weights, records, fmt, held_out, plan, log, step, t_start)
        if cfg.trainer.export_final_model:
            folder = str(Path(cfg.logging.output_dir) / "final_model")
            await call_role("trainer", call_spmd(roles.trainer.export_model, folder))
        log.close()
        plot = log.plot("loss.png", ("loss", "eval/accuracy"), beside={"loss": ["eval/loss"]})
        return summary(cfg, log, time.perf_counter() - t_start, startup_s, stopped_at) + (
            f"; plot {plot}" if plot else ""
        )
    finally:
        if log is not None:
            log.close()
        await roles.stop()
        resources.close()  # after the roles: their processes run on its hosts


async def train(
    cfg: SFTConfig,
    roles: Roles,
    weights: PolicyWeights | None,
    records: PromptEpochs,
    fmt: PromptFormat,
    held_out: SFTBatch | None,
    plan: EvalPlan | None,
    log: StepLog,
    after_step: int,
    started: float,
) -> int | None:
    """The step loop after ``after_step``; returns the step at which ``eval.stop_at_accuracy`` was
    reached (the run's last), or None if it ran every step. ``started``: the run's start
    (``time.perf_counter``), from which each row's ``wall_s`` counts. ``weights``: the weight sync
    to the policy that ``plan`` samples (None without one)."""
    for step in range(after_step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        batch = SFTBatch.pack([fmt.sft_example(p.text, p.answer) for p in records.take(cfg.batch_size)])
        stats = await call_role("trainer", call_spmd(roles.trainer.sft_step, batch))
        row = {
            "loss": stats["loss"],
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "tokens": stats["tokens"],
            "padding_fraction": stats["padding_fraction"],
            "train_s": stats["train_s"],
            "epoch": records.epoch,
        }
        last = step == cfg.steps
        if last or (cfg.eval.every and step % cfg.eval.every == 0):
            row.update(await evaluate(roles, weights, held_out, plan, step))
        stop = cfg.eval.stop_at_accuracy
        stopped = bool(stop) and row.get("eval/accuracy", -1.0) >= stop
        row["step_time_s"] = time.perf_counter() - t0
        row["wall_s"] = time.perf_counter() - started
        log.write(step, row, show=("loss", "eval/loss", "eval/accuracy"))
        every = cfg.trainer.checkpoint_every
        if every and (step % every == 0 or last or stopped):
            extra = {"data_position": records.position}
            await call_role("trainer", call_spmd(roles.trainer.save_checkpoint, step, extra))
            if last or stopped:  # the last checkpoint, written in the background, is in place
                await call_role("trainer", call_spmd(roles.trainer.wait_checkpoint))
        if stopped:
            logger.warning(
                "held-out accuracy %.3f reached eval.stop_at_accuracy=%g at step %d: stopping",
                row["eval/accuracy"],
                stop,
                step,
            )
            return step
    return None


async def evaluate(
    roles: Roles, weights: PolicyWeights | None, held_out: SFTBatch | None, plan: EvalPlan | None, step: int
) -> dict[str, float]:
    """The held-out answers' loss and, with a plan, the policy's accuracy on step ``step``'s weights."""
    t0 = time.perf_counter()
    out: dict[str, float] = {EVAL_STEP: float(step)}
    if held_out is not None:
        out["eval/loss"] = (await call_role("trainer", call_spmd(roles.trainer.eval_loss, held_out)))["loss"]
    if plan is not None and weights is not None:
        await weights.sync()
        out.update(await plan.run(roles.policy, step))
    out["eval/s"] = time.perf_counter() - t0
    return out


def held_out_batch(cfg: SFTConfig, fmt: PromptFormat) -> SFTBatch | None:
    """The first ``eval.loss_examples`` held-out examples (a multiple of the trainer's ranks), or
    None when ``eval.loss_examples`` is 0."""
    if not cfg.eval.loss_examples:
        return None
    prompts = load_prompts(eval_source(cfg.eval, cfg.data))[: cfg.eval.loss_examples]
    return SFTBatch.pack([fmt.sft_example(p.text, p.answer) for p in rank_shares(prompts, cfg, "records")])


def eval_plan(cfg: SFTConfig, model_path: str) -> EvalPlan | None:
    """The generation evaluation (``eval.generate``), its held-out prompts loaded and checked now."""
    if not cfg.eval.generate:
        return None
    return EvalPlan.from_config(
        cfg.eval,
        cfg.data,
        model_path,
        temperature=1.0,  # the samples' temperature when eval.temperature is 0
        max_tokens=cfg.policy.max_tokens,
        reward_fns=dict(cfg.eval.reward),
    )


def prepare_model(cfg: SFTConfig) -> str:
    """The checkpoint folder (the tiny model is made there if the config asks for it); with the
    file transport, checks that the weight folder has room for the weights first."""
    from apps.common.space import check_checkpoint_space, check_weight_sync_space

    path = make_model(cfg.model)
    check_checkpoint_space(cfg.trainer, cfg.checkpoint_dir, path)
    if cfg.eval.generate:
        check_weight_sync_space(cfg.weight_sync, cfg.trainer, path)
    return str(path.resolve())


def summary(cfg: SFTConfig, log: StepLog, elapsed_s: float, startup_s: float, stopped_at: int | None) -> str:
    rows = log.rows
    if not rows:
        return f"sft: no step completed in {elapsed_s:.1f}s"
    k = min(10, len(rows))
    first = sum(r["loss"] for r in rows[:k]) / k
    last = sum(r["loss"] for r in rows[-k:]) / k
    evals = [r for r in rows if "eval/loss" in r or "eval/accuracy" in r]
    held = ""
    if evals:
        final = evals[-1]
        parts = [f"{name} {final[key]:.3f}" for key, name in (("eval/loss", "loss"), ("eval/accuracy", "accuracy"))]
        held = "held-out " + ", ".join(p for p, key in zip(parts, ("eval/loss", "eval/accuracy")) if key in final)
        held += f" at step {final[EVAL_STEP]:.0f}; "
    stopped = f" (stopped at eval.stop_at_accuracy={cfg.eval.stop_at_accuracy:g})" if stopped_at else ""
    exported = f"final model {Path(cfg.logging.output_dir) / 'final_model'}; " if cfg.trainer.export_final_model else ""
    return (
        f"sft: {len(rows)} steps{stopped} in {elapsed_s:.1f}s (startup {startup_s:.1f}s); "
        f"loss first-{k} {first:.3f} -> last-{k} {last:.3f}; {held}{exported}metrics {log.metrics_path}"
    )


main = cli.entry("sft", "apps.sft.config:SFTConfig", run, __doc__, failures=(RoleFailed,))


if __name__ == "__main__":
    sys.exit(main())
