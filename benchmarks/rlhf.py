"""Learned rewards and preferences from one SFT checkpoint: a reward model, GRPO on it, PPO, DPO.

    .venv/bin/python benchmarks/rlhf.py --out rlhf.json

The workload is the addition task of ``scripts/sft_then_grpo.sh`` (3-digit sums written least
significant digit first, exact match the checker). The SFT app first makes the starting
checkpoint (``configs/sft_addition.yaml``, stopped at held-out accuracy 0.2; or ``--sft-model``),
then, one after the other, each in a process of its own on the same cores:

1. the reward-model app from it (``configs/rm_addition.yaml``, ``--rm-steps``) on the generated
   preference pairs (the correct sum over a near miss): ``rm_pairwise_accuracy``, its held-out
   pairwise accuracy (goal >= 0.9);
2. GRPO from it (``configs/grpo_addition.yaml``, ``--grpo-steps``) with **only** the learned
   reward (``reward.models``; the checker logged at weight 0, never trained on):
   ``rlhf_heldout_gain``, its held-out exact-match accuracy (the app's own evaluation, greedy,
   500 held-out prompts) at the last step minus at step 0 (goal >= +0.15 within 10 min); the same
   run with the checker as the reward is ``checker_heldout_gain``, for reference;
3. DPO from it (``configs/dpo_addition.yaml``, ``--dpo-steps``) on the same pairs:
   ``dpo_heldout_gain`` the same way (goal >= +0.10 within 5 min);
4. PPO from it (``configs/grpo_addition.yaml`` with ``algorithm=ppo`` and a critic from the same
   checkpoint, ``--critic-lr``), the checker as the reward, the same steps: ``ppo_heldout_gain``
   (goal >= +0.15), and beside the checker-reward GRPO run of 2. (``--parts checker``) each one's
   wall seconds to a held-out accuracy of ``--target`` (0.80) and their ratio
   (``ppo_vs_grpo_time_to_target``, PPO's over GRPO's: above 1, PPO is slower), with the critic's
   explained variance over the last 10 steps;
5. ``rm_prebatched_vs_unbatched_throughput``: the reward model as a one-replica ``RewardModel``
   service, scoring ``--requests`` held-out (prompt, response) requests sent at once (prebatched)
   against the same requests one at a time (each its own batch), requests per second, in this
   process (goal >= 5).

Every row records its wall seconds from process launch; the JSON (``--out``) holds each run's
evaluation curve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PYTHON = REPO / ".venv" / "bin" / "python"
GOALS = {
    "rm_pairwise_accuracy": 0.9,
    "rlhf_heldout_gain": 0.15,
    "dpo_heldout_gain": 0.10,
    "ppo_heldout_gain": 0.15,
    "rm_prebatched_vs_unbatched_throughput": 5.0,
}


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}


def run_app(app: str, config: str, out: Path, *overrides: str) -> dict[str, Any]:
    """``python -m apps.<app>.main`` to completion: its rows, summary line and wall seconds."""
    cmd = [str(PYTHON), "-m", f"apps.{app}.main", "--config", config, f"logging.output_dir={out}"]
    cmd += ["logging.progress_bar=false", *overrides]
    print(f"{app}:", " ".join(cmd[3:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env())
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"apps.{app} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    line = proc.stdout.strip().splitlines()[-1]
    print(f"  {line}\n  ({wall:.0f} s)", flush=True)
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "summary": line, "rows": rows, "folder": str(out)}


def eval_curve(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float, float]]:
    """``(eval/step, value, wall_s)`` of every evaluation in a run's rows."""
    return [(r["eval/step"], r[key], r["wall_s"]) for r in rows if key in r and "eval/step" in r]


def time_to(rows: list[dict[str, Any]], target: float, key: str = "eval/accuracy") -> float | None:
    """Wall seconds (from the run's launch) of the first evaluation at ``target`` or above; None if none."""
    return next((wall for _, value, wall in eval_curve(rows, key) if value >= target), None)


def gain(rows: list[dict[str, Any]], key: str = "eval/accuracy") -> tuple[float, float, float]:
    """The last evaluation's ``key`` minus the first's (step 0), and both."""
    curve = eval_curve(rows, key)
    if len(curve) < 2 or curve[0][0] != 0:
        raise RuntimeError(f"the run has no step-0 and final evaluation of {key}: {curve}")
    return curve[-1][1] - curve[0][1], curve[0][1], curve[-1][1]


async def rm_throughput(model: Path, data: Path, requests: int) -> dict[str, float]:
    """Requests per second of one reward-model replica, prebatched vs one request at a time."""
    import forge.controller  # noqa: F401  (before monarch)
    from forge.actors.reward_model import RewardModel, RewardModelConfig
    from forge.data import DataSource
    from forge.data.preferences import load_preference_pairs
    from forge.types import Prompt

    pairs = load_preference_pairs(DataSource(path=str(data), split="test"))
    items = [(Prompt(p.pair_id, p.prompt, p.chosen), text) for p in pairs for text in (p.chosen, p.rejected)]
    items = (items * (1 + requests // len(items)))[:requests]
    svc = await RewardModel.options(num_replicas=1, env={"OMP_NUM_THREADS": "1"}).as_service(
        RewardModelConfig(model_paths=[str(model)])
    )
    try:
        await asyncio.gather(*(svc.score.route(item) for item in items[:64]))  # warm up
        t0 = time.perf_counter()
        batched = await asyncio.gather(*(svc.score.route(item) for item in items))
        batched_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        alone = [await svc.score.route(item) for item in items]
        alone_s = time.perf_counter() - t0
    finally:
        await svc.shutdown()
    worst = max(abs(a[0] - b[0]) for a, b in zip(batched, alone))
    return {
        "requests": float(requests),
        "prebatched_per_s": requests / batched_s,
        "unbatched_per_s": requests / alone_s,
        "ratio": alone_s / batched_s,
        "max_score_difference": worst,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--work", default="outputs/bench_rlhf", help="the runs' folders")
    parser.add_argument("--sft-model", help="an existing SFT final_model (default: made first)")
    parser.add_argument("--rm-steps", type=int, default=800)
    parser.add_argument("--rm-lr", type=float, default=3e-4)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--dpo-steps", type=int, default=150)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--critic-lr", type=float, default=5e-4)
    parser.add_argument("--target", type=float, default=0.80, help="held-out accuracy PPO and GRPO are timed to")
    parser.add_argument("--parts", nargs="+", default=["rm", "rlhf", "checker", "ppo", "dpo", "throughput"])
    args = parser.parse_args(argv)
    work = (REPO / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"goals": GOALS, "runs": {}}
    t_start = time.perf_counter()

    sft = Path(args.sft_model).resolve() if args.sft_model else None
    if sft is None:
        run = run_app("sft", "configs/sft_addition.yaml", work / "sft")
        result["runs"]["sft"] = {k: v for k, v in run.items() if k != "rows"}
        sft = work / "sft" / "final_model"
    start = [f"model.path={sft}"]
    rm = work / "rm" / "final_model"
    if "rm" in args.parts:
        run = run_app(
            "rm",
            "configs/rm_addition.yaml",
            work / "rm",
            *start,
            f"steps={args.rm_steps}",
            f"trainer.lr={args.rm_lr}",
            "eval.every=100",
        )
        result["runs"]["rm"] = {**run, "curve": eval_curve(run.pop("rows"), "eval/pairwise_accuracy")}
        result["rm_pairwise_accuracy"] = result["runs"]["rm"]["curve"][-1][1]
    grpo = [
        *start,
        f"steps={args.grpo_steps}",
        "eval.every=20",
        "eval.samples=0",
        f"weight_sync.dir={work / 'weights'}",
    ]
    if "rlhf" in args.parts:
        learned = [
            "reward.fns={exact_match: 0.0}",
            f"reward.models={{{rm}: 1.0}}",
            "reward.normalize=running",
            "eval.reward={exact_match: 1.0}",
        ]
        run = run_app("grpo", "configs/grpo_addition.yaml", work / "grpo_rm", *grpo, *learned)
        rows = run.pop("rows")
        result["rlhf_heldout_gain"], first, last = gain(rows)
        checked = [
            (r["step"], r["reward/fn_exact_match"], r["reward/model_rm"]) for r in rows if "reward/model_rm" in r
        ]
        result["runs"]["grpo_rm"] = {
            **run,
            "curve": eval_curve(rows, "eval/accuracy"),
            "start": first,
            "end": last,
            "train_reward_checked_vs_learned": checked,
        }
    if "checker" in args.parts:
        run = run_app("grpo", "configs/grpo_addition.yaml", work / "grpo_checker", *grpo)
        rows = run.pop("rows")
        result["checker_heldout_gain"], first, last = gain(rows)
        result["runs"]["grpo_checker"] = {
            **run,
            "curve": eval_curve(rows, "eval/accuracy"),
            "start": first,
            "end": last,
            "time_to_target": time_to(rows, args.target),
        }
    if "ppo" in args.parts:
        critic = f'critic={{lr: {args.critic_lr}, warmup_steps: 10, num_threads: 1, env: {{OMP_NUM_THREADS: "1"}}}}'
        run = run_app("grpo", "configs/grpo_addition.yaml", work / "ppo", *grpo, "algorithm=ppo", critic)
        rows = run.pop("rows")
        result["ppo_heldout_gain"], first, last = gain(rows)
        late = [r["critic/explained_variance"] for r in rows[-10:]]
        result["runs"]["ppo"] = {
            **run,
            "curve": eval_curve(rows, "eval/accuracy"),
            "start": first,
            "end": last,
            "explained_variance_last10": sum(late) / len(late),
            "explained_variance_curve": [(r["step"], r["critic/explained_variance"]) for r in rows],
        }
        ppo_time = time_to(rows, args.target)
        grpo_time = result["runs"].get("grpo_checker", {}).get("time_to_target")
        result["ppo_vs_grpo"] = {
            "target": args.target,
            "ppo_time_s": ppo_time,
            "grpo_time_s": grpo_time,
            "ppo_explained_variance_last10": result["runs"]["ppo"]["explained_variance_last10"],
        }
        if ppo_time is not None and grpo_time is not None:
            result["ppo_vs_grpo_time_to_target"] = ppo_time / grpo_time
    if "dpo" in args.parts:
        run = run_app(
            "dpo",
            "configs/dpo_addition.yaml",
            work / "dpo",
            *start,
            f"steps={args.dpo_steps}",
            f"weight_sync.dir={work / 'weights'}",
        )
        rows = run.pop("rows")
        result["dpo_heldout_gain"], first, last = gain(rows)
        result["runs"]["dpo"] = {
            **run,
            "curve": eval_curve(rows, "eval/accuracy"),
            "start": first,
            "end": last,
            "pairwise": eval_curve(rows, "eval/pairwise_accuracy"),
        }
    if "throughput" in args.parts:
        data = REPO / "data" / "addition_3d_rev_preferences"
        tp = asyncio.run(rm_throughput(rm, data, args.requests))
        result["rm_prebatched_vs_unbatched_throughput"] = tp["ratio"]
        result["runs"]["rm_throughput"] = tp
    result["met"] = {k: result[k] >= v for k, v in GOALS.items() if isinstance(result.get(k), float)}
    result["wall_s"] = time.perf_counter() - t_start
    top = {k: v for k, v in result.items() if k != "runs"}
    print(json.dumps(top, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
