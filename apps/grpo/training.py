"""The GRPO app's training loop: batches from the buffer, optimizer steps, weight sync,
checkpoints and resuming."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.common.launch import Roles
from apps.common.roles import call_role
from apps.grpo.faults import mesh_call
from apps.grpo.ppo import critic_step, load_critic, save_critic, with_ppo_targets
from apps.grpo.rollouts import Rollouts
from forge.distributed import call_spmd  # the trainer is one SPMD mesh: every rank gets each call

if TYPE_CHECKING:
    from apps.common.evaluation import EvalRuns
    from apps.common.weights import PolicyWeights
    from apps.grpo.config import GRPOConfig
    from apps.grpo.run_log import RunLog


async def train(
    cfg: GRPOConfig,
    roles: Roles,
    weights: PolicyWeights,
    rollouts: Rollouts,
    log: RunLog,
    after_step: int = 0,
    version: int = 0,
    evals: EvalRuns | None = None,
) -> None:
    """The step loop: wait for a batch, one optimizer step, weight sync, log, checkpoint.

    The new weights are taken from the trainer right after its step; loading them into the
    policy (which first finishes the generation batch in flight) overlaps the next step's wait
    and is awaited before the next sync. With ``max_policy_age=0`` it is awaited at once.
    A resumed run starts after ``after_step`` with the policy at ``version``. A step is logged
    before it is checkpointed, so every checkpointed step is in ``metrics.jsonl``.

    ``evals``: held-out evaluations. One starts in the background once a due step's weights
    reach the policy (rollouts go on beside it); the last step's runs before that step is
    logged, so the final row holds the final model's figures.
    """
    from forge.types import EpisodeBatch

    pushing: asyncio.Task | None = None
    if after_step == 0:  # a fresh run lists only its own exports
        (Path(cfg.logging.output_dir) / "exports" / "index.jsonl").unlink(missing_ok=True)
    try:
        for step in range(after_step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            groups = await rollouts.take_batch(cfg.prompts_per_step, version)
            t1 = time.perf_counter()
            batch = EpisodeBatch.concat(groups)
            critic_stats: dict[str, float] = {}
            if roles.critic is None:
                stats = await trainer_call(cfg, roles.trainer.train_step, batch)
            else:  # PPO: the critic's values make the advantages; then policy and critic train at once
                batch, critic_stats = await with_ppo_targets(cfg, roles, batch)
                stats, value_stats = await asyncio.gather(
                    trainer_call(cfg, roles.trainer.train_step, batch), critic_step(cfg, roles, batch)
                )
                critic_stats.update(value_stats)
            t2 = time.perf_counter()
            version = int(stats["policy_version"])
            fetched = await weights.fetch()
            if pushing is not None:
                await pushing
            pushing = asyncio.create_task(weights.push(*fetched), name=f"push-weights-v{version}")
            if cfg.max_policy_age == 0:
                await pushing
            if evals is not None and step == cfg.steps:
                await pushing
                await evals.now(step)
            elif evals is not None and evals.due(step):
                evals.start(step, pushing)
            t3 = time.perf_counter()
            await log.step(
                step,
                {
                    "reward_mean": float(batch.rewards.mean()),
                    "reward_max": float(batch.rewards.max()),
                    "loss": stats["loss"],
                    "kl": stats["kl"],
                    "clip_fraction": stats.get("clip_fraction", 0.0),
                    "ratio_mean": stats.get("ratio_mean", 1.0),
                    # |trainer - behaviour| logprob: sampler/trainer drift (trainer.dual_clip, tis_cap bound it)
                    "mismatch_max": stats.get("mismatch_max", 0.0),
                    "mismatch_mean": stats.get("mismatch_mean", 0.0),
                    "grad_norm": stats["grad_norm"],
                    "policy_version": version,
                    "policy_age_mean": float((version - 1 - batch.policy_versions).float().mean()),
                    # Per sampled token (a sequence may span an update): mean, max, share spanning versions.
                    **{f"policy/{k}": v for k, v in batch.token_ages(version - 1).items()},
                    "response_len_mean": float(batch.response_lens.float().mean()),
                    # Pad tokens / tokens the trainer's forward passes computed (near 0 with pack_sequences).
                    "padding_fraction": stats["padding_fraction"],
                    "step_time_s": t3 - t0,
                    "wait_s": t1 - t0,
                    "train_s": t2 - t1,
                    "sync_wait_s": t3 - t2,
                    **critic_stats,
                    **rollouts.end_step(groups),
                    **rollouts.group_counts(),
                    **(evals.collect(t3 - t0) if evals is not None else {}),
                },
                roles,
            )
            if checkpoint_due(cfg, step):
                await checkpoint_run(cfg, roles, step)
            if cfg.trainer.export_every and step % cfg.trainer.export_every == 0:
                await export_step(cfg, roles, step, log.started)
        if pushing is not None:
            await pushing
        if cfg.trainer.checkpoint_every:  # the last checkpoint, written in the background, is in place
            await trainer_call(cfg, roles.trainer.wait_checkpoint)
        if cfg.trainer.export_final_model:
            await export_final_model(cfg, roles)
    finally:
        if pushing is not None and not pushing.done():
            pushing.cancel()
            await asyncio.gather(pushing, return_exceptions=True)


async def trainer_call(cfg: GRPOConfig, endpoint: Any, *args: Any) -> Any:
    """A call to every trainer rank, bounded by ``faults.health_timeout_s`` (``faults.mesh_call``)."""
    return await mesh_call(cfg, "trainer", endpoint, *args)


# ----------------------------------------------------------------------------- checkpoints
async def export_final_model(cfg: GRPOConfig, roles: Roles) -> str:
    """The trained model as a Hugging Face folder, ``<logging.output_dir>/final_model``, that
    ``transformers`` and vLLM load."""
    folder = str(Path(cfg.logging.output_dir) / "final_model")
    return await call_role("trainer", call_spmd(roles.trainer.export_model, folder))


async def export_step(cfg: GRPOConfig, roles: Roles, step: int, started: float) -> str:
    """The weights of step ``step`` as a Hugging Face folder under ``<output_dir>/exports``, listed
    in ``exports/index.jsonl`` with the wall seconds since the run started and the clock time
    (``unix_time``) when it was written."""
    import json

    root = Path(cfg.logging.output_dir) / "exports"
    folder = await call_role("trainer", call_spmd(roles.trainer.export_model, str(root / f"step_{step:08d}")))
    with open(root / "index.jsonl", "a", encoding="utf-8") as index:
        line = {"step": step, "wall_s": time.perf_counter() - started, "unix_time": time.time(), "path": folder}
        index.write(json.dumps(line) + "\n")
    return folder


def checkpoint_due(cfg: GRPOConfig, step: int) -> bool:
    """Every ``trainer.checkpoint_every`` steps, and at the last step."""
    every = cfg.trainer.checkpoint_every
    return every > 0 and (step % every == 0 or step == cfg.steps)


async def checkpoint_run(cfg: GRPOConfig, roles: Roles, step: int) -> None:
    """The trainer's full state (and PPO's critic's), plus the controller's: the dataset's position.
    The time the step loop waits for it is ``checkpoint_s`` in the next step's row."""
    from forge.observability import record_metric

    t0 = time.perf_counter()
    position = await call_role("dataset", roles.dataset.position.call_one())
    if roles.critic is not None:  # complete first: a complete trainer checkpoint then has its critic's
        await save_critic(cfg, roles, step)
    await trainer_call(cfg, roles.trainer.save_checkpoint, step, {"dataset_position": position})
    record_metric("checkpoint_s", time.perf_counter() - t0, "sum")


async def resume(cfg: GRPOConfig, roles: Roles, weights: PolicyWeights, path: Path) -> tuple[int, int]:
    """Load checkpoint ``path`` into the roles before any rollout; returns (step, policy version).

    Restored: the trainer's weights, optimizer state, policy version and RNG states (and PPO's
    critic's, from its checkpoint of the same step); the
    dataset's position; the policy replicas' weights (a normal weight sync, at the checkpoint's
    version). Not restored: the groups that were buffered or being generated at the checkpoint
    (their prompts are skipped, not replayed) and vLLM's sampling RNG (reseeded from ``seed``).
    So training continues from the same model, optimizer and step numbers, but not with the very
    samples the killed run would have drawn (concurrent rollouts make no two runs draw them
    alike anyway).
    """
    step, version, extra = await call_role("trainer", call_spmd(roles.trainer.load_checkpoint, str(path)))
    if roles.critic is not None:
        await load_critic(cfg, roles, path)
    await call_role("dataset", roles.dataset.seek.call_one(int(extra.get("dataset_position", 0))))
    await weights.sync()
    return step, version
