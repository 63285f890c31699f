"""GRPO on Monarch actors: a vLLM policy, a reference model, rewards, a trainer, a replay buffer.

Run (the tiny model is made on the fly if missing; run times in ``docs/benchmarks.md``):

    python -m apps.grpo.main --config configs/grpo_tiny.yaml
    python -m apps.grpo.main --config configs/grpo_tiny.yaml trainer.lr=3e-4 group_size=8
    python -m apps.grpo.main --config configs/qwen3_1_7b.yaml model.path=/path/to/Qwen3-1.7B \\
        data.path=/path/to/gsm8k/train.jsonl

The loop, top to bottom:

1. Rollouts run continuously, ``rollout.concurrency`` prompts in flight: a prompt from the
   dataset -> ``group_size`` completions from the policy service (prebatched with the other
   prompts in flight, routed by prompt) -> a reward and reference logprobs for every completion
   (both prebatched services) -> group-normalised advantages -> one group into the buffer
   (with ``rollout.dynamic_sampling``, a group whose rewards are all equal is dropped instead).
2. Training waits for ``prompts_per_step`` groups that are at most ``max_policy_age`` versions
   old, takes one optimizer step, and syncs the new weights into every policy replica after
   every step (the policy loads them as soon as its generation batch in flight is done).
   Rollouts never stop for training: what they sample while a step runs is one version stale,
   and the loss's importance ratio (against the behaviour logprobs) with PPO clipping corrects
   for it.

Simplifications: one optimizer step per batch (no PPO epochs); advantages are per group, not
per token; a group is trained on once; rollouts pause (backpressure) when
``rollout.max_buffered_groups`` are waiting, rather than generating data that would go stale.

Outputs in ``logging.output_dir``: ``config.yaml`` (the resolved config the run used; the
settings that differ from the defaults are also printed at start-up), ``metrics.jsonl`` (one
line per step, with each service's restarts and where every group went), ``reward_loss.png``
and TensorBoard events when ``tensorboard`` is installed.

Faults (``faults`` in the config, see ``faults.py``): a policy, reference or reward replica whose
process dies or hangs is restarted with backoff (a policy replica loads the current weights
first) and the groups it was generating are generated again; the run goes on with the same
step numbers. It gives up on a role that has no healthy replica for ``faults.max_unhealthy_s``
or used up ``faults.max_restarts``. A trainer whose process dies is replaced from the newest
checkpoint and training rewinds to it (``trainer_restart.py``, ``faults.trainer_max_restarts``).
Any other role's failure, a trainer past its restarts, or Ctrl-C stops every role and exits
non-zero with a message naming the role (for the trainer: how to ``--resume``).

Multi-turn (``env.cls`` set, e.g. ``configs/multiturn_tiny.yaml``): each group is
``group_size`` trajectories against an environment service instead of completions scored by
``reward``; see ``multiturn.py``.

The pieces: ``roles.py`` starts and stops the roles, ``groups.py`` makes a group, ``rollouts.py``
schedules groups into the buffer, ``training.py`` is the step loop, weight sync and checkpoints,
``run_loop.py`` trains a started run to its end (resume, evaluation, trainer restarts),
``run_log.py`` the per-step metrics; this module starts and stops one run, with clean shutdown
and exit codes.

Checkpoints: with ``trainer.checkpoint_every=N`` the trainer saves a full checkpoint under
``<output_dir>/checkpoints`` every N steps and at the last one (see ``resume``). A killed run
continues with the same command plus ``--resume``: same step numbers, ``metrics.jsonl``
appended. A fresh run refuses an ``output_dir`` that already holds checkpoints.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import forge.controller  # noqa: F401  (before anything imports monarch)
from apps.common import cli
from apps.common.launch import Roles, RunResources, job_gone, open_run, stop_roles
from apps.common.roles import RoleFailed
from apps.common.weights import PolicyWeights
from apps.grpo.faults import RoleWatch, resume_hint
from apps.grpo.groups import GroupSettings
from apps.grpo.roles import fault_options, prepare_model, start_roles
from apps.grpo.rollout_workers import ViewPublisher, start_rollout_workers, stop_rollout_workers
from apps.grpo.run_loop import TrainingRun, eval_plan

if TYPE_CHECKING:
    from apps.grpo.config import GRPOConfig

logger = logging.getLogger("forge.grpo")


# ----------------------------------------------------------------------------- the run
async def run(cfg: GRPOConfig, terminal: Any, resume_from: Path | None = None) -> str:
    """Start the roles (from checkpoint ``resume_from`` if given), train, stop; returns the summary."""
    from forge.controller.provisioner import add_fault_listener

    t_start = time.perf_counter()
    cli.record_config(cfg, terminal, "grpo")
    model_path = prepare_model(cfg)
    plan = eval_plan(cfg, model_path)  # the held-out prompts are loaded and checked before any role starts
    watch = RoleWatch(cfg)
    add_fault_listener(watch)
    roles, resources = Roles(), RunResources()
    views: ViewPublisher | None = None
    try:
        resources = await open_run(cfg, cfg.weight_sync)
        roles = await start_roles(cfg, model_path, resources)
        resources.weights = PolicyWeights(
            roles.trainer,
            roles.policy,
            cfg.weight_sync.transport,
            resources.weights_dir,
            cfg.faults.max_unhealthy_s,
            fetch_timeout_s=cfg.faults.health_timeout_s,
            max_updating=cfg.weight_sync.max_updating if cfg.weight_sync.mode == "rolling" else None,
        )
        # A restarted policy replica loads the weights the others serve before it takes traffic.
        roles.policy.set_resync(resources.weights.resync)
        if cfg.rollout.workers:  # the groups are made in worker processes (rollout_workers.py)
            workers, settings = cfg.rollout.workers, GroupSettings.from_config(cfg, model_path)
            roles.rollout, views = await start_rollout_workers(roles, workers, settings, **fault_options(cfg))
        watches = []
        pool = resources.host_pool
        if pool is not None and pool.job is not None:  # a job that ends stops the run
            watches.append(asyncio.create_task(pool.watch_job(), name="job-watch"))
        training = TrainingRun(
            cfg, model_path, roles, resources, watch, terminal, started=t_start, resume_from=resume_from, plan=plan
        )
        await training.run(watches)
        return training.summary()
    except Exception as exc:
        root = watch.error if watch.error is not None else exc  # a role gone for good is the root cause
        gone = await job_gone(resources)
        root = gone if gone is not None else root  # ...unless the hosts' job stopped under it
        if isinstance(root, RoleFailed) and root.role == "trainer" and "the run stopped:" not in root.detail:
            raise RoleFailed("trainer", f"{root.detail}; the run stopped: {resume_hint(cfg)}") from exc
        if root is not exc:
            raise root from exc
        raise
    finally:
        await stop_rollout_workers(roles, views)
        watch.stopping = True  # stays installed: late reports of stopped processes are silenced
        await stop_roles(roles)
        resources.close()  # after the roles: their processes run on its hosts


main = cli.entry("grpo", "apps.grpo.config:GRPOConfig", run, __doc__, failures=(RoleFailed,))


if __name__ == "__main__":
    sys.exit(main())
