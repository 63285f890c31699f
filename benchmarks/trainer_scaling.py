"""The sharded trainer: two FSDP2 ranks against one, on the same batches, side by side.

    python benchmarks/trainer_scaling.py --out trainer_scaling.json
    python benchmarks/trainer_scaling.py --hidden-size 512 --num-layers 4 --episodes 32 --steps 5

A tiny-vocabulary model big enough that compute dominates (>= 10 M parameters by default) is
trained by a ``Trainer`` with ``procs=1`` and one with ``procs=2`` (gloo, one torch thread per
rank), both alive at once but never running at the same time: each step runs on one, then on
the other, with the same batch. Figures:

- ``trainer_procs2_vs_procs1_step_time``: median step time (the trainer's ``train_s``, steps
  after the first) of 2 ranks / 1 rank (goal <= 0.65).
- ``rank_state_bytes_procs2_vs_procs1``: parameters plus optimizer state held by the fuller of
  the two ranks / held by the single rank (goal <= 0.6).
- ``publish_s``: seconds to get the full weights into the controller (``call_spmd(weights)``:
  the gather into rank 0 plus the message), median of 3, per world size.
- ``max_abs_weight_diff_procs2_vs_procs1``: after 3 steps (goal <= 1e-5).
- ``rank0_cpu_s_procs2_vs_procs1`` (diagnostic): CPU seconds rank 0's process spent in a step,
  2 ranks / 1 rank: the share of the work one rank does. On a machine without two free cores
  the step time cannot fall below the one-rank time, but this ratio still shows the split.
- ``no_communication_floor_vs_procs1_step_time`` (diagnostic): two independent one-rank
  trainers, each training on one half of the same batch at the same time, no collective at all:
  the slower one's step time / the one-rank step time. It is the best the machine allows two
  ranks; whatever ``trainer_procs2_vs_procs1_step_time`` lies above it is the price of FSDP2's
  collectives.

The default batch is 128 episodes, a GRPO step of 16 prompts x a group of 8 (the collectives'
cost is fixed per step, the compute grows with the tokens, so a smaller batch measures mostly
communication).

The load average is recorded before and after: other work on the machine slows the two-rank
trainer most (it needs two free cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import forge.controller  # noqa: F401  (before monarch)
from forge.controller import quiet_monarch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COMPARE_AFTER_STEPS = 3


def make_batches(model_path: Path, episodes: int, steps: int, seed: int = 0) -> list[Any]:
    """``steps`` batches of ``episodes`` episodes with prompts and responses of mixed lengths."""
    import torch

    from forge.types import Episode, EpisodeBatch

    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        out = []
        for i in range(episodes):
            prompt = torch.randint(4, 60, (int(torch.randint(8, 17, (1,), generator=gen)),), generator=gen)
            response = torch.randint(4, 60, (int(torch.randint(16, 33, (1,), generator=gen)),), generator=gen)
            behaviour = -4.0 + 0.1 * torch.randn(response.shape, generator=gen)
            out.append(
                Episode(f"g{i // 8}", prompt, response, behaviour, behaviour.clone(), 0.0, 1.0 if i % 2 else -1.0, 0)
            )
        batches.append(EpisodeBatch.pack(out))
    return batches


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from forge.actors.trainer import Trainer, TrainerConfig
    from forge.controller import ForgeActor
    from forge.distributed import call_spmd
    from forge.models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(
            Path(tmp) / "model", hidden_size=args.hidden_size, num_layers=args.num_layers, init_std=0.02
        )
        batches = make_batches(path, args.episodes, args.steps)
        config = TrainerConfig(
            model_path=str(path),
            lr=1e-4,
            max_grad_norm=1.0,
            num_threads=1,
            reshard_after_forward=not args.keep_gathered,
        )
        env = {"OMP_NUM_THREADS": "1"}
        load_before = os.getloadavg()
        trainers = {n: await Trainer.options(procs=n, name=f"scaling{n}", env=env).as_actor(config) for n in (1, 2)}
        halves = [await Trainer.options(procs=1, name=f"half{i}", env=env).as_actor(config) for i in (0, 1)]
        try:
            params = await trainers[1].state_bytes.call_one()
            step_s: dict[int, list[float]] = {1: [], 2: []}
            cpu_s: dict[int, list[float]] = {1: [], 2: []}
            floor_s: list[float] = []
            after: dict[int, dict[str, torch.Tensor]] = {}
            for step, batch in enumerate(batches, start=1):
                for n, trainer in trainers.items():
                    stats = await call_spmd(trainer.train_step, batch)
                    step_s[n].append(stats["train_s"])
                    cpu_s[n].append(stats["train_cpu_s"])
                    if step == COMPARE_AFTER_STEPS:
                        after[n], _ = await call_spmd(trainer.weights)
                first, second = batch.split([len(batch) // 2, len(batch) - len(batch) // 2])
                stats = await asyncio.gather(
                    halves[0].train_step.call_one(first), halves[1].train_step.call_one(second)
                )
                floor_s.append(max(s["train_s"] for s in stats))
            publish: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(3):
                for n, trainer in trainers.items():
                    t0 = time.perf_counter()
                    await call_spmd(trainer.weights)
                    publish[n].append(time.perf_counter() - t0)
            state = {n: max((await t.state_bytes.call()).values()) for n, t in trainers.items()}
        finally:
            everyone = [*trainers.values(), *halves]
            await asyncio.gather(*(ForgeActor.shutdown(t) for t in everyone), return_exceptions=True)
        load_after = os.getloadavg()

    n_params = sum(t.numel() for t in after[1].values())
    median_step = {n: statistics.median(v[1:] if len(v) > 1 else v) for n, v in step_s.items()}
    median_cpu = {n: statistics.median(v[1:] if len(v) > 1 else v) for n, v in cpu_s.items()}
    diff = max(float((after[1][k] - after[2][k]).abs().max()) for k in after[1])
    return {
        "trainer_procs2_vs_procs1_step_time": median_step[2] / median_step[1],
        "rank_state_bytes_procs2_vs_procs1": state[2] / state[1],
        "publish_s": {str(n): statistics.median(v) for n, v in publish.items()},
        "max_abs_weight_diff_procs2_vs_procs1": diff,
        "step_s": {str(n): v for n, v in step_s.items()},
        "rank0_cpu_s_procs2_vs_procs1": median_cpu[2] / median_cpu[1],
        "no_communication_floor_vs_procs1_step_time": statistics.median(floor_s[1:]) / median_step[1],
        "no_communication_floor_step_s": floor_s,
        "rank0_cpu_s": {str(n): v for n, v in cpu_s.items()},
        "rank_state_bytes": {str(n): v for n, v in state.items()},
        "model_parameters": n_params,
        "parameter_bytes_one_rank_before_training": params,
        "episodes_per_step": args.episodes,
        "reshard_after_forward": not args.keep_gathered,
        "steps": args.steps,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "cpu_count": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    quiet_monarch()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=128, help="episodes per step (even: two equal shares)")
    parser.add_argument("--steps", type=int, default=5, help=f"steps (>= {COMPARE_AFTER_STEPS})")
    parser.add_argument(
        "--keep-gathered",
        action="store_true",
        help="trainer.reshard_after_forward=false: one all-gather per layer and step instead of two",
    )
    parser.add_argument("--out", help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    if args.steps < COMPARE_AFTER_STEPS or args.episodes % 2:
        parser.error(f"--steps must be >= {COMPARE_AFTER_STEPS} and --episodes even")
    result = asyncio.run(measure(args))
    goals = {
        "trainer_procs2_vs_procs1_step_time": ("<=", 0.65),
        "rank_state_bytes_procs2_vs_procs1": ("<=", 0.6),
        "max_abs_weight_diff_procs2_vs_procs1": ("<=", 1e-5),
    }
    print(f"model: {result['model_parameters'] / 1e6:.1f} M parameters, {args.episodes} episodes per step")
    for name, (op, goal) in goals.items():
        value = result[name]
        print(f"{name:40s} {value:12.4g}   goal {op} {goal:g}   {'met' if value <= goal else 'NOT met'}")
    for name in ("rank0_cpu_s_procs2_vs_procs1", "no_communication_floor_vs_procs1_step_time"):
        print(f"{name:40s} {result[name]:12.4g}   (diagnostic)")
    print(f"{'publish_s':40s} " + ", ".join(f"procs={n}: {v:.3f}s" for n, v in result["publish_s"].items()))
    print(f"load average before {result['load_average_before']}, after {result['load_average_after']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
