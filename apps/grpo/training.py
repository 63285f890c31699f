"""The GRPO app's training loop: batches from the buffer, optimizer steps, weight sync,
checkpoints and resuming."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apps.grpo.roles import RoleFailed, Roles, ServedWeights, call_role
from apps.grpo.rollouts import Rollouts, rewards_uniform
from forge.checkpoint import latest_checkpoint
from forge.distributed import call_spmd  # the trainer is one SPMD mesh: every rank gets each call

if TYPE_CHECKING:
    from apps.grpo.config import GRPOConfig
    from apps.grpo.run_log import RunLog


async def train(
    cfg: GRPOConfig, roles: Roles, rollouts: Rollouts, log: RunLog, after_step: int = 0, version: int = 0
) -> None:
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
            stats = await call_role("trainer", call_spmd(roles.trainer.train_step, batch))
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
                    # |trainer - behaviour| logprob: sampler/trainer drift (trainer.dual_clip, tis_cap bound it)
                    "mismatch_max": stats.get("mismatch_max", 0.0),
                    "mismatch_mean": stats.get("mismatch_mean", 0.0),
                    "grad_norm": stats["grad_norm"],
                    "policy_version": version,
                    "policy_age_mean": float((version - 1 - batch.policy_versions).float().mean()),
                    "response_len_mean": float(batch.response_lens.float().mean()),
                    # Pad tokens / tokens the trainer's forward passes computed (near 0 with pack_sequences).
                    "padding_fraction": stats["padding_fraction"],
                    "step_time_s": t3 - t0,
                    "wait_s": t1 - t0,
                    "train_s": t2 - t1,
                    "sync_wait_s": t3 - t2,
                    **sampling_metrics(rollouts, groups),
                    **group_counts(rollouts),
                },
                roles,
            )
            if checkpoint_due(cfg, step):
                await save_checkpoint(roles, step)
        if pushing is not None:
            await pushing
        if cfg.trainer.export_final_model:
            await export_final_model(cfg, roles)
    finally:
        if pushing is not None and not pushing.done():
            pushing.cancel()
            await asyncio.gather(pushing, return_exceptions=True)


async def wait_for_batch(cfg: GRPOConfig, roles: Roles, rollouts: Rollouts, version: int) -> list[list[Any]]:
    """``prompts_per_step`` groups fresh enough for ``version``; waits for rollouts if needed."""
    from forge.observability import record_metric

    while True:
        rollouts.added.clear()
        sample = await call_role("buffer", roles.buffer.sample.call_one(cfg.prompts_per_step, version))
        rollouts.buffer_stats = sample.stats
        record_metric("buffer/evicted_groups", sample.evicted, "sum")
        taken = sample.evicted + (len(sample.groups) if sample.groups is not None else 0)
        if taken:
            await rollouts.taken(taken)
        if sample.groups is not None:
            return sample.groups
        await rollouts.added.wait()


def sampling_metrics(rollouts: Rollouts, batch: list[Any]) -> dict[str, float]:
    """How informative the step's groups were; called once per step, it also gives the next
    step a fresh count and drop budget (``DynamicSampling.end_step``).

    ``zero_std_fraction``: of the groups finished since the last step, the fraction whose rewards
    were all equal, on or off dynamic sampling (what it drops, or would); ``dropped_uniform_groups``:
    how many of them it dropped; ``batch_zero_std_groups``: the groups of this step's batch whose
    rewards were all equal (0 with dynamic sampling unless ``rollout.max_dropped_per_step`` was reached).
    """
    return {
        **rollouts.sampling.end_step(),
        "batch_zero_std_groups": float(sum(rewards_uniform(group) for group in batch)),
    }


def group_counts(rollouts: Rollouts) -> dict[str, float]:
    """Where every group went so far (cumulative): started, generated again after a replica
    died, stored, dropped by dynamic sampling, trained, dropped by the buffer, still in flight;
    ``groups/lost`` and ``groups/unaccounted`` are 0 unless a group vanished (rollouts' and the
    buffer's books)."""
    c, b = rollouts.counts, rollouts.buffer_stats
    counts = {
        "groups/started": c.started,
        "groups/regenerated": c.regenerated,
        "groups/stored": c.stored,
        "groups/dropped_uniform": c.dropped_uniform,
        "groups/in_flight": c.in_flight,
        "groups/lost": c.lost,
    }
    if b is not None:
        counts.update(
            {
                "groups/trained": b.sampled,
                "groups/dropped_stale": b.dropped_stale,
                "groups/dropped_full": b.dropped_full,
                "groups/duplicates": b.duplicates + c.refused,
                "groups/buffered": b.size,
                "groups/unaccounted": b.added - b.sampled - b.evicted - b.size,
            }
        )
    return {k: float(v) for k, v in counts.items()}


async def fetch_weights(cfg: GRPOConfig, roles: Roles) -> tuple[Any, int]:
    """The trainer's current weights, as the configured transport carries them, and their version."""
    if cfg.weight_sync.transport == "file":
        folder = str(roles.weight_folder.path)  # the run's own (start_roles made it)
        return await call_role("trainer", call_spmd(roles.trainer.publish_weights, folder))
    return await call_role("trainer", call_spmd(roles.trainer.weights))


async def push_weights(cfg: GRPOConfig, roles: Roles, weights: Any, version: int) -> int:
    """Load ``weights`` (a state dict or a file path) into every healthy policy replica.

    They become ``roles.served`` first, so a replica that is restarting meanwhile loads them
    in its resync (``resync_policy``). A replica that dies while loading them does not fail the
    sync: it restarts and resyncs, and the sync waits only for the replicas that are alive.
    """
    from forge.observability import record_metric

    t0 = time.perf_counter()
    roles.served = ServedWeights(weights, version)
    try:
        await call_role("policy", roles.policy.update_weights.fanout(weights, version))
    except RoleFailed as exc:
        if not exc.recoverable:
            raise
        record_metric("weight_sync/interrupted", 1, "sum")
        await _loads_finished(roles, exc)
    record_metric("weight_sync/push_s", time.perf_counter() - t0)
    return version


async def _loads_finished(roles: Roles, interrupted: RoleFailed, tries: int = 5) -> None:
    """Wait until the live policy replicas have run their weight loads of an interrupted sync.

    The gather of the interrupted fanout gave up at the first dead replica, but the other
    replicas' loads still run; a replica handles one message at a time, so a ``version`` call
    answered by each live replica comes after its load.
    """
    from forge.controller import NoHealthyReplica

    for _ in range(tries):
        try:
            await call_role("policy", roles.policy.version.fanout())
            return
        except RoleFailed as exc:
            if not exc.recoverable or isinstance(exc.error, NoHealthyReplica):
                return  # none is alive: each one resyncs as it comes back
            interrupted = exc  # another replica died meanwhile: ask the live ones again
    raise interrupted


async def resync_policy(cfg: GRPOConfig, roles: Roles, actor_mesh: Any) -> None:
    """A restarted policy replica's step before it takes traffic: load the served weights.

    If a new version is pushed while it loads (the push skips replicas that are not healthy
    yet), it loads that one too, so it rejoins at the current version.
    """
    from forge.observability import record_metric

    loaded = 0  # a fresh engine serves the model's own weights, version 0
    for _ in range(5):
        served = roles.served
        if served.weights is None or served.version == loaded:
            return
        timeout = cfg.faults.max_unhealthy_s
        await asyncio.wait_for(actor_mesh.update_weights.call(served.weights, served.version), timeout)
        loaded = served.version
        record_metric("weight_sync/resyncs", 1, "sum")
        record_metric("weight_sync/resync_version", loaded, "last")


async def sync_weights(cfg: GRPOConfig, roles: Roles) -> int:
    """Publish the trainer's weights to every policy replica and wait; returns their version."""
    return await push_weights(cfg, roles, *(await fetch_weights(cfg, roles)))


# ----------------------------------------------------------------------------- checkpoints
async def export_final_model(cfg: GRPOConfig, roles: Roles) -> str:
    """The trained model as a Hugging Face folder, ``<logging.output_dir>/final_model``, that
    ``transformers`` and vLLM load."""
    folder = str(Path(cfg.logging.output_dir) / "final_model")
    return await call_role("trainer", call_spmd(roles.trainer.export_model, folder))


def checkpoint_due(cfg: GRPOConfig, step: int) -> bool:
    """Every ``trainer.checkpoint_every`` steps, and at the last step."""
    every = cfg.trainer.checkpoint_every
    return every > 0 and (step % every == 0 or step == cfg.steps)


def checkpoint_to_resume(cfg: GRPOConfig, resume: bool) -> Path | None:
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
    await call_role("trainer", call_spmd(roles.trainer.save_checkpoint, step, {"dataset_position": position}))


async def resume(cfg: GRPOConfig, roles: Roles, path: Path) -> tuple[int, int]:
    """Load checkpoint ``path`` into the roles before any rollout; returns (step, policy version).

    Restored: the trainer's weights, optimizer state, policy version and RNG states; the
    dataset's position; the policy replicas' weights (a normal weight sync, at the checkpoint's
    version). Not restored: the groups that were buffered or being generated at the checkpoint
    (their prompts are skipped, not replayed) and vLLM's sampling RNG (reseeded from ``seed``).
    So training continues from the same model, optimizer and step numbers, but not with the very
    samples the killed run would have drawn (concurrent rollouts make no two runs draw them
    alike anyway).
    """
    step, version, extra = await call_role("trainer", call_spmd(roles.trainer.load_checkpoint, str(path)))
    await call_role("dataset", roles.dataset.seek.call_one(int(extra.get("dataset_position", 0))))
    await sync_weights(cfg, roles)
    return step, version
