"""Multi-turn routing: session affinity vs round robin vs least loaded, side by side in one run.

    python benchmarks/multiturn_routing.py [--out results.json] [--groups 4] [--turns 6]

Two vLLM policy replicas (a small random-init model, prefix caching on) serve ``groups x
group_size`` concurrent multi-turn trajectories with long histories: each group shares a long
prompt, and every turn appends the policy's sample and a long environment observation, so the
next turn's prompt is the whole history. The same workload runs under each router of the
policy's ``generate_turn`` endpoint, each on a fresh service (empty caches):

- ``affinity``: ``forge.envs.SessionAffinity`` (a session's turns on one replica, a group
  started on one replica under a cap);
- ``round_robin`` and ``least_loaded`` (power of two choices): forge's built-in routers.

Reported per router, from vLLM's own counters (``Policy.prefix_cache_stats``): the prefix-cache
hit rate (cached prompt tokens / prompt tokens), the prefill tokens computed (prompt tokens not
served from the cache), turns per second, and the load CV (std / mean of the turns each replica
served).

The KV cache is the scarce resource of a serving replica, and the one that routing decides how
to spend. ``--kv-cache-copies`` sizes each replica's cache as a share of one copy of every
trajectory's full history (default 0.55): enough for the half of the sessions that affinity
pins on a replica, too little for all of them. A router that spreads each session over both
replicas makes each hold (and evict) every history. With a cache big enough for every history on
every replica (``--kv-cache-copies 1.2``), any router finds its prefixes and the ratios fall
towards 1; the JSON records the capacity vLLM reported (``kv_cache_tokens``) and the share of
the histories it was (``kv_cache_copies``).

Each router also reports ``same_replica_fraction``: the share of a session's turns after its
first that went to the replica of its previous turn. That share bounds the hit-rate ratio: a
turn on its previous turn's replica finds that turn's blocks the last freed, so it hits as under
affinity, and round robin on 2 replicas does this for half the turns (ratio at most about 2).

Keys: ``affinity_vs_round_robin_throughput`` (goal >= 1.5), ``affinity_vs_round_robin_hit_rate``
(goal >= 2), ``affinity_load_cv`` (goal <= 0.2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import forge.controller  # noqa: F401  (before anything imports monarch)
from forge.actors.policy import Policy, PolicyConfig
from forge.controller.routing import Router, RouteRequest, make_router
from forge.envs import SessionAffinity, SessionKey
from forge.models import make_tiny_model
from forge.types import TurnRequest

ROUTERS = {"affinity": SessionAffinity, "round_robin": "round_robin", "least_loaded": "least_loaded"}


class PlacementLog(Router):
    """The router under test, unchanged, plus a record of which replica each session's turns got.

    It measures what bounds the hit-rate ratio: a turn that lands where the session's previous
    turn ran finds that turn's blocks the most recently freed in the replica's cache, so it hits
    as affinity would; only the other turns can miss more.
    """

    def __init__(self, spec: Any) -> None:
        self.inner = make_router(spec)
        self.last: dict[str, int] = {}
        self.repeats = 0  # turns after a session's first that went to its previous turn's replica
        self.later_turns = 0

    def choose(self, request: RouteRequest, replicas: Any) -> Any:
        chosen = self.inner.choose(request, replicas)
        if isinstance(request.key, SessionKey):
            previous = self.last.get(request.key.session)
            if previous is not None:
                self.later_turns += 1
                self.repeats += previous == chosen.replica_id
            self.last[request.key.session] = chosen.replica_id
        return chosen

    @property
    def same_replica_fraction(self) -> float:
        return self.repeats / self.later_turns if self.later_turns else 0.0


def distinct_tokens(args: argparse.Namespace) -> int:
    """Tokens of every history at its end, each group's shared prompt counted once."""
    return args.groups * args.prompt_tokens + args.groups * args.group_size * args.turns * (
        args.sample_tokens + args.obs_tokens
    )


def kv_bytes_per_token(model: Path) -> int:
    """Keys and values of one token over all layers, in the checkpoint's dtype (vLLM's ``auto``)."""
    config = json.loads((model / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    element = torch.empty((), dtype=getattr(torch, config.get("dtype", "float32"))).element_size()
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * element


def kv_cache_bytes(args: argparse.Namespace, model: Path) -> int:
    """Each replica's KV cache: ``--kv-cache-copies`` of one copy of every history."""
    return int(args.kv_cache_copies * distinct_tokens(args) * kv_bytes_per_token(model))


async def run_workload(args: argparse.Namespace, model: Path, router: Any) -> dict[str, float]:
    """All trajectories, concurrently, under one router on a fresh 2-replica policy service."""
    config = PolicyConfig(
        model_path=str(model),
        max_tokens=args.sample_tokens,
        max_model_len=args.prompt_tokens + args.turns * (args.obs_tokens + args.sample_tokens) + 64,
        kv_cache_bytes=kv_cache_bytes(args, model),
        engine_kwargs={"disable_log_stats": False, "use_tqdm_on_load": False},
        seed=0,
    )
    placement = PlacementLog(router)
    policy = await Policy.options(
        num_replicas=2, env={"OMP_NUM_THREADS": "1"}, endpoint_routers={"generate_turn": placement}
    ).as_service(config)
    try:
        vocab = range(4, 60)
        rng = random.Random(0)
        prompts = [torch.tensor([rng.choice(vocab) for _ in range(args.prompt_tokens)]) for _ in range(args.groups)]

        async def trajectory(group: int, sample: int) -> int:
            session = f"g{group}/s{sample}"
            key = SessionKey(session, f"g{group}")
            history = prompts[group]
            obs_rng = random.Random(hash((group, sample)) & 0xFFFF)
            for _ in range(args.turns):
                turn = await policy.generate_turn.route(TurnRequest(session, history), key=key, timeout=600)
                # The environment's step (a tool call, a game's move) takes its own time.
                await asyncio.sleep(obs_rng.uniform(0.0, 2.0 * args.env_latency_ms / 1000))
                observation = torch.tensor([obs_rng.choice(vocab) for _ in range(args.obs_tokens)])
                history = torch.cat([history, turn.token_ids, observation])
            return args.turns

        before = await policy.prefix_cache_stats.fanout()
        t0 = time.perf_counter()
        turns = await asyncio.gather(*(trajectory(g, s) for g in range(args.groups) for s in range(args.group_size)))
        elapsed = time.perf_counter() - t0
        after = await policy.prefix_cache_stats.fanout()
        per_replica = [m["endpoints"]["generate_turn"]["requests"] for m in policy.metrics()["replicas"].values()]
    finally:
        await policy.shutdown()
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in after[0]}
    mean = statistics.fmean(per_replica)
    return {
        "hit_rate": delta["prompt_tokens_cached"] / delta["prompt_tokens"] if delta["prompt_tokens"] else 0.0,
        "prefix_cache_hit_rate_blocks": delta["hits"] / delta["queries"] if delta["queries"] else 0.0,
        "prompt_tokens": delta["prompt_tokens"],
        "prefill_tokens": delta["prompt_tokens"] - delta["prompt_tokens_cached"],
        "turns": sum(turns),
        "turns_per_s": sum(turns) / elapsed,
        "seconds": elapsed,
        "turns_per_replica": per_replica,
        "load_cv": statistics.pstdev(per_replica) / mean if mean else 0.0,
        "same_replica_fraction": placement.same_replica_fraction,
        "kv_cache_tokens": after[0]["kv_cache_tokens"],
        "kv_cache_copies": after[0]["kv_cache_tokens"] / distinct_tokens(args),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(args.model_dir) / f"{args.hidden_size}x{args.layers}"
    model = make_tiny_model(model_dir, hidden_size=args.hidden_size, num_layers=args.layers, init_std=0.1, seed=0)
    results: dict[str, dict[str, float]] = {}
    for name in args.routers.split(","):
        results[name] = await run_workload(args, model, ROUTERS[name])
        r = results[name]
        print(
            f"{name:>13}: hit rate {r['hit_rate']:.3f}, prefill {r['prefill_tokens']:.0f} tokens, "
            f"{r['turns_per_s']:.2f} turns/s, load CV {r['load_cv']:.3f} {r['turns_per_replica']}, "
            f"{r['same_replica_fraction']:.2f} of later turns on the previous turn's replica, "
            f"KV cache {r['kv_cache_tokens']:.0f} tokens ({r['kv_cache_copies']:.2f} of the histories)",
            flush=True,
        )
    out: dict[str, Any] = {"routers": results}
    if "affinity" in results and "round_robin" in results:
        a, rr = results["affinity"], results["round_robin"]
        out["affinity_vs_round_robin_throughput"] = a["turns_per_s"] / rr["turns_per_s"]
        out["affinity_vs_round_robin_hit_rate"] = a["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
        out["affinity_vs_round_robin_prefill"] = a["prefill_tokens"] / rr["prefill_tokens"]
        out["affinity_load_cv"] = a["load_cv"]
    if "affinity" in results and "least_loaded" in results:
        a, ll = results["affinity"], results["least_loaded"]
        out["affinity_vs_least_loaded_throughput"] = a["turns_per_s"] / ll["turns_per_s"]
        out["affinity_vs_least_loaded_hit_rate"] = a["hit_rate"] / ll["hit_rate"] if ll["hit_rate"] else float("inf")
    out["workload"] = {k: v for k, v in vars(args).items() if k not in ("out", "model_dir")}
    out["load_average_1m"] = os.getloadavg()[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--routers", default="affinity,round_robin,least_loaded")
    parser.add_argument("--groups", type=int, default=4, help="prompts; each shared by its group's trajectories")
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per prompt")
    parser.add_argument("--turns", type=int, default=10, help="policy turns per trajectory")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="length of each group's shared prompt")
    parser.add_argument("--obs-tokens", type=int, default=64, help="environment tokens appended after each turn")
    parser.add_argument(
        "--env-latency-ms", type=float, default=10.0, help="mean time of an environment step (uniform, 0 to 2x)"
    )
    parser.add_argument("--sample-tokens", type=int, default=2, help="tokens the policy samples per turn")
    parser.add_argument("--hidden-size", type=int, default=512, help="model width (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument(
        "--kv-cache-copies",
        type=float,
        default=0.55,
        help="each replica's KV cache, as a share of one copy of every trajectory's full history",
    )
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "forge-bench-multiturn-models"))
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    for key in (
        "affinity_vs_round_robin_throughput",
        "affinity_vs_round_robin_hit_rate",
        "affinity_load_cv",
    ):
        if key in result:
            print(f"{key} = {result[key]:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
