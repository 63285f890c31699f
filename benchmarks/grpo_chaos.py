"""GRPO chaos report: role processes are killed during a run; does the run lose anything?

    python benchmarks/grpo_chaos.py --out grpo_chaos.json [--steps 30] [--kill-every 6]
    python benchmarks/grpo_chaos.py --target trainer [--trainer-procs 2] --out grpo_chaos_trainer.json

Two runs of the GRPO app (``configs/grpo_tiny.yaml``, 2 policy and 2 reference replicas, the
same seed and settings), one after the other: an undisturbed one, then one in which every
``--kill-every`` steps a random process of a non-trainer role (policy, reference or reward
replica) is SIGKILLed, and one of those disruptions is a SIGSTOP instead (a hung process, found
by the health probes). Writes JSON with

- ``steps_completed`` (must equal ``steps``) and the chaos run's exit code;
- ``restarts`` per role, and ``disruptions`` (what was done to which role, at which step);
- ``groups_lost`` and ``groups_duplicated`` (each must be 0), from the run's own books
  (``groups/*`` in ``metrics.jsonl``) and the number of groups trained;
- ``final_reward_vs_undisturbed``: the mean reward of the last 10 steps, chaos / undisturbed
  (goal >= 0.9; concurrent rollouts make no two runs draw the same samples, so read it with
  the undisturbed run's own noise in mind);
- ``extra_wall_s_per_kill``: the training time (sum of step times) the chaos run took beyond
  the undisturbed one, per disruption; and the total wall times;
- the load average before and after (other jobs on the machine change every figure).

``--repeats N`` runs N such pairs, with seeds ``seed`` .. ``seed + N - 1``: the report keeps each
pair's figures under ``pairs`` and sums or pools them at the top (``final_reward_vs_undisturbed``
is then the chaos runs' mean final reward over the undisturbed runs', and
``final_reward_vs_undisturbed_per_pair`` lists each pair's). One pair's ratio carries the noise of
two short runs of a rising curve; pooling pairs measures the disruptions' effect instead.

With ``--target trainer`` the disruptions hit the trainer instead (both runs checkpoint every
``--checkpoint-every`` steps; ``--trainer-procs 2`` kills one rank of two), and the report adds
``trainer_restarts``, ``steps_retrained`` per disruption (goal: at most ``checkpoint_every``
each) and ``extra_wall_s_per_trainer_kill``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from apps.grpo.cli import app_command  # noqa: E402
from apps.grpo.faults import role_processes  # noqa: E402

TARGET_ROLES = ("policy", "reference", "reward")


def chaos_command(out: Path, args: argparse.Namespace) -> list[str]:
    """The tiny run with 2 policy and 2 reference replicas and quick health probes; with
    ``--target trainer``, checkpoints every ``--checkpoint-every`` steps, ``--trainer-procs``
    ranks and a restart allowed per disruption."""
    trainer = []
    if args.target == "trainer":
        trainer = [
            f"trainer.procs={args.trainer_procs}",
            f"trainer.checkpoint_every={args.checkpoint_every}",
            f"faults.trainer_max_restarts={args.steps // args.kill_every}",
        ]
    return app_command(
        "configs/grpo_tiny.yaml",
        out,
        f"steps={args.steps}",
        f"prompts_per_step={args.prompts_per_step}",
        f"seed={args.seed}",
        "policy.num_replicas=2",
        "reference.num_replicas=2",
        "faults.health_interval_s=1",
        "faults.health_timeout_s=10",
        "faults.restart_backoff_s=0.5",
        "logging.plot=false",
        *trainer,
    )


def read_rows(out: Path) -> list[dict]:
    path = out / "out" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_app(out: Path, args: argparse.Namespace, chaos: bool) -> dict:
    """One app run; with ``chaos``, disrupt a random non-trainer role every ``kill_every`` steps."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = chaos_command(out, args)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rng = random.Random(args.seed)
    due = list(range(args.kill_every, args.steps, args.kill_every))  # steps after which to disrupt
    stop_at = due[len(due) // 2] if due else None  # the one SIGSTOP, mid-run
    disruptions: list[dict] = []
    stopped: list = []
    try:
        while chaos and due and proc.poll() is None:
            if len(read_rows(out)) < due[0]:
                time.sleep(0.2)
                continue
            step = due.pop(0)
            role = rng.choice(TARGET_ROLES) if args.target == "rollout" else "trainer"
            victims = [v for v in role_processes(proc.pid, role) if v not in stopped]
            if not victims:  # all of its replicas are restarting right now
                disruptions.append({"step": step, "role": role, "signal": None})
                continue
            victim = rng.choice(victims)
            sig = signal.SIGSTOP if step == stop_at else signal.SIGKILL
            victim.send_signal(sig)
            if sig == signal.SIGSTOP:
                stopped.append(victim)
            logged = len(read_rows(out))  # the newest step logged when it was hit
            disruptions.append({"step": step, "role": role, "signal": sig.name, "pid": victim.pid, "logged": logged})
            print(f"  step {step}: {sig.name} {role} (pid {victim.pid})", flush=True)
        try:
            stdout, stderr = proc.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
    finally:
        for victim in stopped:  # the run replaced it; don't leave it behind
            try:
                victim.kill()
            except Exception:
                pass
    wall_s = time.monotonic() - started
    rows = read_rows(out)
    if proc.returncode != 0:
        print(f"  exit {proc.returncode}:\n{stderr[-3000:]}", file=sys.stderr)
    restored = [int(m) for m in re.findall(r"the trainer is back at step (\d+)", stderr)]
    return {
        "exit_code": proc.returncode,
        "wall_s": wall_s,
        "rows": rows,
        "disruptions": disruptions,
        "restored_steps": restored,
    }


def tail_reward(rows: list[dict], k: int = 10) -> float:
    tail = rows[-k:]
    return sum(r["reward_mean"] for r in tail) / len(tail) if tail else 0.0


def report(args: argparse.Namespace, calm: dict, chaos: dict) -> dict:
    rows = chaos["rows"]
    last = rows[-1] if rows else {}
    hits = [d for d in chaos["disruptions"] if d["signal"] is not None]
    trained = int(last.get("groups/trained", 0))
    train_s = {name: sum(r["step_time_s"] for r in run["rows"]) for name, run in (("calm", calm), ("chaos", chaos))}
    return {
        "steps": args.steps,
        "steps_completed": len(rows),
        "step_numbers_match": [r["step"] for r in rows] == list(range(1, args.steps + 1)),
        "exit_code": chaos["exit_code"],
        "undisturbed_exit_code": calm["exit_code"],
        "disruptions": chaos["disruptions"],
        "restarts": {role: int(last.get(f"restarts/{role}", 0)) for role in TARGET_ROLES},
        "requests_retried": {role: int(last.get(f"retried/{role}", 0)) for role in TARGET_ROLES},
        "groups_regenerated": int(last.get("groups/regenerated", 0)),
        "groups_trained": trained,
        "groups_lost": int(last.get("groups/lost", 0))
        + int(last.get("groups/unaccounted", 0))
        + max(0, args.steps * args.prompts_per_step - trained),
        "groups_duplicated": int(last.get("groups/duplicates", 0)),
        "groups_dropped_stale": int(last.get("groups/dropped_stale", 0)),
        "final_reward": tail_reward(rows),
        "undisturbed_final_reward": tail_reward(calm["rows"]),
        "final_reward_vs_undisturbed": tail_reward(rows) / max(tail_reward(calm["rows"]), 1e-9),
        "train_s": train_s,
        "wall_s": {"calm": calm["wall_s"], "chaos": chaos["wall_s"]},
        "extra_wall_s_per_kill": (train_s["chaos"] - train_s["calm"]) / max(1, len(hits)),
        **(trainer_figures(args, calm, chaos, hits) if args.target == "trainer" else {}),
    }


def trainer_figures(args: argparse.Namespace, calm: dict, chaos: dict, hits: list[dict]) -> dict:
    """The trainer disruptions' own figures: restarts, the steps trained again after each (the
    newest step logged when it was hit, less the checkpoint's step the new trainer started
    from), and the wall time each cost (a restart lies outside every step's ``step_time_s``)."""
    last = chaos["rows"][-1] if chaos["rows"] else {}
    restored = chaos["restored_steps"]
    retrained = [max(0, hit["logged"] - step) for hit, step in zip(hits, restored)]
    return {
        "trainer_procs": args.trainer_procs,
        "checkpoint_every": args.checkpoint_every,
        "trainer_restarts": int(last.get("restarts/trainer", 0)),
        "restored_steps": restored,
        "steps_retrained": retrained,
        "steps_retrained_max_vs_checkpoint_every": max(retrained, default=0) / args.checkpoint_every,
        "extra_wall_s_per_trainer_kill": (chaos["wall_s"] - calm["wall_s"]) / max(1, len(hits)),
    }


def pooled(args: argparse.Namespace, pairs: list[dict]) -> dict:
    """Several pairs' reports as one: counts summed, worst cases kept, rewards pooled."""
    chaos_reward = sum(p["final_reward"] for p in pairs) / len(pairs)
    calm_reward = sum(p["undisturbed_final_reward"] for p in pairs) / len(pairs)
    result = {
        "steps": args.steps,
        "repeats": len(pairs),
        "seeds": [args.seed + i for i in range(len(pairs))],
        "steps_completed": min(p["steps_completed"] for p in pairs),
        "step_numbers_match": all(p["step_numbers_match"] for p in pairs),
        "exit_code": next((p["exit_code"] for p in pairs if p["exit_code"] != 0), 0),  # the first failure's
        "restarts": {role: sum(p["restarts"][role] for p in pairs) for role in TARGET_ROLES},
        "groups_lost": sum(p["groups_lost"] for p in pairs),
        "groups_duplicated": sum(p["groups_duplicated"] for p in pairs),
        "final_reward": chaos_reward,
        "undisturbed_final_reward": calm_reward,
        "final_reward_vs_undisturbed": chaos_reward / max(calm_reward, 1e-9),
        "final_reward_vs_undisturbed_per_pair": [p["final_reward_vs_undisturbed"] for p in pairs],
        "extra_wall_s_per_kill": sum(p["extra_wall_s_per_kill"] for p in pairs) / len(pairs),
        "pairs": pairs,
    }
    if args.target == "trainer":
        result["trainer_restarts"] = sum(p["trainer_restarts"] for p in pairs)
        result["steps_retrained"] = [n for p in pairs for n in p["steps_retrained"]]
        result["steps_retrained_max_vs_checkpoint_every"] = max(
            p["steps_retrained_max_vs_checkpoint_every"] for p in pairs
        )
        result["extra_wall_s_per_trainer_kill"] = sum(p["extra_wall_s_per_trainer_kill"] for p in pairs) / len(pairs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-every", type=int, default=6, help="disrupt a role every K steps")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="longest one app run may take")
    parser.add_argument(
        "--target",
        choices=("rollout", "trainer"),
        default="rollout",
        help="disrupt the rollout side's replicas (policy, reference, reward) or the trainer",
    )
    parser.add_argument("--trainer-procs", type=int, default=1, help="the trainer's ranks (--target trainer)")
    parser.add_argument("--checkpoint-every", type=int, default=3, help="with --target trainer")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, seeds seed .. seed+repeats-1")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    load_before = os.getloadavg()
    pairs = []
    with tempfile.TemporaryDirectory(prefix="grpo-chaos-") as tmp:
        for i in range(args.repeats):
            pair_args = argparse.Namespace(**{**vars(args), "seed": args.seed + i})
            print(f"seed {pair_args.seed}: undisturbed run ...", flush=True)
            calm = run_app(Path(tmp) / f"calm-{i}", pair_args, chaos=False)
            print(f"seed {pair_args.seed}: chaos run ...", flush=True)
            chaos = run_app(Path(tmp) / f"chaos-{i}", pair_args, chaos=True)
            pairs.append(report(pair_args, calm, chaos))
            print(f"seed {pair_args.seed}: final_reward_vs_undisturbed {pairs[-1]['final_reward_vs_undisturbed']:.3f}")
    result = pairs[0] if args.repeats == 1 else pooled(args, pairs)
    result["load_avg_before"], result["load_avg_after"] = load_before, os.getloadavg()
    for key in (
        "steps_completed",
        "exit_code",
        "restarts",
        "groups_lost",
        "groups_duplicated",
        "final_reward_vs_undisturbed",
        "extra_wall_s_per_kill",
        *(("trainer_restarts", "steps_retrained", "extra_wall_s_per_trainer_kill") if args.target == "trainer" else ()),
    ):
        print(f"{key:>28}: {result[key]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
