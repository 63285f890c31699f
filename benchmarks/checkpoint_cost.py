"""What a checkpoint every step costs the step loop: written in the background against in place.

    python benchmarks/checkpoint_cost.py --out checkpoint_cost.json

The 10.5 M-parameter model and 128-episode batches of ``benchmarks/trainer_scaling.py`` go to
three one-rank ``Trainer``s alive at once, each taking every step in turn: one that never
checkpoints, one with ``async_checkpoint=False`` (the save returns when the folder is in place)
and one with ``async_checkpoint=True`` (it returns once the state is copied to memory; the files
are written while the next step runs). After each step the two checkpointing trainers save, and
the controller times the call: the checkpoint's critical path. Figures:

- ``checkpoint_critical_path_s_vs_step_s``: median save call / median step time, background
  writes (the goal's key), and the same for in-place saves;
- ``step_s_with_background_write_vs_none``: median step time of the background-writing trainer
  over that of the one that never checkpoints (what the write running beside a step costs it on
  shared cores).
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

MODES = {"none": None, "in_place": False, "background": True}
"""Each trainer's ``async_checkpoint``; None: no checkpoints."""


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.trainer_scaling import make_batches
    from forge.actors.trainer import Trainer, TrainerConfig
    from forge.controller import ForgeActor
    from forge.distributed import call_spmd
    from forge.models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(
            Path(tmp) / "model", hidden_size=args.hidden_size, num_layers=args.num_layers, init_std=0.02
        )
        batches = make_batches(path, args.episodes, args.steps)
        load_before = os.getloadavg()
        trainers = {}
        for name, background in MODES.items():
            folder = None if background is None else str(Path(args.checkpoint_root or tmp) / f"ckpt-{name}")
            config = TrainerConfig(
                model_path=str(path),
                lr=1e-4,
                num_threads=1,
                pack_sequences=True,
                checkpoint_dir=folder,
                async_checkpoint=bool(background),
            )
            options = Trainer.options(procs=1, name=f"checkpoint-{name}", env={"OMP_NUM_THREADS": "1"})
            trainers[name] = await options.as_actor(config)
        try:
            step_s: dict[str, list[float]] = {name: [] for name in MODES}
            save_s: dict[str, list[float]] = {name: [] for name in MODES if MODES[name] is not None}
            for step, batch in enumerate(batches, start=1):
                for name, trainer in trainers.items():
                    t0 = time.perf_counter()
                    await asyncio.wait_for(call_spmd(trainer.train_step, batch), 600)
                    step_s[name].append(time.perf_counter() - t0)
                    if name in save_s:
                        t0 = time.perf_counter()
                        await asyncio.wait_for(call_spmd(trainer.save_checkpoint, step), 600)
                        save_s[name].append(time.perf_counter() - t0)
            await asyncio.wait_for(call_spmd(trainers["background"].wait_checkpoint), 600)
        finally:
            await asyncio.gather(*(ForgeActor.shutdown(t) for t in trainers.values()), return_exceptions=True)
        checkpoint_bytes = sum(
            f.stat().st_size for f in (Path(args.checkpoint_root or tmp) / "ckpt-in_place").rglob("*") if f.is_file()
        ) / max(1, min(args.steps, 2))
    median = {name: statistics.median(v[1:] if len(v) > 1 else v) for name, v in step_s.items()}
    saves = {name: statistics.median(v[1:] if len(v) > 1 else v) for name, v in save_s.items()}
    return {
        "checkpoint_critical_path_s_vs_step_s": saves["background"] / median["background"],
        "in_place_checkpoint_s_vs_step_s": saves["in_place"] / median["in_place"],
        "step_s_with_background_write_vs_none": median["background"] / median["none"],
        "median_step_s": median,
        "median_save_call_s": saves,
        "checkpoint_bytes": checkpoint_bytes,
        "step_s": step_s,
        "save_call_s": save_s,
        "episodes_per_step": args.episodes,
        "steps": args.steps,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    quiet_monarch()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkpoint-root", help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--out", help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args))
    for key in ("checkpoint_critical_path_s_vs_step_s", "in_place_checkpoint_s_vs_step_s"):
        print(f"{key:40s} {result[key]:.3f}")
    print(f"{'step_s_with_background_write_vs_none':40s} {result['step_s_with_background_write_vs_none']:.3f}")
    print(f"{'median_step_s':40s} {result['median_step_s']}")
    print(f"{'median_save_call_s':40s} {result['median_save_call_s']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
