"""forge's OpenAI front door against vLLM's own OpenAI server, and the agent path against the environment path.

    python benchmarks/vs_vllm_serve.py --out vs_vllm_serve.json
    python benchmarks/vs_vllm_serve.py --parts serve --requests 2000 --out serve.json
    python benchmarks/vs_vllm_serve.py --parts sessions --out sessions.json

Three parts, one after the other, nothing else running:

- ``serve``: ``python -m apps.serve.main --config configs/serve_tiny.yaml`` (one policy replica) and
  ``python -m vllm.entrypoints.openai.api_server`` on the same model folder (the tiny chat model
  forge made), each started alone, then loaded the same way by the ``openai`` client:
  ``--requests`` single-turn completions (``max_tokens`` ``--max-tokens``, temperature 1) from
  ``--clients`` concurrent clients. Keys ``forge_vs_vllm_serve_throughput`` (forge's requests/s over
  vLLM's; goal >= 0.9) and ``forge_vs_vllm_serve_p99`` (forge's p99 latency over vLLM's; goal
  <= 1.2), with each server's own figures under ``serve``.
- ``sessions``: forge's server on 2 policy replicas, ``--sessions`` concurrent multi-turn chats
  of ``--turns`` turns each, replies of up to ``--session-max-tokens`` tokens (the whole history
  sent every turn, as a chat client does, with its
  ``X-Session-ID``), once with ``server.router=key_affinity`` (every turn of a session on the
  replica holding its prefix) and once with ``round_robin``. Key
  ``session_vs_round_robin_prefill``: the prompt tokens the engines computed (prefill: prompt
  tokens less those their prefix caches held, from ``/metrics``) with session routing over round
  robin; goal <= 0.5.
- ``agent``: the GRPO app on ``configs/multiturn_tiny.yaml`` (the reversal game as an
  ``Environment``) and on ``configs/agent_tiny.yaml`` (the same game as an agent, through the front
  door), the same ``--steps`` and seed. Keys ``agent_vs_env_reward_last10`` (the agent run's mean
  reward of the last 10 steps minus the env run's; goal within 0.05) and
  ``agent_vs_env_steps_per_s`` (steps over the sum of step times, agent over env).

The load average is recorded before and after (other jobs on the machine change every figure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from apps.grpo.cli import app_command  # noqa: E402
from apps.serve.cli import serve_command, served_url  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}


def start_forge(folder: Path, overrides: list[str]) -> tuple[subprocess.Popen, str, Path]:
    """forge's server on a free port; its process, base URL and the model folder it made."""
    model = folder / "model"
    cmd = serve_command(folder, "server.max_concurrent=4096", *overrides)
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = served_url(proc, 300)
    if url is not None:
        return proc, url, model
    proc.kill()
    raise SystemExit("forge's server did not start")


def start_vllm(model: Path, port: int) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on ``model``: one engine, the KV cache forge's replica has."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--port",
        str(port),
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        "33554432",  # as configs/serve_tiny.yaml's policy.kv_cache_bytes
    ]
    env = {**ENV, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM's server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("vLLM's server did not start within 300 s")


async def load(url: str, requests: int, clients: int, max_tokens: int) -> dict[str, float]:
    """``requests`` completions from ``clients`` concurrent callers of one ``openai.AsyncOpenAI``."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    await client.completions.create(model="tiny", prompt="0=", max_tokens=max_tokens)  # warm
    queue = list(range(requests))
    latencies: list[float] = []
    tokens = 0

    async def caller() -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            done = await client.completions.create(
                model="tiny", prompt=f"{i}=", max_tokens=max_tokens, temperature=1.0, seed=i
            )
            latencies.append(time.perf_counter() - t0)
            tokens += done.usage.completion_tokens

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(clients)))
    wall = time.perf_counter() - started
    await client.close()
    latencies.sort()
    return {
        "requests_per_s": requests / wall,
        "tokens_per_s": tokens / wall,
        "p50_s": latencies[len(latencies) // 2],
        "p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "wall_s": wall,
    }


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_part(args: argparse.Namespace, folder: Path) -> dict:
    forge_proc, forge_url, model = start_forge(folder / "forge", args.forge_set)
    try:
        forge = asyncio.run(load(forge_url, args.requests, args.clients, args.max_tokens))
    finally:
        stop(forge_proc)
    print(f"  forge: {forge}", flush=True)
    vllm_proc, vllm_url = start_vllm(model, args.vllm_port)
    try:
        vllm = asyncio.run(load(vllm_url, args.requests, args.clients, args.max_tokens))
    finally:
        stop(vllm_proc)
    print(f"  vllm serve: {vllm}", flush=True)
    return {
        "forge_vs_vllm_serve_throughput": forge["requests_per_s"] / vllm["requests_per_s"],
        "forge_vs_vllm_serve_p99": forge["p99_s"] / vllm["p99_s"],
        "serve": {"forge": forge, "vllm_serve": vllm},
    }


async def engine_tokens(url: str) -> dict[str, float]:
    """The replicas' prompt and computed (prefill) tokens so far, from forge's ``/metrics``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient() as http:
        text = (await http.get(url.removesuffix("/v1") + "/metrics")).text
    totals = {"prompt": 0.0, "computed": 0.0, "cached": 0.0}
    names = {
        "forge_engine_prompt_tokens_total": "prompt",
        "forge_engine_computed_prompt_tokens_total": "computed",
        "forge_engine_cached_prompt_tokens_total": "cached",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                totals[names[sample.name]] += sample.value
    return totals


async def chat_sessions(url: str, sessions: int, turns: int, max_tokens: int) -> dict[str, float]:
    """``sessions`` concurrent chats of ``turns`` turns, each turn sending the whole history; the
    prompt tokens the engines computed for them, and how long they took."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    before = await engine_tokens(url)

    async def chat(i: int) -> None:
        messages = [{"role": "user", "content": f"session {i}: what is {i}+{i}?"}]
        for turn in range(turns):
            reply = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=max_tokens,
                seed=i * 100 + turn,
                extra_headers={"X-Session-ID": f"chat-{i}"},
            )
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": f"and {turn}+{i}?"},
            ]

    started = time.perf_counter()
    await asyncio.gather(*(chat(i) for i in range(sessions)))
    wall = time.perf_counter() - started
    after = await engine_tokens(url)
    await client.close()
    figures = {key: after[key] - before[key] for key in before}
    return {**figures, "wall_s": wall}


def sessions_part(args: argparse.Namespace, folder: Path) -> dict:
    runs = {}
    for router in ("key_affinity", "round_robin"):
        overrides = ["policy.num_replicas=2", "policy.max_model_len=1024", f"server.router={router}", *args.forge_set]
        proc, url, _ = start_forge(folder / f"sessions-{router}", overrides)
        try:
            runs[router] = asyncio.run(chat_sessions(url, args.sessions, args.turns, args.session_max_tokens))
        finally:
            stop(proc)
        print(f"  {router}: {runs[router]}", flush=True)
    return {
        "session_vs_round_robin_prefill": runs["key_affinity"]["computed"] / runs["round_robin"]["computed"],
        "sessions": runs,
    }


def app_run(config: str, steps: int, seed: int, folder: Path) -> dict[str, float]:
    cmd = app_command(config, folder, f"steps={steps}", f"seed={seed}", "logging.plot=false")
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{config} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows]
    figures = {
        "reward_first10": sum(rewards[:10]) / min(10, len(rewards)),
        "reward_last10": sum(rewards[-10:]) / min(10, len(rewards)),
        "steps_per_s": len(rows) / sum(r["step_time_s"] for r in rows),
        "wall_s": time.monotonic() - started,
    }
    print(f"  {config}: {figures}", flush=True)
    return figures


def agent_part(args: argparse.Namespace, folder: Path) -> dict:
    env = app_run("configs/multiturn_tiny.yaml", args.steps, args.seed, folder / "env")
    agent = app_run("configs/agent_tiny.yaml", args.steps, args.seed, folder / "agent")
    return {
        "agent_vs_env_reward_last10": agent["reward_last10"] - env["reward_last10"],
        "agent_vs_env_steps_per_s": agent["steps_per_s"] / env["steps_per_s"],
        "agent": {"env": env, "agent": agent},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the JSON report goes")
    parser.add_argument(
        "--parts", nargs="+", default=["serve", "sessions", "agent"], choices=["serve", "sessions", "agent"]
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--vllm-port", type=int, default=8931)
    parser.add_argument("--forge-set", nargs="*", default=[], help="overrides of forge's server config")
    parser.add_argument("--sessions", type=int, default=32, help="concurrent chats of the sessions part")
    parser.add_argument("--turns", type=int, default=8, help="turns of each chat of the sessions part")
    parser.add_argument("--session-max-tokens", type=int, default=64, help="max_tokens of each chat turn")
    parser.add_argument("--steps", type=int, default=80, help="GRPO steps of each agent-part run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report: dict = {"load_before": os.getloadavg()[0], "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="forge-vs-vllm-serve-") as tmp:
        for part in args.parts:
            print(f"{part}:", flush=True)
            run = {"serve": serve_part, "sessions": sessions_part, "agent": agent_part}[part]
            report.update(run(args, Path(tmp)))
    report["load_after"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k.startswith(("forge_vs", "agent_vs", "session_vs"))}))


if __name__ == "__main__":
    main()
