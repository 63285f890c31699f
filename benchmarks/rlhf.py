"""Learned rewards and preferences from one SFT checkpoint: a reward model, GRPO on it, PPO, DPO.

    .venv/bin/python benchmarks/rlhf.py --out rlhf.json

The workload is the addition task of ``scripts/sft_then_grpo.sh`` (3-digit sums written least
significant digit first, exact match the checker). The SFT app first makes the starting
checkpoint (``configs/sft_addition.yaml``, stopped at held-out accuracy 0.2; or ``--sft-model``),
then, one after the other, each in a process of its own on the same cores:

1. the reward-model app from it (``configs/rm_addition.yaml``, ``--rm-steps``) on the generated
   preference pairs (the correct sum over a near miss): ``rm_pairwise_accuracy``, its held-out
   pairwise accuracy (goal >= 0.9);
2. RLHF: GRPO from it (``configs/grpo_addition.yaml``) with **only** a learned reward
   (``reward.models``; the checker logged at weight 0, never trained on): ``rlhf_heldout_gain``,
   its held-out exact-match accuracy (the app's own evaluation, greedy, 500 held-out prompts) at
   the last step minus at step 0 (goal >= +0.15 within 10 min). Its reward model is trained in
   ``--rounds`` rounds on the near misses plus the policy's own mistakes: round 1's negatives are
   the SFT model's samples at temperature 1 (``apps.eval`` with ``write_samples``, judged by the
   checker; ``apps.rm.policy_pairs``) on ``--pair-prompts`` training questions; each later round
   adds the mistakes of a policy optimised hard against the last round's reward model (a
   ``--grpo-steps`` GRPO run on it, which hacks it) on ``--harvest-prompts`` questions. The final
   GRPO run is short and held near the SFT model (``--rlhf-steps``, ``trainer.beta=0.3``,
   ``reward.normalize=batch``). ``rlhf_near_miss_heldout_gain`` is the same final run on the
   near-miss reward model of 1., and the checker as the reward (``--grpo-steps``) is
   ``checker_heldout_gain``, for reference;
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


def launch_app(app: str, config: str, out: Path, *overrides: str) -> tuple[str, float]:
    """``python -m apps.<app>.main`` to completion, its outputs in ``out``: its last line and wall seconds."""
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
    return line, wall


def run_app(app: str, config: str, out: Path, *overrides: str) -> dict[str, Any]:
    """A training app to completion: its rows, summary line and wall seconds."""
    line, wall = launch_app(app, config, out, *overrides)
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "summary": line, "rows": rows, "folder": str(out)}


def policy_samples(model: Path, out: Path, split: str, prompts: int, samples: int = 4) -> Path:
    """``model``'s judged samples (temperature 1) on ``prompts`` questions of ``split``: ``apps.eval``
    with ``write_samples``; returns its ``samples.jsonl``."""
    launch_app(
        "eval",
        "configs/eval_addition.yaml",
        out,
        f"model.path={model}",
        "write_samples=true",
        f"eval.data.split={split}",
        f"eval.max_prompts={prompts}",
        f"eval.samples={samples}",
    )
    return out / "samples.jsonl"


def round_pairs(folder: Path, near_misses: Path, train_samples: list[Path], test_samples: Path) -> dict[str, int]:
    """A reward model's preference folder: the near misses and every policy mistake gathered so far
    (training questions), held out: the SFT model's mistakes on held-out questions."""
    import random

    from apps.rm.policy_pairs import read_samples
    from forge.data.preferences import pairs_from_samples, write_preference_pairs

    lines = (near_misses / "train.jsonl").read_text(encoding="utf-8").splitlines()
    train = [json.loads(line) for line in lines if line.strip()]
    for path in train_samples:
        train += pairs_from_samples(read_samples(str(path)))
    random.Random(0).shuffle(train)
    splits = {"train": train, "test": pairs_from_samples(read_samples(str(test_samples)))}
    write_preference_pairs(folder, splits)
    return {name: len(pairs) for name, pairs in splits.items()}


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
    parser.add_argument("--rlhf-steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="reward models trained, each on more policy mistakes")
    parser.add_argument("--pair-prompts", type=int, default=20000)
    parser.add_argument("--harvest-prompts", type=int, default=5000)
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
    learned_only = ["reward.fns={exact_match: 0.0}", "eval.reward={exact_match: 1.0}"]
    held_near = ["trainer.beta=0.3", "reward.normalize=batch", f"steps={args.rlhf_steps}", "eval.every=10"]
    if "rlhf" in args.parts:
        near = REPO / "data" / "addition_3d_rev_preferences"
        if not near.exists():
            from forge.data.arithmetic import make_task_data

            make_task_data(near, {"task": "addition_preferences", "digits": 3, "reversed_operands": True})
        test_samples = policy_samples(sft, work / "samples_test", "test", 1000)
        train_samples = [policy_samples(sft, work / "samples_train_r1", "train", args.pair_prompts)]
        rounds: list[dict[str, Any]] = []
        for k in range(1, args.rounds + 1):
            counts = round_pairs(work / f"prefs_r{k}", near, train_samples, test_samples)
            rm_k = run_app(
                "rm",
                "configs/rm_addition.yaml",
                work / f"rm_r{k}",
                *start,
                f"data.path={work / f'prefs_r{k}'}",
                "data.make_if_missing={}",
                f"steps={args.rm_steps}",
                f"trainer.lr={args.rm_lr}",
                "eval.every=100",
            )
            entry = {"pairs": counts, "rm": {**rm_k, "curve": eval_curve(rm_k.pop("rows"), "eval/pairwise_accuracy")}}
            if k < args.rounds:  # optimise hard against it, and gather the mistakes it overrates
                model = f"reward.models={{{work / f'rm_r{k}' / 'final_model'}: 1.0}}"
                harvest = run_app(
                    "grpo",
                    "configs/grpo_addition.yaml",
                    work / f"grpo_harvest_r{k}",
                    *start,
                    *learned_only,
                    model,
                    "reward.normalize=running",
                    f"steps={args.grpo_steps}",
                    "eval.every=0",
                    f"weight_sync.dir={work / 'weights'}",
                )
                rows = harvest.pop("rows")
                entry["harvest"] = {**harvest, "checked": [(r["step"], r.get("reward/fn_exact_match")) for r in rows]}
                policy = work / f"grpo_harvest_r{k}" / "final_model"
                train_samples.append(
                    policy_samples(policy, work / f"samples_train_r{k + 1}", "train", args.harvest_prompts)
                )
            rounds.append(entry)
        model = f"reward.models={{{work / f'rm_r{args.rounds}' / 'final_model'}: 1.0}}"
        grpo_final = [*start, *learned_only, model, *held_near, "eval.samples=0", f"weight_sync.dir={work / 'weights'}"]
        run = run_app("grpo", "configs/grpo_addition.yaml", work / "grpo_rm", *grpo_final)
        rows = run.pop("rows")
        result["rlhf_heldout_gain"], first, last = gain(rows)
        learned_key = next((k for k in rows[-1] if k.startswith("reward/model_")), None)
        checked = [(r["step"], r.get("reward/fn_exact_match"), r.get(learned_key)) for r in rows]
        result["runs"]["grpo_rm"] = {
            **run,
            "curve": eval_curve(rows, "eval/accuracy"),
            "start": first,
            "end": last,
            "train_reward_checked_vs_learned": checked,
            "rounds": rounds,
        }
        if rm.exists():  # the near-miss reward model of 1., on the same final run
            near_model = f"reward.models={{{rm}: 1.0}}"
            grpo_near = [
                *start,
                *learned_only,
                near_model,
                *held_near,
                "eval.samples=0",
                f"weight_sync.dir={work / 'weights'}",
            ]
            run = run_app("grpo", "configs/grpo_addition.yaml", work / "grpo_rm_near_miss", *grpo_near)
            rows = run.pop("rows")
            result["rlhf_near_miss_heldout_gain"], first, last = gain(rows)
            result["runs"]["grpo_rm_near_miss"] = {**run, "curve": eval_curve(rows, "eval/accuracy")}
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
