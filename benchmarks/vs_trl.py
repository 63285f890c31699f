"""forge's GRPO app vs TRL's ``GRPOTrainer``: the same model, task, group, batch, lr and steps.

    scripts/install.sh && scripts/install_bench.sh     # .venv/ (forge, vLLM) and .venv-bench/ (TRL)
    .venv-bench/bin/python benchmarks/vs_trl.py --out vs_trl.json --plot docs/img/vs_trl.png

One config drives both: ``--config`` (default ``configs/grpo_tiny.yaml``) plus ``key=value``
overrides, loaded with forge's own schema (``apps.grpo.config.GRPOConfig``). forge runs it as
``.venv/bin/python -m apps.grpo.main --config ... <overrides>`` (a subprocess, since its vLLM
lives in ``.venv/``); TRL runs in this process (``.venv-bench/``) with every setting the two
share taken from the same config object:

- the tiny random-init model at ``model.path`` (made once by ``forge.models.make_tiny_model``),
  its character tokenizer, and the toy task's prompts in the same order (``forge.data.ToyTask``);
- the reward functions of ``reward.fns`` (``forge.data`` registry), with their weights;
- ``group_size`` completions per prompt, ``prompts_per_step`` prompts per step, ``steps``
  optimizer steps, ``policy.max_tokens``, ``policy.temperature`` (top-p 1, no top-k);
- AdamW at a constant ``trainer.lr`` (betas 0.9/0.999, ``trainer.weight_decay``), gradient
  clipping at ``trainer.max_grad_norm``, the PPO clip ``trainer.clip_eps``, the k3 KL to the
  initial model with ``trainer.beta``, std-normalised group advantages, and the per-sequence
  token mean (TRL's ``loss_type="grpo"``), one optimizer step per batch (``num_iterations=1``).

What differs is each system's design: TRL generates with ``transformers.generate`` in the
training process (``use_vllm=False``: the CPU run has no vLLM server), step by step; forge
generates with vLLM in a policy service while the trainer trains (``max_policy_age`` versions
off-policy, corrected by the importance ratio). TRL's process gets ``--trl-threads`` torch
threads (default 1, as every forge process has: on 2 shared cores 2 threads made TRL up to 8x
slower whenever another job ran).

Seconds per step are the training loop's wall time divided by its steps: forge's from its
roles' start to its last step (its summary line; ``metrics.jsonl``'s ``step_time_s`` leaves
out the per-step logging between steps, so its sum is reported apart), TRL's from the first
step's start to the last step's end. Start-up (process spawn, model and vLLM load) is reported
apart. ``forge_vs_trl_steps_per_s`` = forge steps/s / TRL steps/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FORGE_PYTHON = REPO / ".venv" / "bin" / "python"
TRL_THREADS = 1  # torch threads of the TRL process (see the module docstring)
SUMMARY_WINDOW = 10  # steps averaged for the "first" and "last" reward figures


# --------------------------------------------------------------------------- config
def load_grpo_config(config: str, overrides: list[str]) -> Any:
    sys.path.insert(0, str(REPO))
    import forge.controller  # noqa: F401  (before anything imports monarch)
    from apps.grpo.config import GRPOConfig
    from forge.config import load_config

    return load_config(GRPOConfig, config, overrides)


def prepare_model(cfg: Any) -> str:
    """The model folder both systems start from (made once if the config asks for a tiny one)."""
    path = Path(cfg.model.path)
    if not path.is_absolute():
        path = REPO / path
    tiny = cfg.model.tiny
    if tiny is not None and getattr(tiny, "make_if_missing", True):
        from forge.models import make_tiny_model

        t = cfg.model.tiny
        make_tiny_model(
            path, arch=t.arch, hidden_size=t.hidden_size, num_layers=t.num_layers, seed=t.seed, init_std=t.init_std
        )
    return str(path)


# --------------------------------------------------------------------------- forge
# Outputs the benchmark does not need, turned off where the app's config has the switch.
QUIET = {"progress_bar": "false", "plot": "false", "tensorboard": "false", "sinks": "[jsonl]"}


def run_forge(cfg: Any, config: str, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """``python -m apps.grpo.main`` in ``.venv/``; per-step figures from its metrics.jsonl."""
    out_dir.mkdir(parents=True, exist_ok=True)
    quiet = [f"logging.{k}={v}" for k, v in QUIET.items() if hasattr(cfg.logging, k)]
    cmd = [
        str(FORGE_PYTHON),
        "-m",
        "apps.grpo.main",
        "--config",
        config,
        *overrides,
        f"logging.output_dir={out_dir}",
        *quiet,
    ]
    print("forge:", " ".join(cmd[1:]), flush=True)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"forge's GRPO app exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times = [r["step_time_s"] for r in rows]
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(summary, flush=True)
    # The loop's wall time: from the roles' start to the last step, so that per-step work outside
    # step_time_s (e.g. logging) counts, as it does for TRL. From the app's summary line.
    match = re.search(r"(\d+) steps in ([\d.]+)s \(startup ([\d.]+)s\)", summary)
    if match is None:
        raise RuntimeError(f"cannot read the loop's wall time from the app's summary line: {summary!r}")
    train_s = float(match.group(2)) - float(match.group(3))
    return {
        **run_figures(train_s, wall, step_times, [r["reward_mean"] for r in rows], load),
        "command": " ".join(["python", *cmd[1:]]),
    }


def run_figures(
    train_s: float, wall_s: float, step_times: list[float], rewards: list[float], load: float
) -> dict[str, Any]:
    """The figures both systems report, computed one way: ``train_s`` is the training loop's
    wall time, ``wall_s`` the whole run's (start-up is the difference)."""
    return {
        "steps": len(step_times),
        "train_s": train_s,
        "sum_step_time_s": sum(step_times),
        "startup_s": wall_s - train_s,
        "wall_s": wall_s,
        "s_per_step": train_s / len(step_times),
        "steps_per_s": len(step_times) / train_s,
        "step_time_s": step_times,
        "reward_mean": rewards,
        "load_avg_1m_before": load,
    }


# --------------------------------------------------------------------------- TRL
def trl_dataset(cfg: Any) -> Any:
    """The first ``steps * prompts_per_step`` prompts of the config's task, in order."""
    from datasets import Dataset

    from forge.actors.dataset import DatasetConfig, prompt_stream

    stream = prompt_stream(
        DatasetConfig(
            source=cfg.data.source,
            path=cfg.data.path,
            prompt_template=cfg.data.prompt_template,
            seed=cfg.seed,
            options=dict(cfg.data.options),
        )
    )
    rows = []
    for _ in range(cfg.steps * cfg.prompts_per_step):
        p = next(stream)
        rows.append({"prompt": p.text, "prompt_id": p.prompt_id, "answer": p.answer, "meta": json.dumps(p.meta)})
    return Dataset.from_list(rows)


def trl_reward_fns(cfg: Any) -> tuple[list[Any], list[float]]:
    """forge's reward functions as TRL reward functions (same functions, same weights)."""
    from forge.actors.reward import resolve_reward
    from forge.types import Prompt

    fns, weights = [], []
    for name, weight in cfg.reward.fns.items():
        fn = resolve_reward(name)

        def reward(prompts, completions, prompt_id, answer, meta, _fn=fn, **_):
            return [
                _fn(Prompt(prompt_id=i, text=p, answer=a, meta=json.loads(m)), c)
                for p, c, i, a, m in zip(prompts, completions, prompt_id, answer, meta)
            ]

        reward.__name__ = name.replace(":", "_").replace(".", "_")
        fns.append(reward)
        weights.append(float(weight))
    return fns, weights


def run_trl(cfg: Any, model_path: str, out_dir: Path, threads: int) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    t, p = cfg.trainer, cfg.policy
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    fns, weights = trl_reward_fns(cfg)
    args = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=cfg.seed,
        max_steps=cfg.steps,
        per_device_train_batch_size=cfg.group_size * cfg.prompts_per_step,
        gradient_accumulation_steps=1,
        num_generations=cfg.group_size,
        num_iterations=1,
        max_completion_length=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=0,
        use_vllm=False,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        beta=t.beta,
        epsilon=t.clip_eps,
        epsilon_high=t.clip_eps_high if t.clip_eps_high is not None else t.clip_eps,
        loss_type="grpo",
        scale_rewards="group",
        reward_weights=weights,
        shuffle_dataset=False,
        model_init_kwargs={"dtype": getattr(torch, t.dtype)},
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.rewards: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.starts.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))

    timer = Timer()
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=fns,
        args=args,
        train_dataset=trl_dataset(cfg),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        callbacks=[timer],
    )
    print(f"trl: GRPOTrainer, {cfg.steps} steps of {cfg.prompts_per_step} prompts x {cfg.group_size}", flush=True)
    trainer.train()
    wall = time.perf_counter() - t0
    train_s = timer.ends[-1] - timer.starts[0]
    step_times = [e - s for s, e in zip(timer.starts, timer.ends)]
    return {
        **run_figures(train_s, wall, step_times, timer.rewards, load),
        "torch_threads": threads,
        "trl_args": {k: v for k, v in args.to_dict().items() if k in TRL_ARGS_SHOWN},
    }


TRL_ARGS_SHOWN = (
    "per_device_train_batch_size",
    "num_generations",
    "max_completion_length",
    "temperature",
    "learning_rate",
    "lr_scheduler_type",
    "beta",
    "epsilon",
    "loss_type",
    "scale_rewards",
    "max_grad_norm",
    "weight_decay",
    "num_iterations",
    "max_steps",
    "use_vllm",
    "seed",
)


# --------------------------------------------------------------------------- report
def summarize(rewards: list[float]) -> dict[str, float]:
    k = min(SUMMARY_WINDOW, len(rewards))
    return {
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "reward_mean_all_steps": sum(rewards) / len(rewards),
    }


def plot(results: dict[str, Any], path: str) -> None:
    """Mean reward per step against the step (left) and against training time (right).

    forge's per-step times (``step_time_s``) leave out the work between steps (logging), so on
    the time axis they are scaled to add up to the loop's wall time; TRL's are wall times.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for system, style in (("forge", "-"), ("trl", "--")):
        r = results[system]
        steps = list(range(1, len(r["reward_mean"]) + 1))
        ax1.plot(steps, r["reward_mean"], style, label=f"{system} (last {SUMMARY_WINDOW}: {r['reward_last']:.2f})")
        scale = r["train_s"] / r["sum_step_time_s"]
        elapsed, total = [], 0.0
        for s in r["step_time_s"]:
            total += s * scale
            elapsed.append(total)
        ax2.plot(elapsed, r["reward_mean"], style, label=f"{system} ({r['s_per_step']:.2f} s/step)")
    ax1.set_xlabel("step")
    ax2.set_xlabel("training time (s)")
    for ax in (ax1, ax2):
        ax.set_ylabel("mean reward of the step's batch")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    s = results["settings"]
    fig.suptitle(
        f"forge vs TRL GRPO: {s['steps']} steps, {s['prompts_per_step']} prompts x {s['group_size']}, "
        f"lr {s['lr']:g}, {results['machine']['cpus']} CPU cores"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def print_table(results: dict[str, Any]) -> None:
    print(
        f"\n{'system':6s} {'steps':>5s} {'s/step':>7s} {'steps/s':>8s} {'startup s':>9s} "
        f"{'reward first':>12s} {'reward last':>11s}"
    )
    for system in ("forge", "trl"):
        r = results[system]
        print(
            f"{system:6s} {r['steps']:5d} {r['s_per_step']:7.3f} {r['steps_per_s']:8.3f} {r['startup_s']:9.1f} "
            f"{r['reward_first']:12.3f} {r['reward_last']:11.3f}"
        )
    print(f"\nforge_vs_trl_steps_per_s   {results['forge_vs_trl_steps_per_s']:.2f}  (goal >= 2)")
    print(f"forge_vs_trl_reward_last   {results['forge_vs_trl_reward_last']:.2f}  (goal >= 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/grpo_tiny.yaml", help="forge GRPO config used by both")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for both, e.g. steps=50")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--plot", help="write a PNG plot of the results to this file")
    parser.add_argument("--from-json", help="skip the run: print and plot the results in this JSON file")
    parser.add_argument("--work-dir", default="outputs/vs_trl", help="where both runs write their outputs")
    parser.add_argument("--trl-threads", type=int, default=TRL_THREADS, help="torch threads of the TRL process")
    parser.add_argument("--only", choices=["forge", "trl"], help="run one system (for profiling; no ratios)")
    args = parser.parse_args()

    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        import psutil
        import torch
        import transformers
        import trl

        cfg = load_grpo_config(args.config, args.overrides)
        model_path = prepare_model(cfg)
        work = Path(args.work_dir).resolve()
        results: dict[str, Any] = {
            "settings": {
                "config": args.config,
                "overrides": args.overrides,
                "steps": cfg.steps,
                "group_size": cfg.group_size,
                "prompts_per_step": cfg.prompts_per_step,
                "lr": cfg.trainer.lr,
                "beta": cfg.trainer.beta,
                "clip_eps": cfg.trainer.clip_eps,
                "max_tokens": cfg.policy.max_tokens,
                "temperature": cfg.policy.temperature,
                "max_policy_age": cfg.max_policy_age,
                "reward_fns": dict(cfg.reward.fns),
                "model_path": model_path,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "trl": trl.__version__,
            },
        }
        for system in ("forge", "trl"):
            if args.only and system != args.only:
                continue
            if system == "forge":
                r = run_forge(cfg, args.config, args.overrides, work / "forge")
            else:
                r = run_trl(cfg, model_path, work / "trl", args.trl_threads)
            r.update(summarize(r["reward_mean"]))
            results[system] = r
            print(
                f"{system}: {r['steps']} steps, {r['s_per_step']:.3f} s/step, startup {r['startup_s']:.1f} s, "
                f"reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}",
                flush=True,
            )
        if args.only:
            print(json.dumps(results, indent=1)[:4000])
            return
        results["forge_vs_trl_steps_per_s"] = results["forge"]["steps_per_s"] / results["trl"]["steps_per_s"]
        results["forge_vs_trl_wall"] = results["trl"]["wall_s"] / results["forge"]["wall_s"]
        results["forge_vs_trl_reward_last"] = results["forge"]["reward_last"] / results["trl"]["reward_last"]
        results["machine"]["load_avg_1m_after"] = os.getloadavg()[0]
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
