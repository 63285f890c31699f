"""Where a GRPO step's time goes, and what the service layer costs, with the app's own roles.

    python benchmarks/grpo_step.py --config configs/grpo_tiny.yaml --out grpo_step.json
    python benchmarks/grpo_step.py --config configs/grpo_tiny.yaml --steps 8 policy.max_tokens=32

It starts the roles exactly as ``apps/grpo/main.py`` does, then measures, one after another
(nothing overlaps, so each phase's time is its own):

- ``share_*``: the share of a step's time (medians over the steps) spent in generation (one ``generate.route`` per
  prompt, prebatched by the policy service), reward, reference, training and weight sync, over
  ``--steps`` synchronous steps. In the app, rollouts overlap training; this shows the costs.
- ``rollout_vs_bare_vllm_tokens_per_s``: generated tokens/s through the policy service (every
  prompt its own ``route`` call) / the same prompts, ``n``, ``max_tokens`` and temperature in
  one call of a bare ``VllmEngine`` in a plain process of its own (no Monarch), at the same
  weights (goal >= 0.9). Both run on version-0 weights, in alternating rounds, before any
  training step; the figure is the ratio of the medians over ``--rounds``.
- ``weight_sync_vs_memcpy``: state-dict bytes/s from the trainer into the policy (the app's
  ``PolicyWeights.sync``: fetch from the trainer, load into every replica) / bytes/s of an
  in-process copy of the same state dict into preallocated tensors (goal >= 0.5). Both transports
  (``message`` and ``file``) are measured; the figure is the configured one's.
- ``weight_sync_vs_vllm_reload``: the same sync's bytes/s / bytes/s of vLLM's own in-place
  reload (``reload_weights`` through the worker extension) of the same weights, already in the
  bare engine's process (goal >= 0.8): vLLM's reload is the floor on CPU, where it repacks
  every tensor, so this says what the sync adds on top of it. Reloads alternate with syncs.

The medium model (15.8 M parameters, 63 MB in float32: 512 wide, 6 layers, head_dim 64) is the
one to read the weight-sync figures on (a KV cache of 128 MiB holds its batch in one wave)::

    python benchmarks/grpo_step.py --steps 3 --rounds 5 --out grpo_step_medium.json \\
        model.path=models/medium model.tiny.hidden_size=512 model.tiny.num_layers=6 \\
        prompts_per_step=16 policy.max_tokens=32 policy.kv_cache_bytes=134217728

LoRA (``--adapter-sync RANK``, on its own): a full-weight trainer + policy and a LoRA trainer +
policy (an adapter of that rank on q/k/v/o, vLLM serving it) on the same model, their syncs
alternating. ``adapter_sync_bytes_vs_full``: the bytes an adapter version moves / a full
version's (goal <= 0.05); ``adapter_sync_s_vs_full_sync_s``: the seconds of one sync, the same
way (goal <= 0.3)::

    python benchmarks/grpo_step.py --config configs/grpo_medium.yaml --adapter-sync 8 --out adapter_sync.json

Prints a table and writes everything as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import forge.controller  # noqa: F401  (before monarch)
from forge.controller import quiet_monarch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from apps.common.launch import Roles, RunResources, open_run, stop_roles  # noqa: E402
from apps.common.weights import PolicyWeights  # noqa: E402
from apps.grpo.roles import prepare_model, start_roles  # noqa: E402
from forge.distributed import call_spmd  # noqa: E402

PHASES = ("generation", "reward", "reference", "training", "weight_sync")


async def _rollout_once(roles: Roles, prompts: list[Any]) -> tuple[list[Any], float]:
    from forge.actors import prompt_key

    t0 = time.perf_counter()
    groups = await asyncio.gather(*(roles.policy.generate.route(p, key=prompt_key(p)) for p in prompts))
    return groups, time.perf_counter() - t0


def _tokens(groups: list[Any]) -> int:
    return sum(int(c.token_ids.numel()) for g in groups for c in g.completions)


async def measure_steps(cfg: Any, roles: Roles, weights: PolicyWeights, steps: int) -> dict[str, Any]:
    """``steps`` synchronous GRPO steps, each phase timed on its own."""
    import torch

    from forge.losses import group_advantages
    from forge.types import Episode, EpisodeBatch

    samples: dict[str, list[float]] = {k: [] for k in PHASES}
    for step in range(steps + 1):  # step 0 warms every path up and is not counted
        prompts = await roles.dataset.sample_many.call_one(cfg.prompts_per_step)
        times = {}
        groups, times["generation"] = await _rollout_once(roles, prompts)
        pairs = [(g.prompt, c) for g in groups for c in g.completions]
        t0 = time.perf_counter()
        rewards = await roles.reward.score.route_many([(p, c.text) for p, c in pairs])
        t1 = time.perf_counter()
        refs = await roles.reference.logprobs.route_many([(c.prompt_ids, c.token_ids) for _, c in pairs])
        t2 = time.perf_counter()
        episodes = []
        for gi, g in enumerate(groups):
            n = len(g.completions)
            r = rewards[gi * n : (gi + 1) * n]
            adv = group_advantages(torch.tensor(r)).tolist()
            for j, c in enumerate(g.completions):
                episodes.append(
                    Episode(
                        f"{gi}", c.prompt_ids, c.token_ids, c.logprobs, refs[gi * n + j], r[j], adv[j], c.policy_version
                    )
                )
        t3 = time.perf_counter()
        await call_spmd(roles.trainer.train_step, EpisodeBatch.pack(episodes))
        t4 = time.perf_counter()
        await weights.sync()
        t5 = time.perf_counter()
        times.update(reward=t1 - t0, reference=t2 - t1, training=t4 - t3, weight_sync=t5 - t4)
        if step > 0:
            for k in PHASES:
                samples[k].append(times[k])
    # Medians per phase: a neighbour's burst on shared cores moves one step, not the figure.
    medians = {k: statistics.median(v) for k, v in samples.items()}
    step_total = sum(medians.values())
    return {
        "steps": steps,
        "step_time_s": step_total,
        **{f"{k}_s": v for k, v in medians.items()},
        **{f"share_{k}": v / step_total for k, v in medians.items()},
    }


async def _policy_update_s(roles: Roles) -> float:
    """Seconds the policy replica spent in ``update_weights`` since the last call (its recorded
    ``policy/update_weights_s``, drained)."""
    (records,) = await roles.policy.drain_metrics.fanout()
    return sum(value for name, value, _ in records if name == "policy/update_weights_s")


async def measure_weight_sync(
    cfg: Any,
    roles: Roles,
    resources: RunResources,
    repeats: int,
    bare_reload: Callable[[], Awaitable[float]] | None = None,
) -> dict[str, Any]:
    """bytes/s of ``PolicyWeights.sync`` (each transport), of an in-process copy and, with
    ``bare_reload`` (seconds of one in-place vLLM reload of the same weights in a bare engine's
    process), of vLLM's own reload; the reloads alternate with the syncs, so load drift on
    shared cores hits both alike."""
    import torch

    state_dict, _ = await call_spmd(roles.trainer.weights)
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    # The baseline is a plain memory copy of the same tensors into buffers allocated once
    # (``copy_``); ``clone()`` (which also allocates, so pays page faults) is reported beside it.
    targets = {k: torch.empty_like(v) for k, v in state_dict.items()}
    copy_s, clone_s = [], []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        for k, v in state_dict.items():
            targets[k].copy_(v)
        copy_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        copied = {k: v.clone() for k, v in state_dict.items()}
        clone_s.append(time.perf_counter() - t0)
        del copied
    memcpy_bps = nbytes / statistics.median(copy_s)
    out: dict[str, Any] = {
        "state_dict_bytes": nbytes,
        "memcpy_bytes_per_s": memcpy_bps,
        "clone_bytes_per_s": nbytes / statistics.median(clone_s),
    }
    configured = cfg.weight_sync.transport
    reload_s: list[float] = []
    if bare_reload is not None:
        await bare_reload()  # warm-up
    for transport in ("message", "file"):
        cfg.weight_sync.transport = transport
        weights = PolicyWeights(roles.trainer, roles.policy, transport, resources.weights_dir, 60.0)
        await weights.sync()  # warm-up
        await _policy_update_s(roles)
        times, loads = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await weights.sync()
            times.append(time.perf_counter() - t0)
            loads.append(await _policy_update_s(roles))
            if bare_reload is not None:
                reload_s.append(await bare_reload())
        bps = nbytes / statistics.median(times)
        out[f"sync_{transport}_s"] = statistics.median(times)
        out[f"sync_{transport}_bytes_per_s"] = bps
        out[f"weight_sync_vs_memcpy_{transport}"] = bps / memcpy_bps
        # The policy-side part: reading the payload and vLLM's in-place reload (CPU repacking).
        out[f"sync_{transport}_policy_update_s"] = statistics.median(loads)
    cfg.weight_sync.transport = configured
    out["weight_sync_vs_memcpy"] = out[f"weight_sync_vs_memcpy_{configured}"]
    if reload_s:
        # The floor: vLLM reloading tensors already in its process. A ratio of 1 would mean the
        # sync (fetch from the trainer, carry, load into every replica) costs no more than that.
        reload_bps = nbytes / statistics.median(reload_s)
        out["vllm_reload_s"] = statistics.median(reload_s)
        out["vllm_reload_bytes_per_s"] = reload_bps
        for transport in ("message", "file"):
            out[f"weight_sync_vs_vllm_reload_{transport}"] = out[f"sync_{transport}_bytes_per_s"] / reload_bps
        out["weight_sync_vs_vllm_reload"] = out[f"weight_sync_vs_vllm_reload_{configured}"]
    return out


def _bare_engine_process(
    conn: Any, model_path: str, engine_args: dict[str, Any], texts: list[str], sample: dict[str, Any]
) -> None:
    """A plain process (no Monarch) with a bare ``VllmEngine``, obeying the parent's commands.

    ``"go"``: one generate of ``texts``, answered with (tokens, seconds). ``("weights", sd)``:
    keep ``sd`` (validated once, as the policy does before every load). ``"reload"``: load the
    kept weights in place with vLLM's own ``reload_weights`` (the extension's RPC), answered with
    its seconds: the floor of any weight sync, since the tensors are already in this process.
    Anything else stops it.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from forge.generation import VllmEngine
    from forge.generation.vllm_io import checked_weights
    from forge.generation.weight_sync import checkpoint_spec, checkpoint_ties_embeddings

    engine = VllmEngine.create(model_path, use_tqdm_on_load=False, **engine_args)
    spec = checkpoint_spec(model_path)
    tied = checkpoint_ties_embeddings(engine.llm.llm_engine.model_config)
    weights: dict[str, Any] = {}
    conn.send("ready")
    while True:
        command = conn.recv()
        if command == "go":
            t0 = time.perf_counter()
            out = engine.generate(texts, **sample)
            conn.send((sum(int(c.token_ids.numel()) for g in out for c in g), time.perf_counter() - t0))
        elif isinstance(command, tuple) and command[0] == "weights":
            weights = checked_weights(command[1], 1, spec, tied)
            conn.send(len(weights))
        elif command == "reload":
            t0 = time.perf_counter()
            engine.llm.collective_rpc("forge_load_state_dict", args=(weights,))
            conn.send(time.perf_counter() - t0)
        else:
            break
    engine.shutdown()


async def run(cfg: Any, steps: int, rounds: int) -> dict[str, Any]:
    import multiprocessing

    model_path = prepare_model(cfg)
    # Both transports are measured: the roles start as the file transport's (with the run's
    # weight folder, which its policy alone loads from), then run the configured one.
    configured, cfg.weight_sync.transport = cfg.weight_sync.transport, "file"
    resources = await open_run(cfg, cfg.weight_sync)
    try:
        roles = await start_roles(cfg, model_path, resources)
    except BaseException:
        resources.close()
        raise
    cfg.weight_sync.transport = configured
    resources.weights = PolicyWeights(roles.trainer, roles.policy, configured, resources.weights_dir, 60.0)
    p = cfg.policy
    bare = None
    try:
        # The bare engine runs in its own plain process, like the policy replica's but without
        # Monarch; service and bare rounds alternate on the same prompts, so load drift on
        # shared cores hits both alike.
        prompts = await roles.dataset.sample_many.call_one(cfg.prompts_per_step)
        engine_args = dict(
            max_model_len=p.max_model_len,
            seed=cfg.seed,
            dtype=p.dtype,
            kv_cache_bytes=p.kv_cache_bytes,
            **p.engine_kwargs,
        )
        sample = dict(n=cfg.group_size, temperature=p.temperature, max_tokens=p.max_tokens)
        conn, child_conn = multiprocessing.Pipe()
        bare = multiprocessing.get_context("spawn").Process(
            target=_bare_engine_process,
            args=(child_conn, model_path, engine_args, [q.text for q in prompts], sample),
            daemon=True,
        )
        bare.start()
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, conn.recv) == "ready"

        async def bare_round() -> tuple[int, float]:
            conn.send("go")
            return await loop.run_in_executor(None, conn.recv)

        await _rollout_once(roles, prompts)  # warm-up
        await bare_round()
        service_rates, bare_rates = [], []
        for _ in range(rounds):
            groups, seconds = await _rollout_once(roles, prompts)
            service_rates.append(_tokens(groups) / seconds)
            n, seconds = await bare_round()
            bare_rates.append(n / seconds)
        result: dict[str, Any] = {
            "config": {
                "prompts_per_step": cfg.prompts_per_step,
                "group_size": cfg.group_size,
                "max_tokens": p.max_tokens,
                "temperature": p.temperature,
            }
        }
        result["rounds"] = rounds
        result["rollout_tokens_per_s"] = statistics.median(service_rates)
        result["bare_vllm_tokens_per_s"] = statistics.median(bare_rates)
        result["rollout_vs_bare_vllm_tokens_per_s"] = result["rollout_tokens_per_s"] / result["bare_vllm_tokens_per_s"]
        result.update(await measure_steps(cfg, roles, resources.weights, steps))
        # The bare engine gets the trainer's weights once, as tensors in its own process.
        conn.send(("weights", (await call_spmd(roles.trainer.weights))[0]))
        await loop.run_in_executor(None, conn.recv)

        async def bare_reload() -> float:
            conn.send("reload")
            return await loop.run_in_executor(None, conn.recv)

        result.update(await measure_weight_sync(cfg, roles, resources, repeats=max(steps, 5), bare_reload=bare_reload))
        conn.send("stop")
        bare.join(timeout=30)
    finally:
        if bare is not None and bare.is_alive():
            bare.kill()
        await stop_roles(roles)
        resources.close()
    return result


async def measure_adapter_sync(cfg: Any, repeats: int, rank: int) -> dict[str, Any]:
    """A full-weight trainer + policy and a LoRA (``rank``, on the attention projections) trainer +
    policy on the same model, started as the app starts them; their syncs (``PolicyWeights.sync``,
    the configured transport) alternate, so load drift on shared cores hits both alike. Bytes are
    what the sync moves: the state dict, or the adapter's tensors."""
    import copy

    from apps.common.launch import policy_config
    from apps.common.roles import POLICY_ENV, QUIET_ENV
    from apps.grpo.roles import trainer_config
    from forge.actors import Policy, Trainer
    from forge.controller import ForgeActor
    from forge.generation.weight_folder import RunFolder
    from forge.models.lora import LoraSettings

    model_path = prepare_model(cfg)
    lora_cfg = copy.deepcopy(cfg)
    lora_cfg.trainer.lora = LoraSettings(rank=rank, alpha=2.0 * rank)
    started: list[Any] = []
    folders: list[Any] = []
    try:
        syncs: dict[str, PolicyWeights] = {}
        for name, c in (("full", cfg), ("adapter", lora_cfg)):
            folder = RunFolder.create(c.weight_sync.root())
            folders.append(folder)
            env = {"OMP_NUM_THREADS": "1"}
            policy = await Policy.options(name=f"policy_{name}", env={**POLICY_ENV, **env}).as_service(
                policy_config(c, model_path, c.group_size, str(folder.path))
            )
            started.append(policy)
            trainer = await Trainer.options(name=f"trainer_{name}", env={**QUIET_ENV, **env}).as_actor(
                trainer_config(c, model_path)
            )
            started.append(trainer)
            transport, timeout = c.weight_sync.transport, 120.0  # every call across processes is bounded
            syncs[name] = PolicyWeights(trainer, policy, transport, str(folder.path), timeout, fetch_timeout_s=timeout)
        out: dict[str, Any] = {"adapter_rank": rank, "transport": cfg.weight_sync.transport}
        for name, sync in syncs.items():
            weights, _ = await call_spmd(sync.trainer.weights, timeout_s=120.0)
            out[f"{name}_sync_bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
            await asyncio.wait_for(sync.sync(), 120.0)  # warm-up: the first file, the first adapter load
        times: dict[str, list[float]] = {name: [] for name in syncs}
        for _ in range(repeats):
            for name, sync in syncs.items():
                t0 = time.perf_counter()
                await asyncio.wait_for(sync.sync(), 120.0)
                times[name].append(time.perf_counter() - t0)
        for name in syncs:
            out[f"{name}_sync_s"] = statistics.median(times[name])
        out["adapter_sync_bytes_vs_full"] = out["adapter_sync_bytes"] / out["full_sync_bytes"]
        out["adapter_sync_s_vs_full_sync_s"] = out["adapter_sync_s"] / out["full_sync_s"]
        out["repeats"] = repeats
        return out
    finally:
        for handle in started:
            stop = handle.shutdown() if hasattr(handle, "route_many") else ForgeActor.shutdown(handle)
            try:
                await asyncio.wait_for(stop, 60)
            except Exception as exc:  # a role that does not stop is reaped at exit
                print(f"stopping a role failed: {exc}", file=sys.stderr)
        for folder in folders:
            folder.close()


def print_adapter_table(result: dict[str, Any]) -> None:
    print(f"\nWeight sync, full weights vs a rank-{result['adapter_rank']} LoRA adapter ({result['transport']})")
    for name in ("full", "adapter"):
        print(f"{name:<8}{result[f'{name}_sync_bytes'] / 1e6:>10.3f} MB{result[f'{name}_sync_s'] * 1e3:>10.1f} ms")
    print(f"adapter_sync_bytes_vs_full     {result['adapter_sync_bytes_vs_full']:.4f}  (goal <= 0.05)")
    print(f"adapter_sync_s_vs_full_sync_s  {result['adapter_sync_s_vs_full_sync_s']:.4f}  (goal <= 0.3)")


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\nGRPO step breakdown (median of {result['steps']} steps, {result['step_time_s'] * 1e3:.0f} ms/step, "
        "phases run one after another)"
    )
    print(f"{'phase':<14}{'ms/step':>10}{'share':>9}")
    for k in PHASES:
        print(f"{k:<14}{result[f'{k}_s'] * 1e3:>10.1f}{result[f'share_{k}']:>9.1%}")
    print()
    rows = [
        ("rollout tokens/s (policy service)", f"{result['rollout_tokens_per_s']:.0f}"),
        ("bare vLLM tokens/s (same prompts)", f"{result['bare_vllm_tokens_per_s']:.0f}"),
        ("rollout_vs_bare_vllm_tokens_per_s", f"{result['rollout_vs_bare_vllm_tokens_per_s']:.3f}  (goal >= 0.9)"),
        ("state dict", f"{result['state_dict_bytes'] / 1e6:.2f} MB"),
        (
            "in-process copy",
            f"{result['memcpy_bytes_per_s'] / 1e9:.2f} GB/s "
            f"(copy_; clone() {result['clone_bytes_per_s'] / 1e9:.2f} GB/s)",
        ),
        (
            "sync via message",
            f"{result['sync_message_bytes_per_s'] / 1e9:.3f} GB/s ({result['sync_message_s'] * 1e3:.1f} ms)",
        ),
        ("sync via file", f"{result['sync_file_bytes_per_s'] / 1e9:.3f} GB/s ({result['sync_file_s'] * 1e3:.1f} ms)"),
        (
            "  of which policy update_weights",
            f"{result['sync_file_policy_update_s'] * 1e3:.1f} ms (file), "
            f"{result['sync_message_policy_update_s'] * 1e3:.1f} ms (message)",
        ),
        ("weight_sync_vs_memcpy", f"{result['weight_sync_vs_memcpy']:.3f}  (goal >= 0.5)"),
        (
            "vLLM in-place reload (bare engine)",
            f"{result['vllm_reload_bytes_per_s'] / 1e9:.3f} GB/s ({result['vllm_reload_s'] * 1e3:.1f} ms)",
        ),
        (
            "weight_sync_vs_vllm_reload",
            f"{result['weight_sync_vs_vllm_reload']:.3f}  (goal >= 0.8; file "
            f"{result['weight_sync_vs_vllm_reload_file']:.3f}, "
            f"message {result['weight_sync_vs_vllm_reload_message']:.3f})",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main(argv: list[str] | None = None) -> int:
    quiet_monarch()
    import monarch.config

    monarch.config.configure(process_exit_timeout="1s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/grpo_tiny.yaml", help="the app's YAML config")
    parser.add_argument("--steps", type=int, default=7, help="synchronous steps timed, after one warm-up (medians)")
    parser.add_argument(
        "--rounds", type=int, default=15, help="rollout rounds timed for the throughput ratio (medians)"
    )
    parser.add_argument(
        "--adapter-sync",
        type=int,
        default=0,
        metavar="RANK",
        help="measure only the weight sync of a full trainer against a LoRA trainer of this rank, side by side",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from apps.grpo.config import GRPOConfig
    from forge.config import load_config

    cfg = load_config(GRPOConfig, args.config, args.overrides)
    load_before = os.getloadavg()[0]  # other tenants of shared cores move every figure: record it
    if args.adapter_sync:
        result = asyncio.run(measure_adapter_sync(cfg, max(args.steps, 5), args.adapter_sync))
    else:
        result = asyncio.run(run(cfg, args.steps, args.rounds))
    result["load_avg_1m_before"], result["load_avg_1m_after"] = load_before, os.getloadavg()[0]
    (print_adapter_table if args.adapter_sync else print_table)(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
