"""GRPO on Monarch actors: a vLLM policy, a reference model, rewards, a trainer, a replay buffer.

Run (the tiny model is made on the fly if missing; about 2 minutes on a 2-core CPU):

    python -m apps.grpo.main --config configs/grpo_tiny.yaml
    python -m apps.grpo.main --config configs/grpo_tiny.yaml trainer.lr=3e-4 group_size=8
    python -m apps.grpo.main --config configs/qwen3_1_7b.yaml model.path=/path/to/Qwen3-1.7B

The loop, top to bottom:

1. Rollouts run continuously, ``rollout.concurrency`` prompts in flight: a prompt from the
   dataset -> ``group_size`` completions from the policy service (prebatched with the other
   prompts in flight, routed by prompt) -> a reward and reference logprobs for every completion
   (both prebatched services) -> group-normalised advantages -> one group into the buffer.
2. Training waits for ``prompts_per_step`` groups that are at most ``max_policy_age`` versions
   old, takes one optimizer step, and syncs the new weights into every policy replica after
   every step (the policy loads them as soon as its generation batch in flight is done).
   Rollouts never stop for training: what they sample while a step runs is one version stale,
   and the loss's importance ratio (against the behaviour logprobs) with PPO clipping corrects
   for it.

Simplifications: one optimizer step per batch (no PPO epochs); advantages are per group, not
per token; a group is trained on once; rollouts pause (backpressure) when
``rollout.max_buffered_groups`` are waiting, rather than generating data that would go stale.

Outputs in ``logging.output_dir``: ``metrics.jsonl`` (one line per step), ``reward_loss.png``
and TensorBoard events when ``tensorboard`` is installed. Any role's failure, or Ctrl-C, stops
every role and exits non-zero with a message naming the role.

Checkpoints: with ``trainer.checkpoint_every=N`` the trainer saves a full checkpoint under
``<output_dir>/checkpoints`` every N steps and at the last one (see ``resume``). A killed run
continues with the same command plus ``--resume``: same step numbers, ``metrics.jsonl``
appended. A fresh run refuses an ``output_dir`` that already holds checkpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import forge.controller  # noqa: F401  (before anything imports monarch)
from forge.checkpoint import latest_checkpoint
from forge.controller import ForgeActor, ForgeError, quiet_monarch

logger = logging.getLogger("forge.grpo")

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class RoleFailed(Exception):
    """A role (policy, reference, reward, trainer, buffer, dataset) failed; the run stops."""

    def __init__(self, role: str, error: BaseException | str) -> None:
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        super().__init__(f"role '{role}' failed: {detail}")
        self.role = role


# ----------------------------------------------------------------------------- roles
@dataclass
class Roles:
    """Handles of every role; services are routed, actors are called with ``call_one``."""

    policy: Any = None
    reference: Any = None
    reward: Any = None
    trainer: Any = None
    buffer: Any = None
    dataset: Any = None
    local: list[Any] = field(default_factory=list)

    def services(self) -> dict[str, Any]:
        return {n: s for n, s in (("policy", self.policy), ("reference", self.reference), ("reward", self.reward)) if s is not None}


async def start_roles(cfg: Any, model_path: str) -> Roles:
    """Start every role concurrently; if one fails to start, stop the others and raise."""
    from monarch.actor import this_proc

    from forge.actors import (
        Dataset,
        DatasetConfig,
        Policy,
        PolicyConfig,
        PromptAffinity,
        ReferenceConfig,
        ReferenceModel,
        ReplayBuffer,
        RewardActor,
        Trainer,
        TrainerConfig,
    )

    p, t = cfg.policy, cfg.trainer
    policy_cfg = PolicyConfig(
        model_path=model_path,
        group_size=cfg.group_size,
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        max_model_len=p.max_model_len,
        seed=cfg.seed,
        dtype=p.dtype,
        kv_cache_bytes=p.kv_cache_bytes,
        engine_kwargs={"use_tqdm_on_load": False, **p.engine_kwargs},
    )
    reference_cfg = ReferenceConfig(model_path=model_path, temperature=p.temperature, dtype=cfg.reference.dtype)
    checkpoints = str(checkpoint_root(cfg)) if t.checkpoint_every else None
    trainer_cfg = TrainerConfig(
        model_path=model_path,
        lr=t.lr,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        temperature=p.temperature,
        clip_eps=t.clip_eps,
        clip_eps_high=t.clip_eps_high,
        beta=t.beta,
        micro_batch_size=t.micro_batch_size,
        dtype=t.dtype,
        publish_dtype=t.publish_dtype,
        seed=cfg.seed,
        num_threads=t.num_threads,
        checkpoint_dir=checkpoints,
        keep_checkpoints=t.keep_checkpoints,
    )
    dataset_cfg = DatasetConfig(
        source=cfg.data.source,
        path=cfg.data.path,
        prompt_template=cfg.data.prompt_template,
        seed=cfg.seed,
        options=dict(cfg.data.options),
    )
    # A role's failure ends the run (with a message naming it), so replicas are not restarted.
    # Libraries' progress bars and notices stay off the terminal unless a role's env says
    # otherwise; vLLM also gets one OpenMP thread (more were never faster for small models on
    # shared cores).
    quiet = {
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning,ignore::UserWarning:multiprocessing.resource_tracker",
    }
    policy_env = {**quiet, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR", **p.env}
    roles = Roles()

    gpus = assign_gpus(cfg)

    async def policy() -> None:
        _show_gpus(gpus["policy"])
        roles.policy = await Policy.options(
            name="policy", procs=p.procs, num_replicas=p.num_replicas, with_gpus=p.with_gpus,
            env=policy_env, endpoint_routers={"generate": PromptAffinity}, max_restarts=0,
        ).as_service(policy_cfg)

    async def reference() -> None:
        _show_gpus(gpus["reference"])
        r = cfg.reference
        roles.reference = await ReferenceModel.options(
            name="reference", procs=r.procs, num_replicas=r.num_replicas, with_gpus=r.with_gpus,
            env={**quiet, **r.env}, router="least_loaded", max_restarts=0,
        ).as_service(reference_cfg)

    async def reward() -> None:
        _show_gpus(gpus["reward"])
        r = cfg.reward
        roles.reward = await RewardActor.options(
            name="reward", procs=r.procs, num_replicas=r.num_replicas, with_gpus=r.with_gpus,
            env={**quiet, **r.env}, router="least_loaded", max_restarts=0,
        ).as_service(dict(r.fns))

    async def trainer() -> None:
        _show_gpus(gpus["trainer"])
        roles.trainer = await Trainer.options(
            name="trainer", procs=t.procs, with_gpus=t.with_gpus, env={**quiet, **t.env},
        ).as_actor(trainer_cfg)

    async def local() -> None:
        # Light roles live in the controller's process: no process start, no extra CPU.
        roles.buffer = this_proc().spawn("buffer", ReplayBuffer, cfg.max_policy_age, 4 * cfg.max_buffered_groups)
        roles.dataset = this_proc().spawn("dataset", Dataset, dataset_cfg)
        roles.local = [roles.buffer, roles.dataset]
        await asyncio.gather(roles.buffer.setup.call_one(), roles.dataset.setup.call_one())

    starters = {"policy": policy, "reference": reference, "reward": reward, "trainer": trainer, "buffer/dataset": local}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        results = await asyncio.gather(*(fn() for fn in starters.values()), return_exceptions=True)
    finally:
        _show_gpus(None if visible is None else visible.split(","), restore=True)
    for name, result in zip(starters, results):
        if isinstance(result, BaseException):
            await stop_roles(roles)
            raise RoleFailed(name, _describe(result)) from result
    return roles


GPU_ROLES = ("policy", "reference", "reward", "trainer")


def assign_gpus(cfg: Any) -> dict[str, list[str] | None]:
    """Disjoint GPU ids for the roles with ``with_gpus``, taken in order from the visible ones.

    forge's provisioner splits GPUs among the replicas of *one* service; separate services
    would each start counting at the first GPU, so the app gives each role its own slice.
    """
    from forge.controller.provisioner import visible_gpus

    need = {}
    for role in GPU_ROLES:
        section = getattr(cfg, role)
        if section.with_gpus:
            need[role] = section.procs * (section.num_replicas if role != "trainer" else 1)
    devices = visible_gpus() if need else []
    if sum(need.values()) > len(devices):
        wanted = ", ".join(f"{r} {n}" for r, n in need.items())
        raise ValueError(
            f"the roles with with_gpus need {sum(need.values())} GPUs ({wanted}) but {len(devices)} are visible "
            f"({devices}); set CUDA_VISIBLE_DEVICES, or lower procs/num_replicas"
        )
    out: dict[str, list[str] | None] = dict.fromkeys(GPU_ROLES)
    start = 0
    for role, n in need.items():
        out[role] = devices[start : start + n]
        start += n
    return out


def _show_gpus(devices: list[str] | None, restore: bool = False) -> None:
    """Make only ``devices`` visible to the next role started (None: leave or restore)."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    elif restore:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)


async def stop_roles(roles: Roles, timeout_s: float = 60.0) -> None:
    """Stop every started role (in parallel); never raises, never waits past ``timeout_s``."""
    stops = [svc.shutdown() for svc in roles.services().values()]
    if roles.trainer is not None:
        stops.append(ForgeActor.shutdown(roles.trainer))
    stops += [actor.stop() for actor in roles.local]

    async def stop(awaitable: Any) -> None:
        await awaitable

    try:
        await asyncio.wait_for(asyncio.gather(*(stop(s) for s in stops), return_exceptions=True), timeout_s)
    except asyncio.TimeoutError:
        logger.warning("some roles did not stop within %.0fs; their processes are reaped at exit", timeout_s)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:600]


# ----------------------------------------------------------------------------- rollouts
class Rollouts:
    """Continuous rollouts: ``concurrency`` workers, each turning one prompt into one group.

    Backpressure: a worker starts a new prompt only while fewer than ``max_buffered`` groups are
    in flight or waiting in the buffer, so rollouts stay about ``max_policy_age`` batches ahead
    of training instead of producing groups that would be evicted as stale.

    Messages to the dataset and the buffer are coalesced: prompts are fetched ``concurrency`` at
    a time, and finished groups go to the buffer together (whatever finished while the last
    ``add_many`` was in flight), so these light roles cost a few messages a step, not two per
    group.
    """

    def __init__(self, roles: Roles, group_size: int, concurrency: int, max_buffered: int) -> None:
        self.roles = roles
        self.group_size = group_size
        self.concurrency = concurrency
        self.max_buffered = max_buffered
        self.outstanding = 0  # groups in flight or in the buffer
        self.groups_added = 0
        self.room = asyncio.Condition()
        self.added = asyncio.Event()
        self._ids = itertools.count()
        self._prompts: collections.deque[Any] = collections.deque()
        self._fetching = asyncio.Lock()
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._storing = False

    def start(self) -> list[asyncio.Task]:
        """Start the workers; the caller owns (and cancels) the returned tasks."""
        return [asyncio.create_task(self._worker(i), name=f"rollout-{i}") for i in range(self.concurrency)]

    async def taken(self, n: int) -> None:
        """Training took ``n`` groups out of the buffer (or they were evicted)."""
        async with self.room:
            self.outstanding -= n
            self.room.notify_all()

    async def _worker(self, index: int) -> None:
        while True:
            async with self.room:
                await self.room.wait_for(lambda: self.outstanding < self.max_buffered)
                self.outstanding += 1
            await self._store(await self.one_group())

    async def _next_prompt(self) -> Any:
        async with self._fetching:
            if not self._prompts:
                self._prompts.extend(await _call("dataset", self.roles.dataset.sample_many.call_one(self.concurrency)))
            return self._prompts.popleft()

    async def _store(self, group: Any) -> None:
        """Add ``group`` to the buffer; the first waiter sends everyone's groups in one message."""
        done = asyncio.get_running_loop().create_future()
        self._pending.append((group, done))
        if self._storing:
            return await done
        self._storing = True
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await _call("buffer", self.roles.buffer.add_many.call_one([g for g, _ in batch]))
                except BaseException as exc:
                    # Everyone waiting shares the fate of the message (the leader re-raises).
                    for _, fut in batch + self._pending:
                        if fut is done or fut.done():
                            continue
                        if isinstance(exc, asyncio.CancelledError):
                            fut.cancel()
                        else:
                            fut.set_exception(exc)
                    self._pending = []
                    done.cancel()
                    raise
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(None)
                self.groups_added += len(batch)
                self.added.set()
        finally:
            self._storing = False
        await done

    async def one_group(self) -> Any:
        """Prompt -> completions -> rewards and reference logprobs -> scored episodes."""
        import torch

        from forge.actors import prompt_key
        from forge.losses import group_advantages
        from forge.observability import record_metric
        from forge.types import Episode, EpisodeBatch

        roles = self.roles
        prompt = await self._next_prompt()
        t0 = time.perf_counter()
        group = await _call("policy", roles.policy.generate.route(prompt, key=prompt_key(prompt)))
        t1 = time.perf_counter()
        completions = group.completions
        rewards, ref_logprobs = await asyncio.gather(
            _call("reward", roles.reward.score.route_many([(prompt, c.text) for c in completions])),
            _call("reference", roles.reference.logprobs.route_many([(c.prompt_ids, c.token_ids) for c in completions])),
        )
        record_metric("rollout/generate_latency_s", t1 - t0)
        record_metric("rollout/score_latency_s", time.perf_counter() - t1)
        advantages = group_advantages(torch.tensor(rewards, dtype=torch.float32))
        group_id = f"{prompt.prompt_id}#{next(self._ids)}"
        return EpisodeBatch.pack([
            Episode(
                group_id=group_id,
                prompt_ids=c.prompt_ids,
                response_ids=c.token_ids,
                behaviour_logprobs=c.logprobs,
                ref_logprobs=ref,
                reward=float(r),
                advantage=float(a),
                policy_version=c.policy_version,
            )
            for c, r, a, ref in zip(completions, rewards, advantages.tolist(), ref_logprobs)
        ])


async def _call(role: str, awaitable: Any) -> Any:
    """Await a call to ``role``; any failure becomes ``RoleFailed`` naming the role."""
    try:
        return await awaitable
    except asyncio.CancelledError:
        raise
    except RoleFailed:
        raise
    except Exception as exc:
        from forge.controller.replica import translate_error

        raise RoleFailed(role, _describe(translate_error(exc, role))) from exc


# ----------------------------------------------------------------------------- training
async def train(
    cfg: Any, roles: Roles, rollouts: Rollouts, log: "RunLog", after_step: int = 0, version: int = 0
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
            stats = await _call("trainer", roles.trainer.train_step.call_one(batch))
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
        sample = await _call("buffer", roles.buffer.sample.call_one(cfg.prompts_per_step, version))
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
        return await _call("trainer", roles.trainer.publish_weights.call_one(cfg.weight_sync.dir))
    return await _call("trainer", roles.trainer.weights.call_one())


async def push_weights(cfg: Any, roles: Roles, weights: Any, version: int) -> int:
    """Load ``weights`` (a state dict or a file path) into every policy replica."""
    from forge.observability import record_metric

    t0 = time.perf_counter()
    await _call("policy", roles.policy.update_weights.fanout(weights, version))
    record_metric("weight_sync/push_s", time.perf_counter() - t0)
    return version


async def sync_weights(cfg: Any, roles: Roles) -> int:
    """Publish the trainer's weights to every policy replica and wait; returns their version."""
    return await push_weights(cfg, roles, *(await fetch_weights(cfg, roles)))


# ----------------------------------------------------------------------------- checkpoints
def checkpoint_root(cfg: Any) -> Path:
    """Where the run's checkpoints go: ``<logging.output_dir>/checkpoints``."""
    return Path(cfg.logging.output_dir) / "checkpoints"


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
    root = checkpoint_root(cfg)
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
    position = await _call("dataset", roles.dataset.position.call_one())
    await _call("trainer", roles.trainer.save_checkpoint.call_one(step, {"dataset_position": position}))


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
    step, version, extra = await _call("trainer", roles.trainer.load_checkpoint.call_one(str(path)))
    await _call("dataset", roles.dataset.seek.call_one(int(extra.get("dataset_position", 0))))
    await sync_weights(cfg, roles)
    return step, version


# ----------------------------------------------------------------------------- logging
class RunLog:
    """Per-step metrics: the roles' records and the step's own, reduced, to every sink."""

    def __init__(self, cfg: Any, terminal: Any, resume_after: int | None = None) -> None:
        """``resume_after``: the checkpoint's step when resuming; the earlier steps' rows are
        kept (and count in the summary), later ones dropped. None starts a fresh record."""
        from forge.observability import MetricAggregator, make_sinks

        self.cfg = cfg
        self.out = Path(cfg.logging.output_dir)
        self.aggregator = MetricAggregator()
        self.sinks = make_sinks(list(cfg.logging.sinks), self.out, resume_after)
        if "console" in cfg.logging.sinks:
            logging.getLogger("forge.metrics").setLevel(logging.INFO)
        self.metrics_path = self.out / "metrics.jsonl"
        self.resume_after = resume_after
        self._drain: asyncio.Task | None = None
        self.rows: list[dict[str, float]] = []
        if resume_after is not None:
            self.rows = [json.loads(line) for line in self.metrics_path.read_text().splitlines()]
        self.bar = None
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=cfg.steps, initial=len(self.rows), desc="grpo", unit="step", file=terminal, dynamic_ncols=True
            )

    async def step(self, step: int, metrics: dict[str, float], roles: Roles) -> None:
        """Log one step: ``metrics`` plus what the services recorded, to every sink.

        The services' records are drained in the background: a drain message queues behind
        the batch a replica is running (a policy's generate), and awaiting it every step put
        about 0.18 s on each step of the tiny run. So a step's row holds the records of the
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
        row = self.aggregator.flush(step)
        self.rows.append(row)
        for sink in self.sinks:
            sink.log(step, row)
        if self.bar is not None:
            self.bar.set_postfix(
                reward=f"{row['reward_mean']:.3f}", loss=f"{row['loss']:.4f}", step_s=f"{row['step_time_s']:.2f}", refresh=False
            )
            self.bar.update(1)

    @staticmethod
    async def _drain_services(roles: Roles) -> list[list[Any]]:
        drains = [_call(name, svc.drain_metrics.fanout()) for name, svc in roles.services().items()]
        return list(await asyncio.gather(*drains))

    def _absorb(self, drained: list[list[Any]]) -> None:
        for records in drained:
            for replica_records in records:
                self.aggregator.extend(replica_records)

    def close(self) -> None:
        if self._drain is not None:
            self._drain.cancel()  # the run ended early: its records are not logged
            self._drain = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def plot(self) -> Path | None:
        if not self.rows or not self.cfg.logging.plot:
            return None
        from forge.observability import plot_run

        return plot_run(self.metrics_path, self.out / "reward_loss.png", keys=("reward_mean", "loss", "kl"))

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
            f"metrics {self.metrics_path}"
        )


# ----------------------------------------------------------------------------- the run
ROLE_MESH_PREFIXES = ("policy", "reference", "reward", "trainer")


class _FailureWatch:
    """Turns a role's process death (Monarch's fault hook) into a prompt failure naming the role.

    A role that dies while nobody is calling it (e.g. the trainer while the controller waits
    for rollouts) would otherwise be noticed only at its next call.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.failed = asyncio.Event()
        self.error: RoleFailed | None = None
        self.stopping = False

    def __call__(self, failure: Any) -> bool:
        if self.stopping:
            return True  # processes killed at shutdown (past their exit timeout) are expected
        mesh = str(getattr(failure, "mesh_name", ""))
        role = next((r for r in ROLE_MESH_PREFIXES if mesh.startswith(r)), None)
        if role is None:  # e.g. the hidden "logger-*" mesh that dies with every process
            return False

        def mark() -> None:
            if self.error is None:
                self.error = RoleFailed(role, f"its process died (mesh {mesh})")
                self.failed.set()

        self.loop.call_soon_threadsafe(mark)
        return False  # the owning service must see it too


async def run(cfg: Any, terminal: Any, resume_from: Path | None = None) -> str:
    """Start the roles (from checkpoint ``resume_from`` if given), train, stop; returns the summary."""
    from forge.controller.provisioner import add_fault_listener

    t_start = time.perf_counter()
    model_path = prepare_model(cfg)
    watch = _FailureWatch(asyncio.get_running_loop())
    add_fault_listener(watch)
    roles = Roles()
    log: RunLog | None = None
    rollouts: Rollouts | None = None
    tasks: list[asyncio.Task] = []
    try:
        roles = await start_roles(cfg, model_path)
        step, version = (0, 0) if resume_from is None else await resume(cfg, roles, resume_from)
        startup_s = time.perf_counter() - t_start
        log = RunLog(cfg, terminal, resume_after=None if resume_from is None else step)
        rollouts = Rollouts(roles, cfg.group_size, cfg.rollout_concurrency, cfg.max_buffered_groups)
        training = asyncio.create_task(train(cfg, roles, rollouts, log, step, version), name="train")
        watcher = asyncio.create_task(watch.failed.wait(), name="failure-watch")
        tasks = [training, watcher, *rollouts.start()]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            raise watch.error  # type: ignore[misc]
        for task in done:
            task.result()  # the training loop's error, or a rollout worker's (they never return)
        log.close()
        plot = log.plot()
        return log.summary(time.perf_counter() - t_start, startup_s) + (f"; plot {plot}" if plot else "")
    except Exception as exc:
        if watch.error is not None and exc is not watch.error:
            raise watch.error from exc  # the process death is the root cause: name it
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if log is not None:
            log.close()
        watch.stopping = True  # stays installed: late reports of stopped processes are silenced
        await stop_roles(roles)


def prepare_model(cfg: Any) -> str:
    """The checkpoint folder; makes the tiny model there first if the config asks for it."""
    path = Path(cfg.model.path)
    if cfg.model.tiny.make_if_missing:
        from forge.models import make_tiny_model

        t = cfg.model.tiny
        make_tiny_model(path, arch=t.arch, hidden_size=t.hidden_size, num_layers=t.num_layers, seed=t.seed, init_std=t.init_std)
    elif not path.is_dir():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a folder; point it at a Hugging Face checkpoint")
    return str(path.resolve())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m apps.grpo.main", description="GRPO training on Monarch actors (see the module docstring)."
    )
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/grpo_tiny.yaml")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in logging.output_dir from its newest checkpoint (<output_dir>/checkpoints, "
        "written every trainer.checkpoint_every steps): same step numbers, metrics.jsonl appended",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=3e-4 group_size=8")
    return parser.parse_intermixed_args(argv)


class Terminated(Exception):
    """SIGTERM arrived; the run was stopped cleanly."""


async def _run_until_signalled(cfg: Any, terminal: Any, resume_from: Path | None) -> str:
    """``run``, with SIGTERM handled like Ctrl-C: cancel, stop every role, then exit."""
    import signal

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await run(cfg, terminal, resume_from)
    except asyncio.CancelledError:
        if terminated:
            raise Terminated() from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the process exit code."""
    quiet_monarch()
    import monarch.config

    # Role processes linger after their actors stop (library threads); give them 1 s, not 10.
    monarch.config.configure(process_exit_timeout="1s")
    terminal = os.fdopen(os.dup(2), "w", buffering=1)  # the progress bar bypasses the log filter
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from forge.config import ConfigError, load_config

    from apps.grpo.config import GRPOConfig

    try:
        cfg = load_config(GRPOConfig, args.config, args.overrides)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"grpo: bad config: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        resume_from = checkpoint_to_resume(cfg, args.resume)
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"grpo: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        summary = asyncio.run(_run_until_signalled(cfg, terminal, resume_from))
    except KeyboardInterrupt:
        print("grpo: interrupted; every role was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("grpo: terminated (SIGTERM); every role was stopped", file=sys.stderr)
        return EXIT_TERMINATED
    except (RoleFailed, ForgeError, RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"grpo: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
