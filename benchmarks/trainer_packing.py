"""Sequence packing in the trainer: the same batches trained right-padded and packed, side by side.

    python benchmarks/trainer_packing.py --out trainer_packing.json

The 10.5 M-parameter model and the 128-episode batches of ``benchmarks/trainer_scaling.py``
(16 prompts x a group of 8; prompts of 8-16 tokens, responses of 16-32) go to two one-rank
``Trainer``s, one with ``pack_sequences=False`` and one with ``pack_sequences=True``, alive at
once and taking each step in turn. Figures:

- ``packed_vs_padded_step_time``: median step time (steps after the first), packed / padded;
- ``padding_fraction``: pad tokens / all tokens the forward computed, for each;
- ``max_abs_weight_diff_packed_vs_padded`` after the last step (the same update to float
  rounding: packing changes which tokens share a row, not what each token attends to).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import forge.controller  # noqa: F401  (before monarch)
from forge.controller import quiet_monarch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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
        modes = {"padded": False, "packed": True}
        trainers = {}
        for name, pack in modes.items():
            config = TrainerConfig(model_path=str(path), lr=1e-4, max_grad_norm=1.0, num_threads=1, pack_sequences=pack)
            options = Trainer.options(procs=1, name=f"packing-{name}", env={"OMP_NUM_THREADS": "1"})
            trainers[name] = await options.as_actor(config)
        try:
            step_s: dict[str, list[float]] = {name: [] for name in modes}
            padding: dict[str, float] = {}
            for batch in batches:
                for name, trainer in trainers.items():
                    stats = await call_spmd(trainer.train_step, batch)
                    step_s[name].append(stats["train_s"])
                    padding[name] = stats["padding_fraction"]
            weights = {name: (await call_spmd(t.weights))[0] for name, t in trainers.items()}
        finally:
            await asyncio.gather(*(ForgeActor.shutdown(t) for t in trainers.values()), return_exceptions=True)
    median = {name: statistics.median(v[1:] if len(v) > 1 else v) for name, v in step_s.items()}
    diff = max(float((weights["packed"][k] - weights["padded"][k]).abs().max()) for k in weights["padded"])
    return {
        "packed_vs_padded_step_time": median["packed"] / median["padded"],
        "padding_fraction": padding,
        "max_abs_weight_diff_packed_vs_padded": diff,
        "step_s": step_s,
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
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args))
    print(f"packed_vs_padded_step_time           {result['packed_vs_padded_step_time']:.3f}")
    print(f"padding_fraction                     {result['padding_fraction']}")
    print(f"max_abs_weight_diff_packed_vs_padded {result['max_abs_weight_diff_packed_vs_padded']:.3g}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
