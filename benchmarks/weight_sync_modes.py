"""What each ``weight_sync.mode`` costs: the GRPO app in drain, in_flight and rolling mode, side by side.

    python benchmarks/weight_sync_modes.py --out weight_sync_modes.json
    python benchmarks/weight_sync_modes.py --workloads long_tail --steps long_tail=10 --out wsm.json

Runs the app once per mode (``drain``, ``in_flight``, ``in_flight_keep_kv``: ``in_flight`` with
``policy.keep_kv_on_update``, and ``rolling`` with ``max_updating`` 1) on each workload, one run
after the other, the same seed and settings (two policy replicas, so that ``rolling`` can run;
``policy.concurrent_batches`` as ``--concurrent-batches`` for every mode, so that a new batch can
join an engine still generating):

- ``tiny``: ``configs/grpo_tiny.yaml`` as it ships (its completions are all about as long);
- ``long_tail``: ``configs/grpo_long_tail.yaml``, the medium model reversing 1 to 80 digits with up
  to 96 new tokens: completion lengths vary widely;
- ``policy_only``: the long-tail policy service alone, its routers as the app makes them, with
  ``--callers`` callers keeping prompts in flight and a push every ``--push-every`` seconds: what a
  mode does to generation when generation, not the trainer, is the bottleneck (``tokens_per_s``
  instead of ``steps_per_s``, no reward). On 2 shared cores the GRPO app is trainer-bound, so
  updates there mostly find the policy idle.

JSON (``--out``) ``workloads.<workload>.<key>.<mode>``, each from the run's own ``metrics.jsonl``:

- ``policy_stall_s_per_update``: seconds a replica's engine ran no step because of an update (from
  the later of the update's arrival and the engine's last step before the load, to its first step
  after the load; ``policy/update_stall_s`` over ``policy/update_stalls``, the engine's own step
  times, ``forge.generation.engine_steps.StepClock``);
- ``policy_hold_s_per_update``: from the update's arrival to that first step: how long new work
  waited on it (a drain holds new work while the sequences in flight finish);
- ``steps_per_s``: steps over the sum of the step times;
- ``policy_busy_fraction``: the replicas' engine-step seconds over replicas x the training wall time
  (generation before the first step counts in the numerator: read it as an upper bound);
- ``reward_last10``: the mean reward of the last 10 steps; ``token_age_mean``,
  ``spanning_fraction``: the mean over the steps of ``policy/token_age_mean`` and
  ``policy/spanning_fraction`` (sequences whose tokens span versions);
- ``wall_s``: the run's wall time, start-up included.

and the goals' ratios per workload: ``stall_vs_drain.<mode>``, ``steps_per_s_vs_drain.<mode>``,
``reward_last10_minus_drain.<mode>``. The load average is recorded before and after (other jobs on
the machine change every figure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from apps.grpo.cli import app_command  # noqa: E402

MODES = ("drain", "in_flight", "in_flight_keep_kv", "rolling")
"""``weight_sync.mode`` values, and ``in_flight_keep_kv``: ``in_flight`` with ``policy.keep_kv_on_update``."""


def mode_overrides(mode: str) -> list[str]:
    """The app overrides that select ``mode`` (one of ``MODES``)."""
    if mode == "in_flight_keep_kv":
        return ["weight_sync.mode=in_flight", "policy.keep_kv_on_update=true"]
    return [f"weight_sync.mode={mode}"]


WORKLOADS = {"tiny": "configs/grpo_tiny.yaml", "long_tail": "configs/grpo_long_tail.yaml"}
POLICY_ONLY = "policy_only"
DEFAULT_STEPS = {"tiny": 40, "long_tail": 15}
REPLICAS = 2


def run_mode(workload: str, mode: str, steps: int, args: argparse.Namespace, folder: Path) -> dict:
    """One app run of ``workload`` in ``mode``; its figures from ``metrics.jsonl``."""
    out = folder / f"{workload}-{mode}"
    cmd = app_command(
        WORKLOADS[workload],
        out,
        f"steps={steps}",
        f"seed={args.seed}",
        f"policy.num_replicas={REPLICAS}",
        f"policy.concurrent_batches={args.concurrent_batches}",
        *mode_overrides(mode),
        "weight_sync.max_updating=1",
        "logging.plot=false",
        *args.overrides.get(workload, []),
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{workload}/{mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "out" / "metrics.jsonl").read_text().splitlines()]
    figures = mode_figures(rows)
    figures["wall_s"] = wall
    print(f"  {workload}/{mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
    return figures


async def serve_mode(mode: str, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """The ``policy_only`` workload in ``mode``: the long-tail config's policy service alone
    (its routers, two replicas), ``--callers`` callers each keeping one prompt in flight, and a
    push every ``--push-every`` seconds (two models' weights, in turn) for ``--serve-s`` seconds."""
    from apps.common.launch import policy_config
    from apps.common.weights import PolicyWeights
    from apps.grpo.config import GRPOConfig
    from apps.grpo.roles import role_specs
    from forge.actors.policy import Policy
    from forge.config import load_config
    from forge.data.tasks import ToyTask
    from forge.models import make_tiny_model

    cfg = load_config(
        GRPOConfig,
        WORKLOADS["long_tail"],
        [*mode_overrides(mode), "weight_sync.max_updating=1", f"policy.num_replicas={REPLICAS}"],
    )
    t = cfg.model.tiny
    models = [
        make_tiny_model(
            folder / f"policy-model-{seed}",
            arch=t.arch,
            hidden_size=t.hidden_size,
            num_layers=t.num_layers,
            seed=seed,
            init_std=t.init_std,
        )
        for seed in (t.seed, t.seed + 1)
    ]
    routers = next(spec for spec in role_specs(cfg, str(models[0])) if spec.name == "policy").options
    routers["concurrent_batches"] = {"generate": args.concurrent_batches}
    config = policy_config(cfg, str(models[0]), cfg.group_size)
    policy = await Policy.options(num_replicas=REPLICAS, env={"OMP_NUM_THREADS": "1"}, **routers).as_service(config)
    max_updating = cfg.weight_sync.max_updating if mode == "rolling" else None
    weights = PolicyWeights(None, policy, "message", str(folder), resync_timeout_s=300.0, max_updating=max_updating)
    task = ToyTask(seed=args.seed, min_digits=1, max_digits=80)
    counts = {"tokens": 0, "groups": 0, "prompt": 0}
    try:
        await asyncio.wait_for(policy.generate.route(task[0], key=task[0].text), 300)  # warm up
        await policy.drain_metrics.fanout()
        started = time.monotonic()
        deadline = started + args.serve_s

        async def caller() -> None:
            while time.monotonic() < deadline:
                prompt = task[counts["prompt"]]
                counts["prompt"] += 1
                group = await asyncio.wait_for(policy.generate.route(prompt, key=prompt.text), 300)
                counts["tokens"] += sum(int(c.token_ids.numel()) for c in group.completions)
                counts["groups"] += 1

        async def pusher() -> None:
            version = 0
            while time.monotonic() + args.push_every < deadline:
                await asyncio.sleep(args.push_every)
                version += 1
                await asyncio.wait_for(weights.push(str(models[version % 2] / "model.safetensors"), version), 300)

        await asyncio.gather(pusher(), *(caller() for _ in range(args.callers)))
        elapsed = time.monotonic() - started
        records = [r for replica in await policy.drain_metrics.fanout() for r in replica]
    finally:
        await policy.shutdown()

    def total(name: str) -> float:
        return sum(value for n, value, _ in records if n == name)

    figures = {
        **engine_figures(total, elapsed),
        "tokens_per_s": counts["tokens"] / elapsed,
        "groups_per_s": counts["groups"] / elapsed,
    }
    print(f"  policy_only/{mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
    return figures


def engine_figures(total: Callable[[str], float], window_s: float) -> dict[str, float]:
    """The replicas' own figures over ``window_s`` seconds: stall and hold per update, updates
    timed, busy fraction; ``total(name)`` sums a policy metric over the run."""
    stalls = total("policy/update_stalls")
    return {
        "policy_stall_s_per_update": total("policy/update_stall_s") / stalls if stalls else 0.0,
        "policy_hold_s_per_update": total("policy/update_hold_s") / stalls if stalls else 0.0,
        "updates_timed": stalls,
        "policy_busy_fraction": total("policy/engine_busy_s") / (REPLICAS * window_s),
    }


def mode_figures(rows: list[dict]) -> dict[str, float]:
    """The keys of one run (see the module's docstring) from its metric rows."""

    def total(name: str) -> float:
        return sum(float(r.get(name, 0.0)) for r in rows)

    def mean(name: str) -> float:
        values = [float(r[name]) for r in rows if name in r]
        return sum(values) / len(values) if values else 0.0

    window = rows[-1]["wall_s"] - (rows[0]["wall_s"] - rows[0]["step_time_s"])
    last = [r["reward_mean"] for r in rows[-10:]]
    return {
        **engine_figures(total, window),
        "steps_per_s": len(rows) / total("step_time_s"),
        "reward_last10": sum(last) / len(last),
        "token_age_mean": mean("policy/token_age_mean"),
        "spanning_fraction": mean("policy/spanning_fraction"),
    }


def workload_report(per_mode: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``<key>.<mode>`` and the ratios to drain."""
    keys = next(iter(per_mode.values())).keys()
    report: dict[str, dict[str, float]] = {key: {m: f[key] for m, f in per_mode.items()} for key in keys}
    drain = per_mode.get("drain")
    if drain is None:
        return report
    others = [m for m in per_mode if m != "drain"]
    stall = drain["policy_stall_s_per_update"]
    report["stall_vs_drain"] = {m: per_mode[m]["policy_stall_s_per_update"] / stall for m in others if stall}
    report["hold_vs_drain"] = {
        m: per_mode[m]["policy_hold_s_per_update"] / drain["policy_hold_s_per_update"]
        for m in others
        if drain["policy_hold_s_per_update"]
    }
    for key in ("steps_per_s", "tokens_per_s"):
        if key in drain:
            report[f"{key}_vs_drain"] = {m: per_mode[m][key] / drain[key] for m in others}
    if "reward_last10" in drain:
        report["reward_last10_minus_drain"] = {m: per_mode[m]["reward_last10"] - drain["reward_last10"] for m in others}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the JSON report goes")
    parser.add_argument("--workloads", nargs="+", choices=[*WORKLOADS, POLICY_ONLY], default=[*WORKLOADS, POLICY_ONLY])
    parser.add_argument("--serve-s", type=float, default=60.0, help="policy_only: seconds per mode")
    parser.add_argument("--push-every", type=float, default=3.0, help="policy_only: seconds between pushes")
    parser.add_argument("--callers", type=int, default=8, help="policy_only: prompts kept in flight")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", nargs="*", default=[], help="per workload, e.g. long_tail=10 tiny=30")
    parser.add_argument(
        "--set", nargs="*", default=[], dest="sets", help="per workload, app overrides: long_tail:prompts_per_step=2"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrent-batches", type=int, default=4, help="policy.concurrent_batches, every mode")
    args = parser.parse_args()
    steps = dict(DEFAULT_STEPS)
    for item in args.steps:
        name, _, value = item.partition("=")
        if name not in WORKLOADS or not value.isdigit() or int(value) < 1:
            raise SystemExit(
                f"--steps takes <workload>=<steps >= 1> with a workload of {list(WORKLOADS)}, got {item!r}"
            )
        steps[name] = int(value)
    args.overrides = {}
    for item in args.sets:
        name, _, override = item.partition(":")
        if name not in WORKLOADS or "=" not in override:
            raise SystemExit(f"--set takes <workload>:<key>=<value> with a workload of {list(WORKLOADS)}, got {item!r}")
        args.overrides.setdefault(name, []).append(override)

    report: dict = {
        "replicas": REPLICAS,
        "concurrent_batches": args.concurrent_batches,
        "seed": args.seed,
        "overrides": args.overrides,
        "load_before": os.getloadavg()[0],
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workloads": {},
    }
    with tempfile.TemporaryDirectory(prefix="forge-wsm-") as tmp:
        for workload in args.workloads:
            if workload == POLICY_ONLY:
                print(f"{POLICY_ONLY} ({args.serve_s:.0f} s a mode, a push every {args.push_every} s)", flush=True)
                per_mode = {mode: asyncio.run(serve_mode(mode, args, Path(tmp))) for mode in args.modes}
                report["workloads"][POLICY_ONLY] = {
                    "config": WORKLOADS["long_tail"],
                    "serve_s": args.serve_s,
                    "push_every_s": args.push_every,
                    "callers": args.callers,
                    **workload_report(per_mode),
                }
                continue
            print(f"{workload} ({WORKLOADS[workload]}, {steps[workload]} steps)", flush=True)
            per_mode = {mode: run_mode(workload, mode, steps[workload], args, Path(tmp)) for mode in args.modes}
            report["workloads"][workload] = {"config": WORKLOADS[workload], "steps": steps[workload]}
            report["workloads"][workload].update(workload_report(per_mode))
    report["load_after"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps({w: {k: v for k, v in r.items() if k.endswith("_vs_drain")} for w, r in report["workloads"].items()})
    )


if __name__ == "__main__":
    main()
