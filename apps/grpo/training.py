"""The GRPO app's training loop: batches from the buffer, optimizer steps, weight sync,
checkpoints and resuming."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.grpo.roles import Roles, call_role
from apps.grpo.rollouts import Rollouts
from forge.checkpoint import latest_checkpoint

if TYPE_CHECKING:
    from apps.grpo.run_log import RunLog


async def train(cfg: Any, roles: Roles, rollouts: Rollouts, log: RunLog, after_step: int = 0, version: int = 0) -> None:
    """The step loop: wait for a batch, one optimizer step, weight sync, log, checkpoint.

    The new weights are taken from the trainer right after its step; loading them into the
    policy (which first finishes the generation batch in flight) overlaps the next step's wait
    and is awaited before the next sync. With ``max_policy_age=0`` it is awaited at once.
    A resumed run starts after ``after_step`` with the policy at ``version``. A step is logged
    before it is checkpointed, so every checkpointed step is in ``metrics.jsonl``.
    """
    from forge.types import EpisodeBatch

    pushing: asyncio.Task | None = None
    try:
        for step in range(after_step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            groups = await wait_for_batch(cfg, roles, rollouts, version)
            t1 = time.perf_counter()
            batch = EpisodeBatch.concat(groups)
            stats = await call_role("trainer", roles.trainer.train_step.call_one(batch))
            t2 = time.perf_counter()
            version = int(stats["policy_version"])
            weights = await fetch_weights(cfg, roles)
            if pushing is not None:
                await pushing
            pushing = asyncio.create_task(push_weights(cfg, roles, *weights), name=f"push-weights-v{version}")
            if cfg.max_policy_age == 0:
                await pushing
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
                    "grad_norm": stats["grad_norm"],
                    "policy_version": version,
                    "policy_age_mean": float((version - 1 - batch.policy_versions).float().mean()),
                    "response_len_mean": float(batch.response_lens.float().mean()),
                    "step_time_s": t3 - t0,
                    "wait_s": t1 - t0,
                    "train_s": t2 - t1,
                    "sync_wait_s": t3 - t2,
                },
                roles,
            )
            if checkpoint_due(cfg, step):
                await save_checkpoint(roles, step)
        if pushing is not None:
            await pushing
    finally:
        if pushing is not None and not pushing.done():
            pushing.cancel()
            await asyncio.gather(pushing, return_exceptions=True)


async def wait_for_batch(cfg: Any, roles: Roles, rollouts: Rollouts, version: int) -> list[list[Any]]:
    """``prompts_per_step`` groups fresh enough for ``version``; waits for rollouts if needed."""
    from forge.observability import record_metric

    while True:
        rollouts.added.clear()
        sample = await call_role("buffer", roles.buffer.sample.call_one(cfg.prompts_per_step, version))
        record_metric("buffer/evicted_groups", sample.evicted, "sum")
        taken = sample.evicted + (len(sample.groups) if sample.groups is not None else 0)
        if taken:
            await rollouts.taken(taken)
        if sample.groups is not None:
            return sample.groups
        await rollouts.added.wait()


async def fetch_weights(cfg: Any, roles: Roles) -> tuple[Any, int]:
    """The trainer's current weights, as the configured transport carries them, and their version."""
    if cfg.weight_sync.transport == "file":
        return await call_role("trainer", roles.trainer.publish_weights.call_one(cfg.weight_sync.dir))
    return await call_role("trainer", roles.trainer.weights.call_one())


async def push_weights(cfg: Any, roles: Roles, weights: Any, version: int) -> int:
    """Load ``weights`` (a state dict or a file path) into every policy replica."""
    from forge.observability import record_metric

    t0 = time.perf_counter()
    await call_role("policy", roles.policy.update_weights.fanout(weights, version))
    record_metric("weight_sync/push_s", time.perf_counter() - t0)
    return version


async def sync_weights(cfg: Any, roles: Roles) -> int:
    """Publish the trainer's weights to every policy replica and wait; returns their version."""
    return await push_weights(cfg, roles, *(await fetch_weights(cfg, roles)))


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_due(cfg: Any, step: int) -> bool:
    """Every ``trainer.checkpoint_every`` steps, and at the last step."""
    every = cfg.trainer.checkpoint_every
    return every > 0 and (step % every == 0 or step == cfg.steps)


def checkpoint_to_resume(cfg: Any, resume: bool) -> Path | None:
    """The newest complete checkpoint of the run when ``resume``; None for a fresh run.

    ``--resume`` without a checkpoint is an error naming the folder searched. So is a fresh run
    in an ``output_dir`` that holds checkpoints: it would truncate that run's metrics and a
    later ``--resume`` could pick up the earlier run's newer checkpoints.
    """
    root = Path(cfg.checkpoint_dir)
    found = latest_checkpoint(root)
    if resume and found is None:
        raise FileNotFoundError(
            f"--resume found no complete checkpoint under {root}; a run writes them there "
            "when trainer.checkpoint_every > 0"
        )
    if not resume and found is not None:
        raise FileExistsError(
            f"{root} holds checkpoints of an earlier run (newest {found.name}); add --resume to "
            "continue it, or set another logging.output_dir"
        )
    return found


async def save_checkpoint(roles: Roles, step: int) -> None:
    """The trainer's full state, plus the controller's: the dataset's position."""
    position = await call_role("dataset", roles.dataset.position.call_one())
    await call_role("trainer", roles.trainer.save_checkpoint.call_one(step, {"dataset_position": position}))


async def resume(cfg: Any, roles: Roles, path: Path) -> tuple[int, int]:
    """Load checkpoint ``path`` into the roles before any rollout; returns (step, policy version).

    Restored: the trainer's weights, optimizer state, policy version and RNG states; the
    dataset's position; the policy replicas' weights (a normal weight sync, at the checkpoint's
    version). Not restored: the groups that were buffered or being generated at the checkpoint
    (their prompts are skipped, not replayed) and vLLM's sampling RNG (reseeded from ``seed``).
    So training continues from the same model, optimizer and step numbers, but not with the very
    samples the killed run would have drawn (concurrent rollouts make no two runs draw them
    alike anyway).
    """
    step, version, extra = await call_role("trainer", roles.trainer.load_checkpoint.call_one(str(path)))
    await call_role("dataset", roles.dataset.seek.call_one(int(extra.get("dataset_position", 0))))
    await sync_weights(cfg, roles)
    return step, version
