"""Time to accuracy: forge's GRPO app against TRL's ``GRPOTrainer`` from the same SFT checkpoint.

    scripts/install.sh && scripts/install_bench.sh      # .venv/ (forge, vLLM) and .venv-bench/ (TRL, vLLM)
    .venv-bench/bin/python benchmarks/time_to_accuracy.py --out time_to_accuracy.json \\
        --plot docs/img/time_to_accuracy.png

The workload is the SFT-then-GRPO run of ``scripts/sft_then_grpo.sh``: 3-digit addition, every
number written least significant digit first, an exact-match reward, a random-init 2.6 M-param
model. First the SFT app makes the starting checkpoint (``configs/sft_addition.yaml``, or
``--sft-model`` an existing one). Then three systems train from it, one after the other, each
from a process of its own and with the same 2 cores:

- ``forge``: ``.venv/bin/python -m apps.grpo.main --config configs/grpo_addition.yaml`` as it
  ships, with its in-run evaluation off and a Hugging Face export every ``--export-every`` steps
  (``trainer.export_every``);
- ``trl_hf``: ``GRPOTrainer`` with ``use_vllm=False`` (``transformers.generate``);
- ``trl_vllm``: ``GRPOTrainer`` with ``use_vllm=True, vllm_mode="colocate"``.

Every setting they share comes from the one GRPO config (``benchmarks/vs_trl.py``'s
``trl_args``: the prompts in the same order, group, batch, lr and warmup, clip, KL, loss type,
the reward function, ``steps``). Each TRL row saves its model every ``--export-every`` steps
from a callback. Every checkpoint is stamped with the seconds from its system's process launch
to its save.

One evaluator then scores every checkpoint of every row, and the SFT checkpoint itself, on the
same held-out prompts (the first ``--eval-prompts`` of the test split): greedy decoding with
``transformers`` in this process, scored by ``forge.evaluation.eval_metrics`` (exact match).
The target is the SFT checkpoint's accuracy + 0.10. The JSON (``--out``) holds every row's
curve and figures, and at the top:

- ``forge_vs_best_trl_time_to_target``: seconds to the target, forge / the fastest TRL row
  (``inf`` when no TRL row reached it);
- ``eval_accuracy_at_equal_time_forge_minus_best_trl``: forge's accuracy at the best TRL row's
  last checkpoint's time (its newest checkpoint by then) minus that row's final accuracy;
- ``final_eval_accuracy_forge_minus_best_trl``: the final checkpoints' accuracies, forge minus
  the best TRL row (the best: the fastest to the target, else the most accurate at the end).

A row that cannot run keeps its place in the JSON with the exact error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

FORGE_PYTHON = REPO / ".venv" / "bin" / "python"
SFT_CONFIG = "configs/sft_addition.yaml"
GRPO_CONFIG = "configs/grpo_addition.yaml"
TRL_ROWS = {"trl_hf": False, "trl_vllm": True}
SYSTEMS = ("forge", *TRL_ROWS)
TARGET_GAIN = 0.10


# --------------------------------------------------------------------------- the SFT start
def make_sft_model(work: Path, overrides: list[str]) -> tuple[Path, float]:
    """The SFT app's final model (made once here) and the seconds it took."""
    out = work / "sft"
    cmd = [str(FORGE_PYTHON), "-m", "apps.sft.main", "--config", SFT_CONFIG, f"logging.output_dir={out}"]
    cmd += ["logging.progress_bar=false", *overrides]
    print("sft:", " ".join(cmd[1:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"the SFT app exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    print(proc.stdout.strip().splitlines()[-1], flush=True)
    return out / "final_model", time.perf_counter() - t0


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


# --------------------------------------------------------------------------- forge
def run_forge(model: Path, work: Path, steps: int, every: int, overrides: list[str]) -> dict[str, Any]:
    """The GRPO app as it ships, exporting every ``every`` steps; its checkpoints, stamped."""
    out = work / "forge"
    cmd = [str(FORGE_PYTHON), "-m", "apps.grpo.main", "--config", GRPO_CONFIG, f"model.path={model}"]
    cmd += [f"steps={steps}", "eval.every=0", f"trainer.export_every={every}", f"logging.output_dir={out}"]
    cmd += ["logging.progress_bar=false", "logging.plot=false", "logging.sinks=[jsonl]", *overrides]
    print("forge:", " ".join(cmd[1:]), flush=True)
    launched = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env())
    wall = time.time() - launched
    if proc.returncode != 0:
        return {"error": f"exited {proc.returncode}", "log_tail": proc.stderr[-3000:]}
    print(proc.stdout.strip().splitlines()[-1], flush=True)
    index = [json.loads(line) for line in (out / "exports" / "index.jsonl").read_text().splitlines()]
    return {
        "checkpoints": [{"step": e["step"], "t": e["unix_time"] - launched, "path": e["path"]} for e in index],
        "wall_s": wall,
        "command": " ".join(["python", *cmd[1:]]),
    }


# --------------------------------------------------------------------------- TRL, in a child of .venv-bench
def run_trl(row: str, model: Path, work: Path, steps: int, every: int, overrides: list[str]) -> dict[str, Any]:
    result = work / row / "result.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--trl-child", row, "--sft-model", str(model), "--work-dir", str(work)]
    cmd += ["--steps", str(steps), "--export-every", str(every), "--result", str(result), *overrides]
    print(f"{row}:", " ".join(cmd[1:]), flush=True)
    launched = time.time()
    log = work / row / "trl.log"
    with open(log, "w") as log_file:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=_env(OMP_NUM_THREADS="1"))
    wall = time.time() - launched
    if proc.returncode != 0 or not result.exists():
        text = log.read_text()
        errors = [line for line in text.splitlines() if "Error" in line or "Exception" in line]
        return {"error": errors[-1] if errors else f"exited {proc.returncode}", "log_tail": text[-2000:]}
    saved = json.loads(result.read_text())
    return {
        "checkpoints": [{"step": e["step"], "t": e["unix_time"] - launched, "path": e["path"]} for e in saved],
        "wall_s": wall,
    }


def trl_child(args: argparse.Namespace) -> None:
    """One TRL row: ``GRPOTrainer`` from the SFT model, saving it every ``--export-every`` steps."""
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer
    from vs_trl import load_grpo_config, trl_args, trl_dataset, trl_reward_fns

    torch.set_num_threads(1)  # as every forge process
    cfg = load_grpo_config(GRPO_CONFIG, [f"model.path={args.sft_model}", f"steps={args.steps}", *args.overrides])
    out = Path(args.work_dir) / args.trl_child
    fns, weights = trl_reward_fns(cfg)
    tokenizer = AutoTokenizer.from_pretrained(args.sft_model)
    saved: list[dict[str, Any]] = []

    class Saver(TrainerCallback):
        def on_step_end(self, targs, state, control, model=None, **kwargs):
            if state.global_step % args.export_every == 0:
                folder = out / "exports" / f"step_{state.global_step:08d}"
                model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                saved.append({"step": state.global_step, "unix_time": time.time(), "path": str(folder)})

    trainer = GRPOTrainer(
        model=str(args.sft_model),
        reward_funcs=fns,
        args=trl_args(cfg, out, TRL_ROWS[args.trl_child], weights),
        train_dataset=trl_dataset(cfg),
        processing_class=tokenizer,
        callbacks=[Saver()],
    )
    trainer.train()
    Path(args.result).write_text(json.dumps(saved))


# --------------------------------------------------------------------------- the one evaluator
class Evaluator:
    """Greedy accuracy of any checkpoint on the same held-out prompts, scored as forge scores."""

    def __init__(self, prompts: int) -> None:
        from apps.common.inputs import records_source
        from apps.grpo.config import GRPOConfig
        from forge.config import load_config
        from forge.data import load_prompts

        cfg = load_config(GRPOConfig, str(REPO / GRPO_CONFIG), ["model.path=unused"])
        source = records_source(cfg.data)
        source.path = str(REPO / source.path)
        source.split = "test"
        self.prompts = load_prompts(source)[:prompts]
        self.max_tokens = cfg.policy.max_tokens

    def accuracy(self, folder: str) -> float:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from forge.data import exact_match_reward
        from forge.evaluation import EvalSettings, eval_metrics
        from forge.types import Completion, Group

        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ids = torch.tensor([tokenizer(p.text).input_ids for p in self.prompts])  # one length: no padding
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=self.max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        groups = []
        for prompt, row in zip(self.prompts, out[:, ids.shape[1] :]):
            tokens = row[row != tokenizer.pad_token_id]
            eos = (tokens == tokenizer.eos_token_id).nonzero()
            tokens = tokens[: int(eos[0]) + 1] if len(eos) else tokens
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            groups.append(Group(prompt, [Completion(ids[0], tokens, torch.zeros(len(tokens)), text, 0)]))
        return eval_metrics(groups, [], exact_match_reward, EvalSettings(samples=0))["eval/accuracy"]


def curve(row: dict[str, Any], evaluator: Evaluator, start: float) -> list[tuple[float, float]]:
    """(seconds since launch, held-out accuracy) of the row's checkpoints, from (0, the SFT model's)."""
    points = [(0.0, start)]
    for checkpoint in row["checkpoints"]:
        points.append((checkpoint["t"], evaluator.accuracy(checkpoint["path"])))
    return points


def time_to(points: list[tuple[float, float]], target: float) -> float:
    return next((t for t, acc in points if acc >= target), float("inf"))


def accuracy_at(points: list[tuple[float, float]], t: float) -> float:
    """The accuracy of the newest checkpoint saved by time ``t``."""
    return [acc for when, acc in points if when <= t][-1]


def figures(rows: dict[str, Any], start: float) -> dict[str, Any]:
    target = start + TARGET_GAIN
    for row in rows.values():
        if "curve" in row:
            row["time_to_target_s"] = time_to(row["curve"], target)
            row["final_accuracy"] = row["curve"][-1][1]
    ran = {name: row for name, row in rows.items() if name != "forge" and "curve" in row}
    top = {"sft_accuracy": start, "target_accuracy": target}
    if "curve" not in rows.get("forge", {}) or not ran:
        return top
    best_name = min(ran, key=lambda n: (ran[n]["time_to_target_s"], -ran[n]["final_accuracy"]))
    best, forge = ran[best_name], rows["forge"]
    end = best["curve"][-1][0]
    return {
        **top,
        "best_trl_row": best_name,
        "forge_vs_best_trl_time_to_target": forge["time_to_target_s"] / best["time_to_target_s"],
        "eval_accuracy_at_equal_time_forge_minus_best_trl": accuracy_at(forge["curve"], end) - best["final_accuracy"],
        "final_eval_accuracy_forge_minus_best_trl": forge["final_accuracy"] - best["final_accuracy"],
    }


def plot(rows: dict[str, Any], target: float, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, row in rows.items():
        if "curve" in row:
            ax.plot(*zip(*row["curve"]), marker="o", markersize=3, label=name)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target (SFT + 0.10)")
    ax.set_xlabel("wall seconds from the process launch")
    ax.set_ylabel("held-out greedy accuracy")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-model", help="start from this SFT checkpoint instead of making one")
    parser.add_argument("--steps", type=int, default=100, help="GRPO steps of every system")
    parser.add_argument("--export-every", type=int, default=5, help="steps between saved checkpoints")
    parser.add_argument("--eval-prompts", type=int, default=500, help="held-out prompts the evaluator scores")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--work-dir", default=str(REPO / "outputs" / "time_to_accuracy"))
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--plot", help="write accuracy against wall seconds here (PNG)")
    parser.add_argument("--trl-child", choices=list(TRL_ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the GRPO config, for every system")
    args = parser.parse_args(argv)
    if args.trl_child:
        trl_child(args)
        return 0
    import forge.controller  # noqa: F401  (before monarch)

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"load_avg_1m_before": os.getloadavg()[0], "cpus": os.cpu_count()}
    if args.sft_model:
        model = Path(args.sft_model).resolve()
    else:
        model, result["sft_s"] = make_sft_model(work, [])
    result["sft_model"] = str(model)
    rows: dict[str, Any] = {}
    for system in args.systems:
        if system == "forge":
            rows[system] = run_forge(model, work, args.steps, args.export_every, args.overrides)
        else:
            rows[system] = run_trl(system, model, work, args.steps, args.export_every, args.overrides)
        row = rows[system]
        print(f"{system}: {row['error'] if 'error' in row else format(row['wall_s'], '.1f') + 's'}", flush=True)
    evaluator = Evaluator(args.eval_prompts)
    start = evaluator.accuracy(str(model))
    for row in rows.values():
        if "checkpoints" in row:
            row["curve"] = curve(row, evaluator, start)
    result.update(figures(rows, start))
    result["rows"] = rows
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(rows, start + TARGET_GAIN, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
