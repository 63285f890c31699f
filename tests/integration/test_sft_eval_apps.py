"""SFT, held-out evaluation and GRPO from the SFT model, end to end, as a user runs them:
``python -m apps.sft.main``, ``python -m apps.eval.main`` and ``python -m apps.grpo.main`` in
subprocesses, on a generated addition task and a tiny model, each shrunk to a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from app_runs import REPO, finish_app, start_app

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(240)

TASK = "{task: addition, digits: 2, train_size: 2000, test_size: 200}"


def _run(app: str, config: str, tmp_path: Path, *overrides: str, timeout: float = 180) -> tuple[int, str, str]:
    args = [sys.executable, "-m", f"apps.{app}.main", "--config", config, *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return finish_app(proc, timeout)


def _sft(tmp_path: Path, *overrides: str, timeout: float = 180) -> tuple[int, str, str]:
    """The SFT app on the addition config, shrunk: a 1-layer 64-wide model, 2-digit sums."""
    return _run(
        "sft",
        "configs/sft_addition.yaml",
        tmp_path,
        f"model.path={tmp_path / 'tiny'}",
        "model.tiny.hidden_size=64",
        "model.tiny.num_layers=1",
        f"data.path={tmp_path / 'data'}",
        f"data.make_if_missing={TASK}",
        f"logging.output_dir={tmp_path / 'sft'}",
        "logging.progress_bar=false",
        f"weight_sync.dir={tmp_path / 'weights'}",
        "batch_size=16",
        "eval.max_prompts=40",
        "eval.loss_examples=32",
        "eval.max_tokens=4",
        "policy.max_tokens=4",
        "eval.stop_at_accuracy=0",
        "trainer.num_threads=1",
        "trainer.warmup_steps=0",
        "trainer.lr=3e-3",
        *overrides,
        timeout=timeout,
    )


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_sft_resumes_exports_and_its_model_is_evaluated_and_trained_by_grpo(tmp_path: Path) -> None:
    """SFT: 4 steps with packed sequences, then a second run with --resume on a two-rank FSDP2
    trainer (the one-rank checkpoint reshards) continues to step 6 with the same step numbers;
    held-out loss and accuracy at steps 3, 4 and 6; a final_model. That model then loads as it is
    in the evaluation app (eval.json with the same figures' names) and as the GRPO app's
    model.path, whose held-out evaluation runs at step 0, beside training and after the last step."""
    code, out, err = _sft(
        tmp_path, "steps=4", "eval.every=3", "trainer.checkpoint_every=2", "trainer.pack_sequences=true"
    )
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    code, out, err = _sft(
        tmp_path, "steps=6", "eval.every=3", "trainer.checkpoint_every=2", "trainer.procs=2", "--resume"
    )
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _rows(tmp_path / "sft")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # steps 5 and 6 by the resumed run, none twice
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["eval/step"] for r in evals] == [3, 4, 6]  # every 3 steps and each run's last
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 and r["eval/prompts"] == 40 for r in evals)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "sft: 6 steps" in out and "held-out loss" in out
    model = tmp_path / "sft" / "final_model"
    assert (model / "model.safetensors").is_file() and (tmp_path / "sft" / "loss.png").is_file()

    code, out, err = _run(
        "eval",
        "configs/eval_addition.yaml",
        tmp_path,
        f"model.path={model}",
        f"data.path={tmp_path / 'data'}",
        "eval.max_prompts=40",
        "eval.samples=2",
        "eval.max_tokens=4",
        f"logging.output_dir={tmp_path / 'eval'}",
    )
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["eval/prompts"] == 40 and {"eval/accuracy", "eval/pass@2", "eval/mean@2", "eval/s"} <= set(result)

    proc = start_app(
        tmp_path / "grpo",
        f"model.path={model}",
        f"data.path={tmp_path / 'data'}",
        "eval.every=2",
        "eval.max_prompts=40",
        "eval.samples=2",
        "policy.max_tokens=4",
        "eval.max_tokens=4",
        steps=5,
        config="configs/grpo_addition.yaml",
    )
    code, out, err = finish_app(proc, 180)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _rows(tmp_path / "grpo" / "out")
    evals = [(r["step"], r["eval/step"]) for r in rows if "eval/accuracy" in r]
    # Step 0's before training (in step 1's row) and the last step's in its own row; those of steps 2
    # and 4 ran beside training and reached a later row, or were skipped (one still running, or
    # superseded by the last), and counted.
    assert evals[0] == (1, 0) and evals[-1] == (5, 5), evals
    beside = [at for _, at in evals[1:-1]]
    assert set(beside) <= {2, 4} and len(beside) + rows[-1]["eval/skipped"] == 2, (evals, rows[-1])
    assert "held-out accuracy" in out


def test_sft_data_without_the_answer_key_fails_at_start_up_naming_the_key_and_the_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"question": "1+1=", "solution": "2"}) + "\n")
    (data / "test.jsonl").write_text(json.dumps({"question": "1+2=", "solution": "3"}) + "\n")
    code, _, err = _sft(tmp_path, "steps=2", "data.make_if_missing={}")
    assert code == 1, err[-2000:]
    assert "no field 'answer' (answer_key)" in err and str(data) in err and "question, solution" in err


def test_grpo_eval_data_that_is_missing_fails_at_start_up(tmp_path: Path) -> None:
    """eval.data.path names no file: the run stops before any role starts, naming the path."""
    proc = start_app(tmp_path, "eval.every=2", f"eval.data.path={tmp_path / 'nope.jsonl'}", steps=2)
    code, _, err = finish_app(proc, 60)
    assert code == 1 and "nope.jsonl' does not exist" in err, err[-2000:]
