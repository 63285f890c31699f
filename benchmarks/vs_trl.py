"""forge's GRPO app vs TRL's ``GRPOTrainer``: the same model, task, group, batch, lr and steps.

    scripts/install.sh && scripts/install_bench.sh     # .venv/ (forge, vLLM) and .venv-bench/ (TRL, vLLM)
    .venv-bench/bin/python benchmarks/vs_trl.py --levers --out vs_trl.json --plot docs/img/vs_trl.png

Two workloads, each one forge config (loaded with forge's own schema, ``apps.grpo.config``):

- ``tiny`` (``configs/grpo_tiny.yaml``): a 0.1 M-parameter model, 3 new tokens, 64 prompts x 8.
  Per-call overhead dominates; it is the smallest run that learns.
- ``medium`` (``configs/grpo_medium.yaml``): a 10.5 M-parameter model (512 wide, 4 layers), up
  to 32 new tokens with ``<eos>`` allowed (lengths vary), 16 prompts x 8. Generation and training
  dominate, as in real RL.

``key=value`` overrides apply to both workloads; ``tiny:key=value`` or ``medium:key=value`` to
one (e.g. ``medium:steps=40``). Each workload runs three systems, one after the other:

- ``forge``: ``.venv/bin/python -m apps.grpo.main --config ...`` as it ships (a vLLM policy
  service, reference and reward services, a trainer actor, rollouts concurrent with training
  ``max_policy_age`` versions off-policy, weight sync through ``/dev/shm``);
- ``trl_hf``: ``GRPOTrainer`` with ``use_vllm=False`` (``transformers.generate``);
- ``trl_vllm``: ``GRPOTrainer`` with ``use_vllm=True, vllm_mode="colocate"`` (vLLM in the
  training process, weights loaded into it after every step). A row that cannot run keeps its
  place in the table with the exact error.

Every setting the two share comes from the same config object:

- the random-init model at ``model.path`` (made once by ``forge.models.make_tiny_model``), its
  character tokenizer, and the toy task's prompts in the same order (``forge.data.ToyTask``);
- the reward functions of ``reward.fns`` (``forge.data`` registry), with their weights;
- ``group_size`` completions per prompt, ``prompts_per_step`` prompts per step, ``steps``
  optimizer steps, ``policy.max_tokens``, ``policy.temperature`` (top-p 1, no top-k);
- AdamW at a constant ``trainer.lr`` (betas 0.9/0.999, ``trainer.weight_decay``), gradient
  clipping at ``trainer.max_grad_norm``, the PPO clip ``trainer.clip_eps``, the k3 KL to the
  initial model with ``trainer.beta``, std-normalised group advantages, ``trainer.loss_type``
  (TRL's ``loss_type`` of the same name), one optimizer step per batch (``num_iterations=1``).

Each TRL row runs in a child process of its own (``--trl-child``) with ``--trl-threads`` torch
threads (default 1, as every forge process has: on 2 shared cores 2 threads made TRL up to 8x
slower whenever another job ran).

Seconds per step are the training loop's wall time divided by its steps: forge's from its
roles' start to its last step (its summary line), TRL's from the first step's start to the last
step's end. Start-up is reported apart. CPU-seconds per step: TRL's process measures its own
(``time.process_time`` over the steps, vLLM included in colocate mode); forge's are sampled from
outside by ``role_cpu.RoleCpuSampler``, per role (policy, reference, reward, trainer,
controller, Monarch's helpers), between the first and the last logged step.

``--levers`` adds forge-only rows on the medium workload, one lever changed each (``LEVERS``):
sequence packing off, DAPO dynamic sampling on, ``loss_type`` dapo and dr_grpo.

The JSON (``--out``) has, per workload, every row's figures and the ratios, and at the top
``tiny_forge_vs_trl_hf_steps_per_s``, ``medium_forge_vs_best_trl_steps_per_s`` and
``medium_reward_last10_forge_minus_best_trl`` (the best TRL row is the one with the most
steps/s among those that ran).
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

from role_cpu import RoleCpuSampler

REPO = Path(__file__).resolve().parents[1]
FORGE_PYTHON = REPO / ".venv" / "bin" / "python"
WORKLOADS = {"tiny": "configs/grpo_tiny.yaml", "medium": "configs/grpo_medium.yaml"}
TRL_ROWS = {"trl_hf": False, "trl_vllm": True}  # row -> use_vllm
SYSTEMS = ("forge", *TRL_ROWS)
# Forge-only rows on the medium workload: each changes one lever of the medium config.
LEVERS = {
    "forge_no_packing": ["trainer.pack_sequences=false", "reference.pack_sequences=false"],
    "forge_dynamic_sampling": ["rollout.dynamic_sampling=true"],
    "forge_loss_dapo": ["trainer.loss_type=dapo"],
    "forge_loss_dr_grpo": ["trainer.loss_type=dr_grpo"],
}
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
    metrics = out_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    t0 = time.perf_counter()
    log = out_dir / "app.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log_file, text=True)
        sampler = RoleCpuSampler(proc.pid, lambda: logged_steps(metrics))
        sampler.start()
        stdout, _ = proc.communicate()
        sampler.stop()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"forge's GRPO app exited {proc.returncode}:\n{stdout[-3000:]}\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times = [r["step_time_s"] for r in rows]
    summary = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    print(summary, flush=True)
    # The loop's wall time: from the roles' start to the last step, so that per-step work outside
    # step_time_s (e.g. logging) counts, as it does for TRL. From the app's summary line.
    match = re.search(r"(\d+) steps in ([\d.]+)s \(startup ([\d.]+)s\)", summary)
    if match is None:
        raise RuntimeError(f"cannot read the loop's wall time from the app's summary line: {summary!r}")
    train_s = float(match.group(2)) - float(match.group(3))
    return {
        **run_figures(train_s, wall, step_times, [r["reward_mean"] for r in rows], load),
        "cpu_s_per_step": sampler.per_step(),
        "response_len_mean": mean_of(rows, "response_len_mean"),
        "padding_fraction": mean_of(rows, "padding_fraction"),
        "zero_std_fraction": mean_of(rows, "zero_std_fraction"),
        "command": " ".join(["python", *cmd[1:]]),
    }


def logged_steps(metrics: Path) -> int:
    """How many steps the run has written to its metrics.jsonl so far."""
    try:
        with open(metrics, "rb") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def mean_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """The mean of a metric over the steps that logged it (None if none did)."""
    values = [v for r in rows if isinstance(v := r.get(key), (int, float)) and v == v]
    return sum(values) / len(values) if values else None


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

    from apps.common.inputs import records_source
    from forge.actors.dataset import DatasetConfig, prompt_stream

    stream = prompt_stream(
        DatasetConfig(
            source=cfg.data.source,
            records=records_source(cfg.data),
            prompt_template=cfg.data.prompt_template,
            chat_model=str(REPO / cfg.model.path) if cfg.data.chat_template else None,
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


def trl_args(cfg: Any, out_dir: Path, use_vllm: bool, weights: list[float]) -> Any:
    """TRL's ``GRPOConfig`` with every setting forge's config shares (the module docstring)."""
    import torch
    from trl import GRPOConfig

    t, p = cfg.trainer, cfg.policy
    return GRPOConfig(
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
        use_vllm=use_vllm,
        **({**TRL_VLLM_COLOCATE, "vllm_max_model_length": p.max_model_len} if use_vllm else {}),
        learning_rate=t.lr,
        lr_scheduler_type="constant_with_warmup" if t.warmup_steps else "constant",
        warmup_steps=t.warmup_steps,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        beta=t.beta,
        epsilon=t.clip_eps,
        epsilon_high=t.clip_eps_high if t.clip_eps_high is not None else t.clip_eps,
        loss_type=t.loss_type,
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


def run_trl(cfg: Any, model_path: str, out_dir: Path, threads: int, use_vllm: bool = False) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    fns, weights = trl_reward_fns(cfg)
    args = trl_args(cfg, out_dir, use_vllm, weights)

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.rewards: list[float] = []
            self.lengths: list[float] = []
            self.zero_std: list[float] = []

            self.cpu: list[float] = []  # this process's CPU time (every thread) at the first start, last end

        def on_step_begin(self, args, state, control, **kwargs):
            self.starts.append(time.perf_counter())
            if not self.cpu:
                self.cpu.append(time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            self.cpu[1:] = [time.process_time()]

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
                self.lengths.append(float(logs.get("completions/mean_length", "nan")))
                if "frac_reward_zero_std" in logs:
                    self.zero_std.append(float(logs["frac_reward_zero_std"]))

    timer = Timer()
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=fns,
        args=args,
        train_dataset=trl_dataset(cfg),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        callbacks=[timer],
    )
    row = "trl_vllm" if use_vllm else "trl_hf"
    print(f"{row}: GRPOTrainer, {cfg.steps} steps of {cfg.prompts_per_step} prompts x {cfg.group_size}", flush=True)
    trainer.train()
    wall = time.perf_counter() - t0
    train_s = timer.ends[-1] - timer.starts[0]
    step_times = [e - s for s, e in zip(timer.starts, timer.ends)]
    lengths = [float(x) for x in timer.lengths]
    return {
        **run_figures(train_s, wall, step_times, timer.rewards, load),
        "cpu_s_per_step": {"trl": (timer.cpu[-1] - timer.cpu[0]) / len(step_times)},
        "response_len_mean": sum(lengths) / len(lengths) if lengths else None,
        "zero_std_fraction": sum(timer.zero_std) / len(timer.zero_std) if timer.zero_std else None,
        "torch_threads": threads,
        "trl_args": {k: v for k, v in args.to_dict().items() if k in TRL_ARGS_SHOWN},
    }


# TRL's vLLM in its own process ("colocate"): what a TRL user picks for speed on one machine.
TRL_VLLM_COLOCATE = {"vllm_mode": "colocate", "vllm_enable_sleep_mode": False}

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
    "vllm_mode",
    "seed",
)


# --------------------------------------------------------------------------- one TRL row, in a child
def trl_child_env(cfg: Any, threads: int) -> dict[str, str]:
    """The TRL child's environment: its threads, and (for vLLM on CPU, which sizes its KV cache in
    GiB) at least the KV cache forge's policy gets."""
    gib = max(1, -(-int(cfg.policy.kv_cache_bytes) // 2**30))
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(gib), "HF_HUB_OFFLINE": "1"}


def run_trl_row(row: str, cfg: Any, config: str, overrides: list[str], work: Path, threads: int) -> dict[str, Any]:
    """One TRL row in a child process of this interpreter; its JSON result, or its exact error."""
    result = work / row / "result.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--trl-child", row, "--config", config, *overrides]
    cmd += ["--result", str(result), "--work-dir", str(work), "--trl-threads", str(threads)]
    log = work / row / "trl.log"
    with open(log, "w") as log_file:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=trl_child_env(cfg, threads))
    if proc.returncode != 0 or not result.exists():
        text = log.read_text()
        errors = [line for line in text.splitlines() if re.match(r"^\w+(\.\w+)*(Error|Exception)\b", line)]
        return {"error": errors[-1] if errors else f"exited {proc.returncode}", "log_tail": text[-2000:]}
    return json.loads(result.read_text())


def trl_child(args: argparse.Namespace) -> None:
    cfg = load_grpo_config(args.config, args.overrides)
    use_vllm = TRL_ROWS[args.trl_child]
    r = run_trl(cfg, prepare_model(cfg), Path(args.work_dir) / args.trl_child, args.trl_threads, use_vllm=use_vllm)
    Path(args.result).write_text(json.dumps(r))


# --------------------------------------------------------------------------- workloads
def split_overrides(overrides: list[str]) -> dict[str, list[str]]:
    """``key=value`` for every workload, ``tiny:key=value`` for one."""
    out: dict[str, list[str]] = {w: [] for w in WORKLOADS}
    for item in overrides:
        prefix, sep, rest = item.partition(":")
        if sep and prefix in WORKLOADS:
            out[prefix].append(rest)
        elif sep and "=" not in prefix:
            raise SystemExit(f"unknown workload {prefix!r} in override {item!r}; workloads: {', '.join(WORKLOADS)}")
        else:
            for w in out:
                out[w].append(item)
    return out


def settings_of(cfg: Any, config: str, overrides: list[str], model_path: str) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_cfg = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_cfg).parameters())
    return {
        "config": config,
        "overrides": overrides,
        "model_params": params,
        "hidden_size": model_cfg.hidden_size,
        "num_layers": model_cfg.num_hidden_layers,
        "steps": cfg.steps,
        "group_size": cfg.group_size,
        "prompts_per_step": cfg.prompts_per_step,
        "lr": cfg.trainer.lr,
        "beta": cfg.trainer.beta,
        "clip_eps": cfg.trainer.clip_eps,
        "loss_type": cfg.trainer.loss_type,
        "pack_sequences": cfg.trainer.pack_sequences,
        "max_tokens": cfg.policy.max_tokens,
        "temperature": cfg.policy.temperature,
        "max_policy_age": cfg.max_policy_age,
        "reward_fns": dict(cfg.reward.fns),
        "model_path": model_path,
    }


def run_workload(
    name: str, overrides: list[str], systems: list[str], levers: bool, work: Path, threads: int
) -> dict[str, Any]:
    config = WORKLOADS[name]
    cfg = load_grpo_config(config, overrides)
    model_path = prepare_model(cfg)
    out: dict[str, Any] = {"settings": settings_of(cfg, config, overrides, model_path), "rows": {}}
    rows = [s for s in SYSTEMS if s in systems]
    if levers and name == "medium":
        rows += list(LEVERS)
    for row in rows:
        print(f"[{name}] {row}", flush=True)
        if row in TRL_ROWS:
            r = run_trl_row(row, cfg, config, overrides, work / name, threads)
        else:
            r = run_forge(cfg, config, overrides + LEVERS.get(row, []), work / name / row)
            r["lever"] = LEVERS.get(row, [])
        if "error" not in r:
            r.update(summarize(r["reward_mean"]))
            print(
                f"[{name}] {row}: {r['steps']} steps, {r['s_per_step']:.3f} s/step, startup {r['startup_s']:.1f} s, "
                f"reward {r['reward_first']:.3f} -> {r['reward_last']:.3f}, cpu/step {r['cpu_s_per_step']}",
                flush=True,
            )
        else:
            print(f"[{name}] {row}: FAILED: {r['error']}", flush=True)
        out["rows"][row] = r
    out.update(workload_ratios(out["rows"]))
    return out


def workload_ratios(rows: dict[str, Any]) -> dict[str, Any]:
    """forge against each TRL row and the best one; each lever against forge as configured."""
    ran = {k: r for k, r in rows.items() if "error" not in r}
    out: dict[str, Any] = {}
    forge = ran.get("forge")
    trl = {k: ran[k] for k in TRL_ROWS if k in ran}
    if forge is None:
        return out
    for k, r in trl.items():
        out[f"forge_vs_{k}_steps_per_s"] = forge["steps_per_s"] / r["steps_per_s"]
        out[f"reward_last10_forge_minus_{k}"] = forge["reward_last"] - r["reward_last"]
    if trl:
        best = max(trl, key=lambda k: trl[k]["steps_per_s"])
        out["best_trl"] = best
        out["forge_vs_best_trl_steps_per_s"] = forge["steps_per_s"] / trl[best]["steps_per_s"]
        out["reward_last10_forge_minus_best_trl"] = forge["reward_last"] - trl[best]["reward_last"]
    for k in LEVERS:
        if k in ran:
            out[f"{k}_vs_forge_steps_per_s"] = ran[k]["steps_per_s"] / forge["steps_per_s"]
            out[f"{k}_reward_last10_minus_forge"] = ran[k]["reward_last"] - forge["reward_last"]
    return out


HEADLINES = {  # top-level JSON key -> (workload, key in that workload)
    "tiny_forge_vs_trl_hf_steps_per_s": ("tiny", "forge_vs_trl_hf_steps_per_s"),
    "medium_forge_vs_best_trl_steps_per_s": ("medium", "forge_vs_best_trl_steps_per_s"),
    "medium_reward_last10_forge_minus_best_trl": ("medium", "reward_last10_forge_minus_best_trl"),
}
GOALS = {
    "tiny_forge_vs_trl_hf_steps_per_s": ">= 1.0",
    "medium_forge_vs_best_trl_steps_per_s": ">= 1.5",
    "medium_reward_last10_forge_minus_best_trl": ">= -0.05",
}


# --------------------------------------------------------------------------- report
def summarize(rewards: list[float]) -> dict[str, float]:
    k = min(SUMMARY_WINDOW, len(rewards))
    return {
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "reward_mean_all_steps": sum(rewards) / len(rewards),
    }


def print_table(results: dict[str, Any]) -> None:
    for name, w in results["workloads"].items():
        s = w["settings"]
        print(
            f"\n{name}: {s['model_params'] / 1e6:.1f} M params, {s['steps']} steps of {s['prompts_per_step']} prompts "
            f"x {s['group_size']}, up to {s['max_tokens']} new tokens"
        )
        print(
            f"{'row':24s} {'s/step':>7s} {'steps/s':>8s} {'startup':>7s} {'reward first':>12s} {'last':>6s} "
            f"{'len':>5s}  CPU-s per step"
        )
        for row, r in w["rows"].items():
            if "error" in r:
                print(f"{row:24s} FAILED: {r['error']}")
                continue
            cpu = " ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu_s_per_step"].items(), key=lambda kv: -kv[1]))
            length = r.get("response_len_mean") or float("nan")
            print(
                f"{row:24s} {r['s_per_step']:7.3f} {r['steps_per_s']:8.3f} {r['startup_s']:7.1f} "
                f"{r['reward_first']:12.3f} {r['reward_last']:6.3f} {length:5.1f}  "
                f"{cpu}"
            )
        for k, v in w.items():
            if k not in ("settings", "rows"):
                print(f"  {k} {v if isinstance(v, str) else f'{v:.3f}'}")
    print()
    for key, goal in GOALS.items():
        value = results.get(key)
        print(f"{key:44s} {'not measured' if value is None else f'{value:.3f}'}  (goal {goal})")


def plot(results: dict[str, Any], path: str) -> None:
    """Per workload: mean reward per step against the step (left) and against training time (right).

    forge's per-step times (``step_time_s``) leave out the work between steps (logging), so on
    the time axis they are scaled to add up to the loop's wall time; TRL's are wall times.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = results["workloads"]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 4 * len(workloads)), squeeze=False)
    for (name, w), (ax1, ax2) in zip(workloads.items(), axes):
        for row, r in w["rows"].items():
            if "error" in r:
                continue
            style = "-" if row == "forge" else "--" if row in TRL_ROWS else ":"
            steps = list(range(1, len(r["reward_mean"]) + 1))
            ax1.plot(steps, r["reward_mean"], style, label=f"{row} (last {SUMMARY_WINDOW}: {r['reward_last']:.2f})")
            scale = r["train_s"] / r["sum_step_time_s"]
            elapsed, total = [], 0.0
            for t in r["step_time_s"]:
                total += t * scale
                elapsed.append(total)
            ax2.plot(elapsed, r["reward_mean"], style, label=f"{row} ({r['s_per_step']:.2f} s/step)")
        s = w["settings"]
        for ax, xlabel in ((ax1, "step"), (ax2, "training time (s)")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel("mean reward of the step's batch")
            ax.set_title(
                f"{name}: {s['model_params'] / 1e6:.1f} M params, {s['prompts_per_step']} prompts x {s['group_size']}, "
                f"<= {s['max_tokens']} tokens",
                fontsize=10,
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"forge vs TRL GRPO on {results['machine']['cpus']} CPU cores")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value for both workloads, tiny:key=value for one")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--levers", action="store_true", help="add the forge-only lever rows on the medium workload")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--plot", help="write a PNG plot of the results to this file")
    parser.add_argument("--from-json", help="skip the run: print and plot the results in this JSON file")
    parser.add_argument("--work-dir", default="outputs/vs_trl", help="where the runs write their outputs")
    parser.add_argument("--trl-threads", type=int, default=TRL_THREADS, help="torch threads of the TRL process")
    parser.add_argument("--trl-child", choices=list(TRL_ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)  # the TRL child's workload config
    parser.add_argument("--result", help=argparse.SUPPRESS)  # where the TRL child writes its JSON
    args = parser.parse_args()
    if args.trl_child:
        trl_child(args)
        return

    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        import psutil
        import torch
        import transformers
        import trl

        per_workload = split_overrides(args.overrides)
        work = Path(args.work_dir).resolve()
        results: dict[str, Any] = {
            "machine": {
                "cpus": os.cpu_count(),
                "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "trl": trl.__version__,
                "load_avg_1m_before": os.getloadavg()[0],
            },
            "workloads": {},
        }
        for name in args.workloads:
            results["workloads"][name] = run_workload(
                name, per_workload[name], args.systems, args.levers, work, args.trl_threads
            )
        results["machine"]["load_avg_1m_after"] = os.getloadavg()[0]
        for key, (name, inner) in HEADLINES.items():
            value = results["workloads"].get(name, {}).get(inner)
            if value is not None:
                results[key] = value
    print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
