"""The policy's two engine modes side by side: one batched call per batch, or one async request per prompt.

    python benchmarks/policy_engine.py --config configs/grpo_tiny.yaml --out policy_engine.json
    python benchmarks/policy_engine.py --config configs/grpo_tiny.yaml --prompts 16,64 --rounds 30 policy.max_tokens=16

``PolicyConfig.engine_mode`` picks how a prebatched batch of prompts reaches vLLM:

- ``batched``: ``VllmEngine.generate``, one ``LLM.generate`` call for the whole batch (vLLM
  batches prompts x ``group_size`` samples itself), in-process engine.
- ``async``: ``AsyncVllmEngine.generate``, vLLM's ``AsyncLLM`` fed one request per prompt, all
  in flight at once (engine core in a child process).

Both engines start in this process with the config's policy settings (model, ``max_model_len``,
``kv_cache_bytes``, ``engine_kwargs``) and sample the config's ``group_size`` completions of
``max_tokens`` tokens at its temperature, for batches of ``--prompts`` toy-task prompts (the
GRPO app's policy sees ~64-prompt batches with grpo_tiny.yaml). Rounds alternate which mode
goes first, so load drift on shared cores hits both alike. For each batch size it reports the
median per-batch latency over ``--rounds``, prompts/s and tokens/s at that median, and
``async_over_batched`` = async median latency / batched median latency (> 1: batched is faster).

Measured on 2 shared CPU cores, grpo_tiny.yaml (group 8, 3 tokens, 16 MiB KV cache), 25
rounds, medians (a second run with a 32 MiB cache gave ratios 1.71, 1.44, 1.28; with 16
tokens per completion, 1.16 and 1.25 for 16 and 64 prompts):

    prompts  batched ms  async ms  batched prompts/s  async prompts/s  async/batched
    16             25.1      40.6                637              394           1.62
    64            107.2     146.3                597              437           1.37
    256           404.8     522.2                632              490           1.29

so ``batched`` is the default (``PolicyConfig.engine_mode``). Prints a table; ``--out`` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("batched", "async")


def _model_dir(cfg: Any) -> str:
    """The config's checkpoint folder, with the tiny model made there first if it asks for it."""
    path = Path(cfg.model.path)
    if cfg.model.tiny.make_if_missing:
        from forge.models import make_tiny_model

        t = cfg.model.tiny
        make_tiny_model(
            path, arch=t.arch, hidden_size=t.hidden_size, num_layers=t.num_layers, seed=t.seed, init_std=t.init_std
        )
    elif not path.is_dir():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a folder")
    return str(path.resolve())


def _prompts(cfg: Any, count: int) -> list[str]:
    """``count`` prompt texts of the config's toy task (the GRPO app's data)."""
    from forge.data.tasks import ToyTask

    if cfg.data.source != "toy":
        raise ValueError(f"this benchmark samples the toy task; data.source is {cfg.data.source!r}")
    task = ToyTask(seed=cfg.seed, **cfg.data.options)
    return [task[i].text for i in range(count)]


async def measure(cfg: Any, sizes: list[int], rounds: int) -> dict[str, Any]:
    """Latency of each mode for each batch size, rounds interleaved."""
    from forge.generation import AsyncVllmEngine, VllmEngine

    p = cfg.policy
    model_dir = _model_dir(cfg)
    args = dict(max_model_len=p.max_model_len, seed=cfg.seed, dtype=p.dtype, kv_cache_bytes=p.kv_cache_bytes)
    args.update({"use_tqdm_on_load": False, **p.engine_kwargs})
    sample = dict(n=cfg.group_size, temperature=p.temperature, max_tokens=p.max_tokens)
    t0 = time.perf_counter()
    batched = VllmEngine.create(model_dir, **args)
    start_s = {"batched": time.perf_counter() - t0}
    t0 = time.perf_counter()
    async_engine = await AsyncVllmEngine.create(model_dir, **args)
    start_s["async"] = time.perf_counter() - t0

    async def run(mode: str, texts: list[str]) -> tuple[float, int]:
        t = time.perf_counter()
        if mode == "batched":
            groups = batched.generate(texts, **sample)
        else:
            groups = await async_engine.generate(texts, **sample)
        seconds = time.perf_counter() - t
        return seconds, sum(int(c.token_ids.numel()) for g in groups for c in g)

    results = []
    try:
        for size in sizes:
            texts = _prompts(cfg, size)
            for mode in MODES * 2:  # warm-up
                await run(mode, texts)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            tokens: dict[str, list[int]] = {m: [] for m in MODES}
            for r in range(rounds):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    seconds, n_tokens = await run(mode, texts)
                    times[mode].append(seconds)
                    tokens[mode].append(n_tokens)
            row: dict[str, Any] = {"prompts": size, "group_size": cfg.group_size, "max_tokens": p.max_tokens}
            for mode in MODES:
                median = statistics.median(times[mode])
                row[mode] = {
                    "median_s": median,
                    "min_s": min(times[mode]),
                    "max_s": max(times[mode]),
                    "prompts_per_s": size / median,
                    "tokens_per_s": statistics.median(tokens[mode]) / median,
                    "times_s": times[mode],
                }
            row["async_over_batched"] = row["async"]["median_s"] / row["batched"]["median_s"]
            results.append(row)
            _print_row(row)
    finally:
        async_engine.shutdown()
        batched.shutdown()
    ratios = [r["async_over_batched"] for r in results]
    return {
        "config": {"model": model_dir, "engine_args": args, "sample": sample, "rounds": rounds},
        "start_s": start_s,
        "results": results,
        "faster": "batched" if statistics.median(ratios) > 1 else "async",
    }


def _print_row(row: dict[str, Any]) -> None:
    b, a = row["batched"], row["async"]
    shape = f"{row['prompts']} x {row['group_size']} x {row['max_tokens']}"
    print(
        f"{shape:>24} {b['median_s'] * 1e3:>10.1f} {a['median_s'] * 1e3:>9.1f}"
        f" {b['prompts_per_s']:>11.0f} {a['prompts_per_s']:>10.0f} {row['async_over_batched']:>14.2f}",
        flush=True,
    )


def main() -> None:
    from apps.grpo.config import GRPOConfig
    from forge.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/grpo_tiny.yaml", help="GRPO app config (policy settings, model)")
    parser.add_argument("--prompts", default="16,64,256", help="comma-separated batch sizes, in prompts")
    parser.add_argument("--rounds", type=int, default=25, help="measured rounds per batch size (medians over them)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. policy.max_tokens=16")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    cfg = load_config(GRPOConfig, args.config, args.overrides)
    sizes = [int(s) for s in args.prompts.split(",")]
    print(
        f"{'prompts x group x tokens':>24} {'batched ms':>10} {'async ms':>9}"
        f" {'batched p/s':>11} {'async p/s':>10} {'async/batched':>14}"
    )
    out = asyncio.run(measure(cfg, sizes, args.rounds))
    start = out["start_s"]
    print(f"faster: {out['faster']} (engine start: batched {start['batched']:.1f} s, async {start['async']:.1f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
