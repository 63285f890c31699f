"""GRPO on Monarch actors: a vLLM policy, a reference model, rewards, a trainer, a replay buffer.

Run (the tiny model is made on the fly if missing; about 3 minutes on a 2-core CPU):

    python -m apps.grpo.main --config configs/grpo_tiny.yaml
    python -m apps.grpo.main --config configs/grpo_tiny.yaml trainer.lr=3e-4 group_size=8
    python -m apps.grpo.main --config configs/qwen3_1_7b.yaml model.path=/path/to/Qwen3-1.7B

The loop, top to bottom:

1. Rollouts run continuously, ``rollout.concurrency`` prompts in flight: a prompt from the
   dataset -> ``group_size`` completions from the policy service (prebatched with the other
   prompts in flight, routed by prompt) -> a reward and reference logprobs for every completion
   (both prebatched services) -> group-normalised advantages -> one group into the buffer.
2. Training waits for ``prompts_per_step`` groups that are at most ``max_policy_age`` versions
   old, takes one optimizer step, and syncs the new weights into every policy replica before
   the next step. Rollouts never stop for training: what they sample while a step runs is one
   version stale, and the loss's importance ratio (against the behaviour logprobs) with PPO
   clipping corrects for it.

Simplifications: one optimizer step per batch (no PPO epochs); advantages are per group, not
per token; a group is trained on once; rollouts pause (backpressure) when
``rollout.max_buffered_groups`` are waiting, rather than generating data that would go stale.

Outputs in ``logging.output_dir``: ``metrics.jsonl`` (one line per step), ``reward_loss.png``
and TensorBoard events when ``tensorboard`` is installed. Any role's failure, or Ctrl-C, stops
every role and exits non-zero with a message naming the role.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import forge.controller  # noqa: F401  (before anything imports monarch)
from forge.controller import ForgeActor, ForgeError, quiet_monarch

logger = logging.getLogger("forge.grpo")

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


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
        engine_kwargs=dict(p.engine_kwargs),
    )
    reference_cfg = ReferenceConfig(model_path=model_path, temperature=p.temperature, dtype=cfg.reference.dtype)
    checkpoints = str(Path(cfg.logging.output_dir) / "checkpoints") if t.checkpoint_every else None
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
    )
    dataset_cfg = DatasetConfig(
        source=cfg.data.source,
        path=cfg.data.path,
        prompt_template=cfg.data.prompt_template,
        seed=cfg.seed,
        options=dict(cfg.data.options),
    )
    # vLLM: one OpenMP thread (more were never faster for small models on shared cores) and
    # only its errors on the terminal.
    policy_env = {"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR", **p.env}
    roles = Roles()

    async def policy() -> None:
        roles.policy = await Policy.options(
            name="policy", procs=p.procs, num_replicas=p.num_replicas, with_gpus=p.with_gpus,
            env=policy_env, endpoint_routers={"generate": PromptAffinity},
        ).as_service(policy_cfg)

    async def reference() -> None:
        r = cfg.reference
        roles.reference = await ReferenceModel.options(
            name="reference", procs=r.procs, num_replicas=r.num_replicas, with_gpus=r.with_gpus,
            env=dict(r.env), router="least_loaded",
        ).as_service(reference_cfg)

    async def reward() -> None:
        r = cfg.reward
        roles.reward = await RewardActor.options(
            name="reward", procs=r.procs, num_replicas=r.num_replicas, with_gpus=r.with_gpus,
            env=dict(r.env), router="least_loaded",
        ).as_service(dict(r.fns))

    async def trainer() -> None:
        roles.trainer = await Trainer.options(
            name="trainer", procs=t.procs, with_gpus=t.with_gpus, env=dict(t.env),
        ).as_actor(trainer_cfg)

    async def local() -> None:
        # Light roles live in the controller's process: no process start, no extra CPU.
        roles.buffer = this_proc().spawn("buffer", ReplayBuffer, cfg.max_policy_age, 4 * cfg.max_buffered_groups)
        roles.dataset = this_proc().spawn("dataset", Dataset, dataset_cfg)
        roles.local = [roles.buffer, roles.dataset]
        await asyncio.gather(roles.buffer.setup.call_one(), roles.dataset.setup.call_one())

    starters = {"policy": policy, "reference": reference, "reward": reward, "trainer": trainer, "buffer/dataset": local}
    results = await asyncio.gather(*(fn() for fn in starters.values()), return_exceptions=True)
    for name, result in zip(starters, results):
        if isinstance(result, BaseException):
            await stop_roles(roles)
            raise RoleFailed(name, _describe(result)) from result
    return roles


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
    in flight or waiting in the buffer, so rollouts stay at most about one batch ahead of
    training instead of producing groups that would be evicted as stale.
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
        self._tasks: list[asyncio.Task] = []

    def start(self) -> list[asyncio.Task]:
        self._tasks = [asyncio.create_task(self._worker(i), name=f"rollout-{i}") for i in range(self.concurrency)]
        return self._tasks

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

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
            group = await self.one_group()
            await _call("buffer", self.roles.buffer.add.call_one(group))
            self.groups_added += 1
            self.added.set()

    async def one_group(self) -> Any:
        """Prompt -> completions -> rewards and reference logprobs -> scored episodes."""
        import torch

        from forge.actors import prompt_key
        from forge.losses import group_advantages
        from forge.observability import record_metric
        from forge.types import Episode, EpisodeBatch

        roles = self.roles
        prompt = await _call("dataset", roles.dataset.sample.call_one())
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
async def train(cfg: Any, roles: Roles, rollouts: Rollouts, log: "RunLog") -> None:
    """The step loop: wait for a batch, one optimizer step, weight sync, log."""
    from forge.types import EpisodeBatch

    version = 0
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        groups = await wait_for_batch(cfg, roles, rollouts, version)
        t1 = time.perf_counter()
        batch = EpisodeBatch.concat(groups)
        stats = await _call("trainer", roles.trainer.train_step.call_one(batch))
        t2 = time.perf_counter()
        version = int(stats["policy_version"])
        await sync_weights(cfg, roles)
        t3 = time.perf_counter()
        if cfg.trainer.checkpoint_every and step % cfg.trainer.checkpoint_every == 0:
            await _call("trainer", roles.trainer.save_checkpoint.call_one())
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
                "sync_s": t3 - t2,
            },
            roles,
        )


async def wait_for_batch(cfg: Any, roles: Roles, rollouts: Rollouts, version: int) -> list[list[Any]]:
    """``prompts_per_step`` groups fresh enough for ``version``; waits for rollouts if needed."""
    while True:
        rollouts.added.clear()
        sample = await _call("buffer", roles.buffer.sample.call_one(cfg.prompts_per_step, version))
        taken = sample.evicted + (len(sample.groups) if sample.groups is not None else 0)
        if taken:
            await rollouts.taken(taken)
        if sample.groups is not None:
            return sample.groups
        await rollouts.added.wait()


async def sync_weights(cfg: Any, roles: Roles) -> int:
    """Publish the trainer's weights to every policy replica; returns their version."""
    if cfg.weight_sync.transport == "file":
        path, version = await _call("trainer", roles.trainer.publish_weights.call_one(cfg.weight_sync.dir))
        await _call("policy", roles.policy.update_weights.fanout(path, version))
    else:
        state_dict, version = await _call("trainer", roles.trainer.weights.call_one())
        await _call("policy", roles.policy.update_weights.fanout(state_dict, version))
    return version


# ----------------------------------------------------------------------------- logging
class RunLog:
    """Per-step metrics: the roles' records and the step's own, reduced, to every sink."""

    def __init__(self, cfg: Any, terminal: Any) -> None:
        from forge.observability import MetricAggregator, make_sinks

        self.cfg = cfg
        self.out = Path(cfg.logging.output_dir)
        self.aggregator = MetricAggregator()
        self.sinks = make_sinks(list(cfg.logging.sinks), self.out)
        if "console" in cfg.logging.sinks:
            logging.getLogger("forge.metrics").setLevel(logging.INFO)
        self.metrics_path = self.out / "metrics.jsonl"
        self.rows: list[dict[str, float]] = []
        self.bar = None
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, desc="grpo", unit="step", file=terminal, dynamic_ncols=True)

    async def step(self, step: int, metrics: dict[str, float], roles: Roles) -> None:
        """Log one step: ``metrics`` plus what the services recorded since the last step."""
        from forge.observability import drain_local_metrics

        drains = [svc.drain_metrics.fanout() for svc in roles.services().values()]
        for records in await asyncio.gather(*drains):
            for replica_records in records:
                self.aggregator.extend(replica_records)
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

    def close(self) -> None:
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
        return (
            f"grpo: {len(rewards)} steps in {elapsed_s:.1f}s (startup {startup_s:.1f}s); "
            f"reward first-{k} {first:.3f} -> last-{k} {last:.3f}; final loss {self.rows[-1]['loss']:.4f}; "
            f"metrics {self.metrics_path}"
        )


# ----------------------------------------------------------------------------- the run
class _FailureWatch:
    """Turns a role's process death (Monarch's fault hook) into a prompt, named failure."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.failed = asyncio.Event()
        self.message = ""

    def __call__(self, failure: Any) -> bool:
        mesh = str(getattr(failure, "mesh_name", "?"))
        role = next((r for r in ("policy", "reference", "reward", "trainer") if mesh.startswith(r)), mesh)

        def mark() -> None:
            if not self.failed.is_set():
                self.message = f"role '{role}' failed: its process died (mesh {mesh})"
                self.failed.set()

        self.loop.call_soon_threadsafe(mark)
        return False  # let the owning service see it too


async def run(cfg: Any, terminal: Any) -> str:
    """Start the roles, train, and stop everything; returns the summary line."""
    from forge.controller.provisioner import add_fault_listener, remove_fault_listener

    t_start = time.perf_counter()
    model_path = prepare_model(cfg)
    watch = _FailureWatch(asyncio.get_running_loop())
    add_fault_listener(watch)
    roles = Roles()
    log: RunLog | None = None
    rollouts: Rollouts | None = None
    try:
        roles = await start_roles(cfg, model_path)
        startup_s = time.perf_counter() - t_start
        log = RunLog(cfg, terminal)
        rollouts = Rollouts(roles, cfg.group_size, cfg.rollout_concurrency, cfg.max_buffered_groups)
        workers = rollouts.start()
        trainer_task = asyncio.create_task(train(cfg, roles, rollouts, log), name="train")
        watcher = asyncio.create_task(watch.failed.wait(), name="failure-watch")
        done, _ = await asyncio.wait({trainer_task, watcher, *workers}, return_when=asyncio.FIRST_COMPLETED)
        if trainer_task in done:
            trainer_task.result()  # raises the training loop's error, if any
        elif watcher in done:
            raise RuntimeError(watch.message)
        else:
            for task in done:
                task.result()  # a rollout worker never returns; it raised
        for task in (trainer_task, watcher):
            task.cancel()
        log.close()
        plot = log.plot()
        elapsed = time.perf_counter() - t_start
        return log.summary(elapsed, startup_s) + (f"; plot {plot}" if plot else "")
    except Exception:
        if watch.failed.is_set():  # the process death is the root cause; say so first
            raise RuntimeError(watch.message)
        raise
    finally:
        if rollouts is not None:
            await rollouts.stop()
        if log is not None:
            log.close()
        await stop_roles(roles)
        remove_fault_listener(watch)


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


def parse_args(argv: list[str] | None) -> tuple[str, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m apps.grpo.main", description="GRPO training on Monarch actors (see the module docstring)."
    )
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/grpo_tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=3e-4 group_size=8")
    args = parser.parse_args(argv)
    return args.config, args.overrides


def main(argv: list[str] | None = None) -> int:
    """Entry point: returns the process exit code."""
    quiet_monarch()
    terminal = os.fdopen(os.dup(2), "w", buffering=1)  # the progress bar bypasses the log filter
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config_path, overrides = parse_args(argv)
    from forge.config import ConfigError, load_config

    from apps.grpo.config import GRPOConfig

    try:
        cfg = load_config(GRPOConfig, config_path, overrides)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"grpo: bad config: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        summary = asyncio.run(run(cfg, terminal))
    except KeyboardInterrupt:
        print("grpo: interrupted; every role was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RoleFailed, ForgeError, RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"grpo: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
