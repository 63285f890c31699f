"""The reward-model and DPO apps end to end, as a user runs them (``python -m apps.rm.main``,
``python -m apps.dpo.main``), and GRPO trained on the learned reward, on generated addition
preference pairs and a tiny model, each shrunk to a few dozen steps.

One reward-model run (a module fixture: 60 steps, killed at its step-60 checkpoint's write and
resumed from step 30 on two FSDP2 ranks) serves the tests of that app and GRPO's; the figures are
checked against what transformers computes from the exported folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from app_runs import REPO, finish_app, start_app

from tests.numerics import assert_close_to_scale

pytestmark = pytest.mark.timeout(300)

TASK = "{task: addition_preferences, digits: 2, train_size: 3000, test_size: 256}"
CHANCE_MARGIN = 0.1
"""Least rise of held-out pairwise accuracy above the untrained start (0.5 for a reward model's
random head) that counts as learned: 256 held-out pairs put chance's standard deviation at 0.03."""


def _run(app: str, config: str, *overrides: str, timeout: float = 240) -> tuple[int, str, str]:
    args = [sys.executable, "-m", f"apps.{app}.main", "--config", config, *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return finish_app(proc, timeout)


def _tiny(root: Path) -> Path:
    from forge.models import make_tiny_model

    return make_tiny_model(root / "tiny", hidden_size=64, num_layers=2, init_std=0.1)


def _common(root: Path, app: str) -> list[str]:
    return [
        f"model.path={_tiny(root)}",
        f"data.path={root / 'data'}",
        f"data.make_if_missing={TASK}",
        f"logging.output_dir={root / app}",
        "logging.progress_bar=false",
        f"weight_sync.dir={root / 'weights'}",
        "eval.pairs=256",
        "trainer.num_threads=1",
        "trainer.warmup_steps=0",
    ]


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _ok(code: int, out: str, err: str) -> None:
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"


@dataclass
class RMRuns:
    root: Path
    first: list[dict]
    rows: list[dict]

    @property
    def model(self) -> Path:
        return self.root / "rm" / "final_model"


@pytest.fixture(scope="module")
def rm_runs(tmp_path_factory: pytest.TempPathFactory) -> RMRuns:
    """60 steps with checkpoints every 30; the step-60 one is removed (the run was killed while
    writing it) and ``--resume`` on two ranks continues from step 30 to step 60."""
    root = tmp_path_factory.mktemp("rm_runs")
    args = [*_common(root, "rm"), "steps=60", "batch_size=32", "eval.every=30", "trainer.lr=1e-3"]
    args += ["trainer.checkpoint_every=30", "trainer.keep_checkpoints=3"]
    _ok(*_run("rm", "configs/rm_addition.yaml", *args))
    first = _rows(root / "rm")
    checkpoints = root / "rm" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000030", "step_00000060"]
    shutil.rmtree(checkpoints / "step_00000060")
    _ok(*_run("rm", "configs/rm_addition.yaml", *args, "trainer.procs=2", "--resume"))
    return RMRuns(root, first, _rows(root / "rm"))


def test_a_reward_model_learns_the_held_out_preferences(rm_runs: RMRuns) -> None:
    """From a random head (about chance at step 0) to well above chance on pairs never trained on."""
    evals = [(r["eval/step"], r["eval/pairwise_accuracy"]) for r in rm_runs.rows if "eval/step" in r]
    assert [step for step, _ in evals] == [0, 30, 60], evals
    start, end = evals[0][1], evals[-1][1]
    assert abs(start - 0.5) < 0.15 and end >= 0.5 + CHANCE_MARGIN, evals


def test_a_resumed_reward_model_run_repeats_the_killed_runs_steps(rm_runs: RMRuns) -> None:
    """Steps 31-60 again, on two ranks from the one-rank checkpoint: the same data and losses."""
    assert [r["step"] for r in rm_runs.rows] == list(range(1, 61))
    assert rm_runs.rows[:30] == rm_runs.first[:30]
    for again, first in zip(rm_runs.rows[30:], rm_runs.first[30:]):
        assert_close_to_scale(again["loss"], first["loss"], 1e-4, scale=1.0, what=f"step {first['step']} loss")


def test_the_exported_reward_model_scores_as_the_run_reported(rm_runs: RMRuns) -> None:
    """``final_model`` loads as a transformers classifier with its prompt format, and its own
    pairwise accuracy on the held-out pairs is the run's last ``eval/pairwise_accuracy``."""
    from transformers import AutoModelForSequenceClassification

    from forge.actors.reward_model import check_reward_checkpoint, read_prompt_format
    from forge.data import DataSource, PromptFormat
    from forge.data.preferences import load_preference_pairs

    check_reward_checkpoint(rm_runs.model)
    fmt = PromptFormat.from_model(str(rm_runs.model), *read_prompt_format(rm_runs.model))
    model = AutoModelForSequenceClassification.from_pretrained(rm_runs.model, dtype=torch.float32).eval()
    pairs = load_preference_pairs(DataSource(path=str(rm_runs.root / "data"), split="test"))[:256]

    def score(question: str, text: str) -> float:
        e = fmt.sft_example(question, text)
        with torch.no_grad():
            return float(model(torch.cat([e.prompt_ids, e.answer_ids])[None]).logits[0, 0])

    right = sum(score(p.prompt, p.chosen) > score(p.prompt, p.rejected) for p in pairs) / len(pairs)
    assert right == pytest.approx(rm_runs.rows[-1]["eval/pairwise_accuracy"], abs=1.5 / len(pairs))


def test_grpo_trains_on_the_learned_reward_and_logs_the_checker_beside_it(rm_runs: RMRuns, tmp_path: Path) -> None:
    """reward.models serves the exported reward model; the checker (weight 0) is logged, not
    trained on: every step's reward is the model's, so the rewards vary though no answer is right."""
    data = rm_runs.root / "questions"
    from forge.data.arithmetic import write_addition

    write_addition(data, digits=2, train_size=500, test_size=50)
    proc = start_app(
        tmp_path / "grpo",
        f"model.path={rm_runs.root / 'tiny'}",
        "model.tiny.make_if_missing=false",
        "data.source=dataset",
        f"data.path={data}",
        "reward.fns={exact_match: 0.0}",
        f"reward.models={{{rm_runs.model}: 1.0}}",
        "reward.normalize=running",
        "policy.max_tokens=4",
        steps=3,
    )
    code, out, err = finish_app(proc, 240)
    _ok(code, out, err)
    rows = _rows(tmp_path / "grpo" / "out")
    assert len(rows) == 3
    # Each source's mean over the groups made during a step, in the step's row.
    scored = [r for r in rows if "reward/model_rm" in r]
    assert scored and all("reward/fn_exact_match" in r for r in scored), rows
    assert all(r["reward/fn_exact_match"] == 0.0 for r in scored)  # a random policy gets nothing right
    assert any(r["reward_max"] > r["reward_mean"] + 1e-3 for r in rows), rows  # ...yet it is rewarded: by the model


def test_dpo_learns_the_held_out_preferences_and_its_policy_samples_them(tmp_path: Path) -> None:
    """From the reference (every margin 0 at step 0) to held-out pairs preferred well above
    chance; the policy service evaluates the step's weights beside the pairs."""
    args = [*_common(tmp_path, "dpo"), "steps=30", "batch_size=32", "eval.every=15", "trainer.lr=2e-3"]
    args += ["trainer.dpo_beta=0.5", "eval.max_prompts=20", "eval.max_tokens=4", "policy.max_tokens=4"]
    _ok(*_run("dpo", "configs/dpo_addition.yaml", *args))
    rows = _rows(tmp_path / "dpo")
    evals = [(r["eval/step"], r["eval/pairwise_accuracy"], r["eval/loss"]) for r in rows if "eval/step" in r]
    assert [step for step, *_ in evals] == [0, 15, 30], evals
    assert evals[0][2] == pytest.approx(0.6931, abs=1e-3)  # the policy is the reference: log 2
    assert evals[-1][1] >= 0.5 + CHANCE_MARGIN and evals[-1][2] < evals[0][2] - 0.05, evals
    assert all("eval/accuracy" in r for r in rows if "eval/step" in r)


def test_preference_data_without_its_key_fails_at_start_up_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "1+1=", "chosen": "2"}\n{"prompt": "1+2=", "chosen": "3"}\n')
    code, out, err = _run(
        "rm", "configs/rm_addition.yaml", *_common(tmp_path, "rm"), f"data.path={data}", "data.make_if_missing={}"
    )
    assert code != 0 and "no field 'rejected' (rejected_key)" in out + err, out + err[-2000:]
