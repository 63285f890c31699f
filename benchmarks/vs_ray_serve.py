"""forge services vs Ray Serve ``@serve.batch``: the same batched workloads under the same load.

    scripts/install_bench.sh          # once: .venv-bench/ with ray[serve] and trl beside forge
    .venv-bench/bin/python benchmarks/vs_ray_serve.py --out vs_ray_serve.json \\
        --plot docs/img/vs_ray_serve.png

What is compared, and what is held equal:

- **Three workloads**, each a batched async endpoint (list in, list out) that holds the CPU like a
  forward pass: ``busy`` costs a fixed 3 ms per call plus 50 us per item (a busy-wait, so that
  batches cannot overlap for free), ``transformer`` is a 2-layer ``nn.TransformerEncoder``
  (d_model 128) over token lists of 8-48 tokens, padded per batch, one torch thread.
  ``multiplex`` serves ``MUX_MODELS`` busy models (each its own offset, so a wrong model is
  caught) with requests spread over them by a Zipf law, where a replica holds at most
  ``MUX_MAX_MODELS`` and a load holds the CPU ``MUX_LOAD_S``: Ray's
  ``@serve.multiplexed(max_num_models_per_replica=M)`` under ``@serve.batch`` against forge's
  ``@model_loader`` and ``multiplexed=True`` endpoint (``options(max_models=M)``, routed
  ``model_aware``). Its cells add the mean batch size per model (averaged over the models) and
  model loads per 1,000 requests, tallied by the client from what each result carries, the same
  way for both; under ``workloads.multiplex`` the JSON adds ``forge_vs_ray_serve_batch_fill``.
- **The same batching**: at most ``MAX_BATCH`` items, ``MAX_WAIT_S`` timed from a batch's first
  item, one batch at a time per replica; ``@serve.batch(max_batch_size, batch_wait_timeout_s)``
  for Ray, ``@endpoint(batch=Batching(max_size, max_wait_s))`` for forge.
- **The same replicas and routing algorithm**: ``REPLICAS`` replicas, each its own process;
  both route by power of two choices on in-flight requests (Ray's default router; forge's
  ``least_loaded``); for ``multiplex`` each system's model-aware router (Ray's prefers replicas
  holding the model, then power of two choices; forge's ``model_aware``). Ray's
  ``max_ongoing_requests`` is raised to ``MAX_ONGOING`` so that it does not cap batches (its
  default 5 would; forge has no admission limit by default).
- **The same load**: a closed loop of N clients in this process, each sending one request,
  awaiting its result, then sending the next, through Ray's ``DeploymentHandle`` (no HTTP) or
  forge's ``svc.infer.route``. Each cell is a warm-up then a timed window; the systems take
  turns at each concurrency level, and each cell is run ``--rounds`` times, keeping the round
  with the highest throughput (the same rule for both), to filter out other tenants' load.

Ray runs locally (``ray.init(num_cpus=2)``, no dashboard, bound to 127.0.0.1, no HTTP proxy).
``forge_vs_ray_serve_throughput`` is forge's throughput / Ray's at the concurrency where Ray's
throughput is highest (for the ``busy`` workload; per workload under ``workloads``), and
``forge_p99_vs_ray_p99`` the p99 latency ratio there. Takes about 6 minutes on 2 cores.
"""

from __future__ import annotations

import os

# Ray Serve's own throughput mode (router and user code on the replica's main loop, gRPC
# between handle and replica, no per-request logging to stderr): Ray at its fastest. Direct
# ingress (HTTP/gRPC servers on the replicas) is left off: the handle API needs none.
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
os.environ.setdefault("RAY_SERVE_ENABLE_DIRECT_INGRESS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import forge.controller  # before monarch (and ray, which must not see monarch first either)
from forge.controller import Batching, ForgeActor, endpoint, model_loader

MAX_BATCH = 32  # most items in one batch
MAX_WAIT_S = 0.005  # longest a batch's first item waits for company
REPLICAS = 2  # replicas of the served model, each its own process
MAX_ONGOING = 1024  # Ray's per-replica admission limit (>= any load here: never caps a batch)
FIXED_COST_S = 0.003  # busy workload: cost of one call...
PER_ITEM_COST_S = 0.00005  # ...plus this per item
SEQ_LENS = (8, 48)  # transformer workload: token-list lengths, drawn uniformly
VOCAB, D_MODEL = 64, 128


# --------------------------------------------------------------------------- workloads
def busy(seconds: float) -> None:
    """Hold the CPU like a model forward would (sleeping would let batches overlap for free)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class BusyModel:
    """Fixed cost per call plus a small cost per item; returns ``x + 1`` for each item."""

    def __call__(self, items: list[int]) -> list[int]:
        busy(FIXED_COST_S + PER_ITEM_COST_S * len(items))
        return [x + 1 for x in items]

    @staticmethod
    def make_item(rng: random.Random) -> int:
        return rng.randrange(1_000_000)

    @staticmethod
    def check(item: int, result: Any) -> bool:
        return result == item + 1


class TransformerModel:
    """A 2-layer TransformerEncoder over padded token lists; returns one float per item."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)  # REPLICAS replicas share 2 cores
        torch.manual_seed(0)
        self.torch = torch
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL, padding_idx=0)
        layer = torch.nn.TransformerEncoderLayer(D_MODEL, nhead=4, dim_feedforward=2 * D_MODEL, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(D_MODEL, 1)
        for module in (self.embed, self.encoder, self.head):
            module.eval()

    def __call__(self, items: list[list[int]]) -> list[float]:
        torch = self.torch
        longest = max(len(t) for t in items)
        tokens = torch.zeros(len(items), longest, dtype=torch.long)  # 0 = <pad>
        for i, t in enumerate(items):
            tokens[i, : len(t)] = torch.tensor(t)
        pad = tokens == 0
        with torch.inference_mode():
            hidden = self.encoder(self.embed(tokens), src_key_padding_mask=pad)  # [B, T, D]
            keep = (~pad).unsqueeze(-1).float()
            pooled = (hidden * keep).sum(1) / keep.sum(1)  # mean over real tokens
            return self.head(pooled).squeeze(-1).tolist()

    @staticmethod
    def make_item(rng: random.Random) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(rng.randint(*SEQ_LENS))]

    @staticmethod
    def check(item: list[int], result: Any) -> bool:
        return isinstance(result, float)


MUX_MODELS = 8  # multiplex workload: K distinct models, requests spread over them by a Zipf law...
MUX_MAX_MODELS = 2  # ...of which one replica holds at most M (REPLICAS x M < K: models must be swapped)
MUX_ZIPF = 1.1  # popularity exponent: model k gets a share proportional to 1 / (k + 1) ** MUX_ZIPF
MUX_LOAD_S = 0.02  # CPU held by one model load (busy-wait, like deserialising a small checkpoint)


class MultiplexedModels:
    """The multiplex workload's replica-side code, identical for both servers.

    Model ``m<k>`` is the busy model with offset ``k``: it serves ``x`` as ``x + k``, so a request
    served by the wrong model is caught. Each result also carries what the client tallies in
    its timed window, the same way for both systems: the size of the batch that served it, the
    replica's pid and how many models that replica has loaded so far.
    """

    def __init__(self) -> None:
        self.loads = 0
        self.pid = os.getpid()

    def load(self, model_id: str) -> int:
        busy(MUX_LOAD_S)
        self.loads += 1
        return int(model_id[1:])  # the "model": its offset

    def __call__(self, offset: int, items: list[int]) -> list[tuple[int, int, int, int]]:
        busy(FIXED_COST_S + PER_ITEM_COST_S * len(items))
        return [(x + offset, len(items), self.pid, self.loads) for x in items]


class MultiplexWorkload:
    """Requests ``(model_id, x)``, model ids drawn by the Zipf law over ``MUX_MODELS`` models."""

    WEIGHTS = [1.0 / (k + 1) ** MUX_ZIPF for k in range(MUX_MODELS)]

    @staticmethod
    def make_item(rng: random.Random) -> tuple[str, int]:
        k = rng.choices(range(MUX_MODELS), MultiplexWorkload.WEIGHTS)[0]
        return f"m{k}", rng.randrange(1_000_000)

    @staticmethod
    def check(item: tuple[str, int], result: Any) -> bool:
        return result[0] == item[1] + int(item[0][1:])


class MultiplexTally:
    """What the multiplex workload reports beyond throughput, from the results in the window.

    A request served in a batch of ``b`` is ``1/b`` of that batch, so a model's batches are the
    sum of ``1/b`` over its requests and its mean batch size is requests / batches. Model loads
    are each replica's load counter at the window's end minus its value before the window.
    """

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.batches: dict[str, float] = {}
        self.loads_before: dict[int, int] = {}
        self.loads_last: dict[int, int] = {}

    def add(self, item: tuple[str, int], result: tuple[int, int, int, int], in_window: bool) -> None:
        _, batch_size, pid, loads = result
        if not in_window:
            self.loads_before[pid] = max(self.loads_before.get(pid, 0), loads)
            return
        model_id = item[0]
        self.requests[model_id] = self.requests.get(model_id, 0) + 1
        self.batches[model_id] = self.batches.get(model_id, 0.0) + 1.0 / batch_size
        self.loads_last[pid] = max(self.loads_last.get(pid, 0), loads)

    def summary(self) -> dict[str, Any]:
        requests = sum(self.requests.values())
        per_model = {
            m: self.requests[m] / self.batches[m]
            for m in sorted(self.requests, key=lambda m: int(m[1:]))  # m0 is the most popular
        }
        loads = sum(last - self.loads_before.get(pid, last) for pid, last in self.loads_last.items())
        return {
            "mean_batch_size_per_model": per_model,
            # The headline fill: each model's mean batch size, averaged over the models served.
            "mean_batch_fill_per_model": statistics.fmean(per_model.values()) if per_model else 0.0,
            "mean_batch_size": requests / sum(self.batches.values()) if requests else 0.0,
            "model_loads": loads,
            "model_loads_per_1k": 1000 * loads / requests if requests else 0.0,
        }


WORKLOADS: dict[str, type] = {"busy": BusyModel, "transformer": TransformerModel, "multiplex": MultiplexWorkload}


# --------------------------------------------------------------------------- the two servers
class ForgeModel(ForgeActor):
    def __init__(self, workload: str) -> None:
        self.model = WORKLOADS[workload]()

    @endpoint(batch=Batching(max_size=MAX_BATCH, max_wait_s=MAX_WAIT_S))
    async def infer(self, items: list[Any]) -> list[Any]:
        return self.model(items)


class ForgeMultiplexed(ForgeActor):
    """The multiplex workload on forge: ``@model_loader`` and a multiplexed batched endpoint."""

    def __init__(self) -> None:
        self.models = MultiplexedModels()

    @model_loader  # the capacity is the service's options(max_models=MUX_MAX_MODELS)
    async def load_model(self, model_id: str) -> int:
        return self.models.load(model_id)

    @endpoint(batch=Batching(max_size=MAX_BATCH, max_wait_s=MAX_WAIT_S), multiplexed=True)
    async def infer(self, model: int, items: list[int]) -> list[tuple[int, int, int, int]]:
        return self.models(model, items)


async def start_forge(workload: str) -> tuple[Callable[[Any], Awaitable[Any]], Callable[[], Awaitable[None]]]:
    if workload == "multiplex":  # model_aware routing: the default of multiplexed endpoints
        mux = await ForgeMultiplexed.options(num_replicas=REPLICAS, max_models=MUX_MAX_MODELS).as_service()

        async def call(item: tuple[str, int]) -> Any:
            return await mux.infer.route(item[1], model_id=item[0])

        return call, mux.shutdown
    svc = await ForgeModel.options(num_replicas=REPLICAS, router="least_loaded").as_service(workload)
    return svc.infer.route, svc.shutdown


def start_ray_cluster() -> None:
    import logging

    import ray
    from ray import serve

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level=logging.ERROR,
        log_to_driver=False,
        configure_logging=True,
    )
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the driver's "app is ready" lines
    serve.start(proxy_location="Disabled", logging_config={"log_level": "ERROR"})


async def start_ray_multiplexed() -> tuple[Callable[[Any], Awaitable[Any]], Callable[[], Awaitable[None]]]:
    """The multiplex workload on Ray Serve: ``@serve.multiplexed`` loads, ``@serve.batch`` batches
    (Ray splits a batch by model id, and ``get_multiplexed_model_id()`` names the batch's model)."""
    from ray import serve

    @serve.deployment(
        num_replicas=REPLICAS,
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": 2 / REPLICAS},
        logging_config={"log_level": "ERROR", "enable_access_log": False},
    )
    class RayMultiplexed:
        def __init__(self) -> None:
            self.models = MultiplexedModels()

        @serve.multiplexed(max_num_models_per_replica=MUX_MAX_MODELS)
        async def get_model(self, model_id: str) -> int:
            return self.models.load(model_id)

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=MAX_WAIT_S)
        async def __call__(self, items: list[int]) -> list[tuple[int, int, int, int]]:
            model = await self.get_model(serve.get_multiplexed_model_id())
            return self.models(model, items)

    app_name = "vs-forge-multiplex"
    handle = serve.run(RayMultiplexed.bind(), name=app_name, route_prefix=None)
    handles = {f"m{k}": handle.options(multiplexed_model_id=f"m{k}") for k in range(MUX_MODELS)}  # made once

    async def call(item: tuple[str, int]) -> Any:
        return await handles[item[0]].remote(item[1])

    async def stop() -> None:
        serve.delete(app_name)

    return call, stop


async def start_ray(workload: str) -> tuple[Callable[[Any], Awaitable[Any]], Callable[[], Awaitable[None]]]:
    from ray import serve

    if workload == "multiplex":
        return await start_ray_multiplexed()

    @serve.deployment(
        num_replicas=REPLICAS,
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": 2 / REPLICAS},
        logging_config={"log_level": "ERROR", "enable_access_log": False},
    )
    class RayModel:
        def __init__(self, workload: str) -> None:
            self.model = WORKLOADS[workload]()

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=MAX_WAIT_S)
        async def __call__(self, items: list[Any]) -> list[Any]:
            return self.model(items)

    app_name = f"vs-forge-{workload}"
    handle = serve.run(RayModel.bind(workload), name=app_name, route_prefix=None)

    async def call(item: Any) -> Any:
        return await handle.remote(item)

    async def stop() -> None:
        serve.delete(app_name)

    return call, stop


# --------------------------------------------------------------------------- the load
async def closed_loop(
    call: Callable[[Any], Awaitable[Any]],
    workload: type,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    seed: int = 0,
    tally: MultiplexTally | None = None,
) -> dict[str, Any]:
    """``concurrency`` clients, each: send one request, await it, send the next.

    Counts requests that finish inside the timed window (after ``warmup_s``, ``duration_s``
    long); latency is measured per request from send to result. ``tally`` sees every result
    that finished before the window's end, and whether it finished inside the window.
    """
    latencies: list[float] = []
    wrong = 0
    start = time.perf_counter()
    window_start, window_end = start + warmup_s, start + warmup_s + duration_s

    async def client(cid: int) -> None:
        nonlocal wrong
        rng = random.Random(seed * 100_003 + cid)
        while True:
            item = workload.make_item(rng)
            t0 = time.perf_counter()
            if t0 >= window_end:
                return
            result = await call(item)
            t1 = time.perf_counter()
            if not workload.check(item, result):
                wrong += 1
            in_window = window_start <= t1 <= window_end
            if in_window:
                latencies.append(t1 - t0)
            if tally is not None and t1 <= window_end:  # before the window, or in it
                tally.add(item, result, in_window)

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    if wrong:
        raise AssertionError(f"{wrong} requests got a wrong result")
    latencies.sort()
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "throughput_rps": len(latencies) / duration_s,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "mean_ms": 1e3 * statistics.fmean(latencies),
        **(tally.summary() if tally is not None else {}),
    }


# --------------------------------------------------------------------------- the run
async def run_workload(
    name: str, levels: list[int], rounds: int, warmup_s: float, duration_s: float, which: list[str]
) -> dict[str, Any]:
    workload = WORKLOADS[name]
    systems, stops = {}, []
    for system, start in (("ray_serve", start_ray), ("forge", start_forge)):
        if system in which:
            systems[system], stop = await start(name)
            stops.append(stop)
    best: dict[str, dict[int, dict[str, float]]] = {s: {} for s in systems}
    try:
        for call in systems.values():  # warm both up: first batches, lazy torch init
            await closed_loop(call, workload, max(levels), 0.0, 1.0)
        for r in range(rounds):
            for i, c in enumerate(levels):
                order = list(systems) if (i + r) % 2 == 0 else list(reversed(systems))
                for system in order:
                    tally = MultiplexTally() if workload is MultiplexWorkload else None
                    cell = await closed_loop(systems[system], workload, c, warmup_s, duration_s, seed=r, tally=tally)
                    cell["load_avg_1m"] = os.getloadavg()[0]
                    extra = (
                        f"  batch/model {cell['mean_batch_fill_per_model']:5.1f}  "
                        f"loads/1k {cell['model_loads_per_1k']:5.1f}"
                        if tally is not None
                        else ""
                    )
                    print(
                        f"  {name:11s} round {r} c={c:<4d} {system:9s} {cell['throughput_rps']:8.0f} req/s  "
                        f"p50 {cell['p50_ms']:7.1f} ms  p99 {cell['p99_ms']:7.1f} ms{extra}",
                        flush=True,
                    )
                    if c not in best[system] or cell["throughput_rps"] > best[system][c]["throughput_rps"]:
                        best[system][c] = cell
    finally:
        for stop in reversed(stops):
            await stop()
    result: dict[str, Any] = {s: [best[s][c] for c in levels] for s in systems}
    if len(systems) < 2:
        return result
    ray_best = max(result["ray_serve"], key=lambda cell: cell["throughput_rps"])
    forge_there = best["forge"][ray_best["concurrency"]]
    result["ray_best_concurrency"] = ray_best["concurrency"]
    result["forge_vs_ray_serve_throughput"] = forge_there["throughput_rps"] / ray_best["throughput_rps"]
    result["forge_p99_vs_ray_p99"] = forge_there["p99_ms"] / ray_best["p99_ms"]
    result["forge_p50_vs_ray_p50"] = forge_there["p50_ms"] / ray_best["p50_ms"]
    result["throughput_ratio_by_concurrency"] = {
        str(c): best["forge"][c]["throughput_rps"] / best["ray_serve"][c]["throughput_rps"] for c in levels
    }
    if workload is MultiplexWorkload:
        result["forge_vs_ray_serve_batch_fill"] = (
            forge_there["mean_batch_fill_per_model"] / ray_best["mean_batch_fill_per_model"]
        )
    return result


def machine() -> dict[str, Any]:
    import importlib.metadata

    import psutil
    import torch

    try:  # a forge-only run (--systems forge) may run without Ray installed
        ray_version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        ray_version = None
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray_version,
        "load_avg_1m_before": os.getloadavg()[0],
    }


def print_table(results: dict[str, Any]) -> None:
    print(
        f"\n{'workload':11s} {'conc':>5s} | {'ray req/s':>9s} {'p50 ms':>7s} {'p99 ms':>7s} | "
        f"{'forge req/s':>11s} {'p50 ms':>7s} {'p99 ms':>7s} | {'thr x':>6s}"
    )
    for name, w in results["workloads"].items():
        for ray_cell, forge_cell in zip(w["ray_serve"], w["forge"]):
            c = ray_cell["concurrency"]
            mark = " <- Ray's best" if c == w["ray_best_concurrency"] else ""
            print(
                f"{name:11s} {c:5d} | {ray_cell['throughput_rps']:9.0f} {ray_cell['p50_ms']:7.1f} "
                f"{ray_cell['p99_ms']:7.1f} | {forge_cell['throughput_rps']:11.0f} {forge_cell['p50_ms']:7.1f} "
                f"{forge_cell['p99_ms']:7.1f} | {forge_cell['throughput_rps'] / ray_cell['throughput_rps']:6.2f}{mark}"
            )
    print(f"\nforge_vs_ray_serve_throughput  {results['forge_vs_ray_serve_throughput']:.2f}  (goal >= 2)")
    print(f"forge_p99_vs_ray_p99           {results['forge_p99_vs_ray_p99']:.2f}  (goal <= 1)")
    mux = results["workloads"].get("multiplex")
    if mux is not None:
        print(
            f"\nmultiplex: {MUX_MODELS} models, Zipf {MUX_ZIPF}, at most {MUX_MAX_MODELS} per replica "
            f"({results['settings']['replicas']} replicas)"
        )
        print(f"{'conc':>5s} | {'system':9s} {'req/s':>7s} {'p99 ms':>7s} {'batch/model':>11s} {'loads/1k':>8s}")
        for system in ("ray_serve", "forge"):
            for cell in mux[system]:
                print(
                    f"{cell['concurrency']:5d} | {system:9s} {cell['throughput_rps']:7.0f} {cell['p99_ms']:7.1f} "
                    f"{cell['mean_batch_fill_per_model']:11.2f} {cell['model_loads_per_1k']:8.2f}"
                )
        print(f"multiplex forge_vs_ray_serve_throughput {mux['forge_vs_ray_serve_throughput']:.2f}  (goal >= 2)")
        print(f"multiplex forge_vs_ray_serve_batch_fill {mux['forge_vs_ray_serve_batch_fill']:.2f}  (goal >= 1.5)")


def plot(results: dict[str, Any], path: str) -> None:
    """Throughput (top) and p99 latency (bottom) vs concurrency, one column per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, axes = plt.subplots(2, len(names), figsize=(max(5 * len(names), 9), 7), squeeze=False)  # room for the title
    for col, name in enumerate(names):
        w = results["workloads"][name]
        for system, style in (("forge", "o-"), ("ray_serve", "s--")):
            xs = [cell["concurrency"] for cell in w[system]]
            axes[0][col].plot(xs, [cell["throughput_rps"] for cell in w[system]], style, label=system)
            axes[1][col].plot(xs, [cell["p99_ms"] for cell in w[system]], style, label=system)
        axes[0][col].set_title(f"{name} workload")
        axes[0][col].set_ylabel("throughput (requests/s)")
        axes[1][col].set_ylabel("p99 latency (ms)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend()
    m = results["machine"]
    fig.suptitle(
        f"forge vs Ray Serve {m['ray']}: batch {results['settings']['max_batch']}, "
        f"wait {results['settings']['max_wait_s'] * 1e3:.0f} ms, {results['settings']['replicas']} replicas, "
        f"{m['cpus']} CPU cores"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--plot", help="write a PNG plot of the results to this file")
    parser.add_argument("--from-json", help="skip the run: print and plot the results in this JSON file")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 128], help="closed-loop clients")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--duration", type=float, default=4.0, help="seconds timed per cell")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before each timed window")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each cell; the best is kept")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["ray_serve", "forge"],
        choices=["ray_serve", "forge"],
        help="run only some systems (for profiling one alone; the ratios need both)",
    )
    args = parser.parse_args()

    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        t0 = time.perf_counter()
        info = machine()
        if "ray_serve" in args.systems:
            start_ray_cluster()
        workloads = {}
        for name in args.workloads:
            workloads[name] = await run_workload(
                name, args.concurrency, args.rounds, args.warmup, args.duration, args.systems
            )
        if len(args.systems) < 2:
            print(json.dumps(workloads, indent=1))
            return
        headline = workloads["busy"] if "busy" in workloads else next(iter(workloads.values()))
        info["load_avg_1m_after"] = os.getloadavg()[0]
        results = {
            "forge_vs_ray_serve_throughput": headline["forge_vs_ray_serve_throughput"],
            "forge_p99_vs_ray_p99": headline["forge_p99_vs_ray_p99"],
            "workloads": workloads,
            "settings": {
                "max_batch": MAX_BATCH,
                "max_wait_s": MAX_WAIT_S,
                "replicas": REPLICAS,
                "ray_max_ongoing_requests": MAX_ONGOING,
                "concurrency": args.concurrency,
                "ray_env": {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")},
                "duration_s": args.duration,
                "warmup_s": args.warmup,
                "rounds": args.rounds,
                "fixed_cost_s": FIXED_COST_S,
                "multiplex": {
                    "models": MUX_MODELS,
                    "max_models_per_replica": MUX_MAX_MODELS,
                    "zipf_exponent": MUX_ZIPF,
                    "load_cost_s": MUX_LOAD_S,
                },
                "per_item_cost_s": PER_ITEM_COST_S,
            },
            "machine": info,
            "wall_s": time.perf_counter() - t0,
        }
    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    forge.controller.quiet_monarch()
    asyncio.run(main())
    if "ray" in sys.modules:
        import threading

        import ray

        # After the event loop is gone: Serve's long-poll client lives on it and would print a
        # traceback against the stopped controller. Time-boxed: once, after a full run had
        # written its results, ray.shutdown() never returned.
        stopped = threading.Event()
        threading.Thread(target=lambda: (ray.shutdown(), stopped.set()), daemon=True).start()
        if not stopped.wait(60):
            print("vs_ray_serve: ray.shutdown() did not return within 60 s; exiting without it", file=sys.stderr)
            sys.stdout.flush()
            os._exit(0)
