"""Many adapters, one policy: memory, routing and training of K LoRA runs on one policy service.

    python benchmarks/multi_lora.py [--out results.json] [--parts memory,routing,runs] [--steps 20]

Each part measures its keys side by side in one invocation:

- ``memory``: one ``MultiLoraPolicy`` replica (real vLLM, the tiny model of grpo_tiny_lora.yaml)
  serving 1, then 4 rank-16 adapters (each loaded and sampled from): the resident set size of the
  policy's processes (psutil, summed over the processes whose proc mesh is the policy's; shared
  pages count once per process) and ``rss_4_over_1``. Four separate policies would be 4x one
  (computed from the 1-adapter figure, not started).
- ``routing``: ``--replicas`` replicas holding at most 2 adapters each, 4 adapters, a seeded
  uniform stream of ``--requests`` requests from 16 callers, routed ``model_aware`` (the default
  of multiplexed endpoints) and then plain ``round_robin`` on fresh services: batches, loads and
  evictions per 1,000 requests and requests/s.
- ``runs``: the app's runs (``configs/multi_lora_tiny.yaml``'s two, ``--steps`` steps each) alone,
  each in a job of its own, then together on one policy replica, same seeds: each run's last-10
  mean reward alone and together (and the difference), and the aggregate steps/s of the joint job's
  runs / the mean steps/s of a solo run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import forge.controller  # noqa: F401  (before anything imports monarch)

REPO = Path(__file__).resolve().parents[1]
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ----------------------------------------------------------------------------- helpers
def tiny_model(folder: Path) -> Path:
    """The tiny model of configs/grpo_tiny_lora.yaml."""
    from forge.models import make_tiny_model

    return make_tiny_model(folder, arch="qwen2", hidden_size=64, num_layers=2, seed=0, init_std=0.1)


def random_adapters(model_dir: Path, k: int) -> list[dict[str, Any]]:
    """``k`` rank-16 adapters with random non-zero weights, as a trainer sends them."""
    from forge.models.lora import LoraSettings, random_adapter

    settings = LoraSettings(rank=RANK, alpha=32.0, target_modules=TARGETS)
    return [random_adapter(str(model_dir), settings, seed, scale=0.1)[1] for seed in range(k)]


async def start_policy(model_dir: Path, replicas: int, max_loras: int, router: str | None = None) -> Any:
    from forge.actors import PolicyConfig
    from forge.actors.multi_lora_policy import MultiLoraPolicy, multi_lora_engine_kwargs
    from forge.models.lora import LoraSettings

    config = PolicyConfig(
        model_path=str(model_dir),
        lora=LoraSettings(rank=RANK, alpha=32.0, target_modules=TARGETS),
        group_size=8,
        max_tokens=3,
        max_model_len=64,
        kv_cache_bytes=16 << 20,
        engine_kwargs={"use_tqdm_on_load": False, **multi_lora_engine_kwargs(max_loras)},
    )
    options: dict[str, Any] = {"num_replicas": replicas, "max_models": max_loras, "name": "policy"}
    if router is not None:
        options["endpoint_routers"] = {"generate_adapter": router}
    options["env"] = {"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    return await MultiLoraPolicy.options(**options).as_service(config)


def policy_rss_bytes() -> int:
    """RSS summed over this process tree's processes whose proc mesh is the policy's."""
    import psutil

    sys.path.insert(0, str(REPO / "benchmarks"))
    from role_cpu import role_of

    root = psutil.Process(os.getpid())
    total = 0
    for proc in root.children(recursive=True):
        try:
            if role_of(proc, root.pid) == "policy":
                total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


def prompts(n: int, seed: int) -> list[Any]:
    from forge.data.tasks import ToyTask

    task = ToyTask(seed=seed)
    return [task[i] for i in range(n)]


# ----------------------------------------------------------------------------- parts
async def memory(model_dir: Path) -> dict[str, Any]:
    adapters = random_adapters(model_dir, 4)
    svc = await start_policy(model_dir, replicas=1, max_loras=4)
    try:
        batch = prompts(8, seed=0)
        out: dict[str, Any] = {}
        for k, tensors in enumerate(adapters):
            name = f"run{k}"
            await svc.add_adapter.fanout(name, timeout=60)
            await svc.update_adapter.fanout(name, tensors, 1, timeout=60)
            await asyncio.gather(*(svc.generate_adapter.route(p, model_id=name, timeout=60) for p in batch))
            if k == 0:
                out["rss_1_adapter_mib"] = policy_rss_bytes() / 2**20
        [held] = await svc.adapters.fanout(timeout=60)
        out["rss_4_adapters_mib"] = policy_rss_bytes() / 2**20
        out["adapters_in_vllm"] = held["vllm_loras"]
        out["rss_4_over_1"] = out["rss_4_adapters_mib"] / out["rss_1_adapter_mib"]
        out["four_separate_policies_over_1"] = 4.0  # computed: four replicas of the 1-adapter process
        out["adapter_mib"] = sum(t.numel() * t.element_size() for t in adapters[0].values()) / 2**20
        return out
    finally:
        await svc.shutdown()


async def _client(svc: Any, todo: Any) -> None:
    """One closed-loop caller: the next request of the shared stream once its last is answered."""
    for prompt, name in todo:
        await svc.generate_adapter.route(prompt, model_id=name, timeout=120)


async def routing(model_dir: Path, replicas: int, requests: int) -> dict[str, Any]:
    adapters = random_adapters(model_dir, 4)
    names = [f"run{k}" for k in range(4)]
    rng = random.Random(0)
    pool = prompts(64, seed=1)
    stream = [(rng.choice(pool), rng.choice(names)) for _ in range(requests)]
    out: dict[str, Any] = {"replicas": replicas, "adapters": 4, "max_loras": 2, "requests": requests}
    for router in ("model_aware", "round_robin"):
        svc = await start_policy(model_dir, replicas=replicas, max_loras=2, router=router)
        try:
            for name, tensors in zip(names, adapters):
                await svc.add_adapter.fanout(name, timeout=60)
                await svc.update_adapter.fanout(name, tensors, 1, timeout=60)
            todo = iter(stream)
            t0 = time.perf_counter()
            await asyncio.gather(*(_client(svc, todo) for _ in range(16)))
            seconds = time.perf_counter() - t0
            m = svc.metrics()["models"]
        finally:
            await svc.shutdown()
        batches = sum(p["batches"] for p in m["per_model"].values())
        out[router] = {
            "requests_per_s": requests / seconds,
            "batches_per_1k": 1000 * batches / requests,
            "loads_per_1k": 1000 * m["loads"] / requests,
            "evictions_per_1k": 1000 * m["evictions"] / requests,
        }
    return out


def app_job(folder: Path, runs: list[dict], steps: int, extra: list[str] = ()) -> dict[str, Any]:
    """One job of the app on ``runs`` (the shipped config's settings and ``extra`` overrides,
    ``steps`` steps each)."""
    import yaml

    shipped = yaml.safe_load((REPO / "configs" / "multi_lora_tiny.yaml").read_text())
    shipped["shared"] = [
        *(s for s in shipped["shared"] if not s.startswith("steps=")),
        f"steps={steps}",
        f"model.path={folder.parent / 'tiny'}",
        "logging.progress_bar=false",
        "logging.plot=false",
        *extra,
    ]
    shipped.update(runs=runs, output_dir=str(folder), max_loras=0)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.yaml").write_text(yaml.safe_dump(shipped))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "apps.multi_lora.main", "--config", str(folder / "job.yaml")]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"the job in {folder} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    out = {}
    for run in json.loads((folder / "summary.json").read_text())["runs"]:
        rows = [json.loads(line) for line in (folder / run["name"] / "metrics.jsonl").read_text().splitlines()]
        last = rows[-10:]
        train_s = rows[-1]["wall_s"] - rows[0]["wall_s"]  # the steps after the first: start-up left out
        out[run["name"]] = {
            "last10_reward": sum(r["reward_mean"] for r in last) / len(last),
            "steps_per_s": (len(rows) - 1) / train_s if train_s > 0 else float("nan"),
        }
    return out


def training_runs(root: Path, steps: int, extra: list[str] = ()) -> dict[str, Any]:
    import yaml

    runs = yaml.safe_load((REPO / "configs" / "multi_lora_tiny.yaml").read_text())["runs"]
    solo = {}
    for run in runs:
        solo.update(app_job(root / f"solo-{run['name']}", [run], steps, extra))
    joint = app_job(root / "joint", runs, steps, extra)
    out: dict[str, Any] = {"steps": steps, "overrides": list(extra), "runs": {}}
    for name in solo:
        out["runs"][name] = {
            "solo_last10_reward": solo[name]["last10_reward"],
            "shared_last10_reward": joint[name]["last10_reward"],
            "reward_difference": joint[name]["last10_reward"] - solo[name]["last10_reward"],
        }
    solo_rate = sum(s["steps_per_s"] for s in solo.values()) / len(solo)
    out["solo_steps_per_s_mean"] = solo_rate
    out["shared_aggregate_steps_per_s"] = sum(j["steps_per_s"] for j in joint.values())
    out["aggregate_over_solo"] = out["shared_aggregate_steps_per_s"] / solo_rate
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--parts", default="memory,routing,runs", help="comma-separated: memory, routing, runs")
    parser.add_argument("--steps", type=int, default=20, help="training steps of each run (runs part)")
    parser.add_argument("--replicas", type=int, default=2, help="policy replicas (routing part)")
    parser.add_argument(
        "--override", action="append", default=[], help="key=value for every run of the runs part (repeatable)"
    )
    parser.add_argument("--requests", type=int, default=400, help="requests (routing part)")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - {"memory", "routing", "runs"})
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from memory, routing, runs")
    results: dict[str, Any] = {"parts": parts}
    with tempfile.TemporaryDirectory(prefix="forge-multi-lora-") as tmp:
        root = Path(tmp)
        model_dir = tiny_model(root / "tiny")
        if "memory" in parts:
            results["memory"] = await memory(model_dir)
            print(json.dumps({"memory": results["memory"]}), flush=True)
        if "routing" in parts:
            results["routing"] = await routing(model_dir, args.replicas, args.requests)
            print(json.dumps({"routing": results["routing"]}), flush=True)
        if "runs" in parts:
            results["runs"] = training_runs(root, args.steps, args.override)
            print(json.dumps({"runs": results["runs"]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    from forge.controller import quiet_monarch

    quiet_monarch()
    asyncio.run(main())
