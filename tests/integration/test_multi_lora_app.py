"""The multi-adapter app end to end, as a user runs it: ``python -m apps.multi_lora.main``.

Real runs: one vLLM policy replica serving two runs' adapters, each run with its own LoRA trainer,
reward, buffer and dataset processes or actors; each run's own ``metrics.jsonl``; a run whose
reward raises ends alone, its adapter evicted, while the other finishes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from app_runs import REPO, finish_app

pytest.importorskip("vllm")

pytestmark = pytest.mark.timeout(150)

STEPS = 3


def _start_job(tmp_path: Path, runs: list[dict], max_loras: int) -> subprocess.Popen:
    """The app on a config of ``runs`` (3 steps of 4 prompts x 4 each unless a run overrides them)."""
    config = {
        "grpo": "configs/grpo_tiny_lora.yaml",
        "shared": [
            f"steps={STEPS}",
            "prompts_per_step=4",
            "group_size=4",
            "weight_sync.transport=message",
            "logging.sinks=[jsonl]",
            "logging.progress_bar=false",
            "logging.plot=false",
            f"model.path={tmp_path / 'tiny'}",
        ],
        "max_loras": max_loras,
        "output_dir": str(tmp_path / "out"),
        "runs": runs,
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "apps.multi_lora.main", "--config", str(tmp_path / "job.yaml")]
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish_job(proc: subprocess.Popen, tmp_path: Path, timeout: float = 140) -> tuple[int, str, dict]:
    """The job's exit code, stderr and summary.json; a job past ``timeout`` is killed and fails the test."""
    _, _, err = finish_app(proc, timeout)
    summary_path = tmp_path / "out" / "summary.json"
    assert summary_path.is_file(), f"exit {proc.returncode}\nstderr:\n{err[-3000:]}"
    return proc.returncode, err, json.loads(summary_path.read_text())


def _run_job(tmp_path: Path, runs: list[dict], max_loras: int) -> tuple[int, str, dict]:
    return _finish_job(_start_job(tmp_path, runs, max_loras), tmp_path)


def _rows(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / name / "metrics.jsonl").read_text().splitlines()]


def test_two_runs_share_one_policy_replica_each_with_its_own_adapter_versions_and_metrics(tmp_path: Path) -> None:
    """K=2 runs, one replica holding one adapter at a time (max_loras=1: the LRU evicts): exit 0,
    each run's own metrics.jsonl with its own versions 1..3, step 1 sampled from the base (its
    adapter's version 0), both adapters evicted at the end."""
    runs = [
        {"name": "a", "overrides": ["seed=0"]},
        {"name": "b", "overrides": ["seed=1", "reward.fns={exact_match: 1.0}"]},
    ]
    code, err, summary = _run_job(tmp_path, runs, max_loras=1)
    assert code == 0, err[-3000:]
    for name in ("a", "b"):
        rows = _rows(tmp_path, name)
        assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1)), name
        assert abs(rows[0]["kl"]) < 1e-3 and abs(rows[0]["ratio_mean"] - 1.0) < 1e-3, rows[0]
        assert all(0 <= r["policy_age_mean"] <= 1 for r in rows), rows  # its own versions, not the other run's
    assert [(r["name"], r["ok"], r["steps"]) for r in summary["runs"]] == [("a", True, STEPS), ("b", True, STEPS)]
    models = summary["policy_models"]
    assert models["loads"] >= 2 and models["evictions"] >= 1 and models["load_failures"] == 0, models


def test_a_run_whose_reward_raises_ends_alone_and_its_adapter_is_evicted(tmp_path: Path) -> None:
    """Run b's reward raises on its first group: b fails, its adapter is evicted from the replica
    that held it; run a trains all its steps; the job exits 1 naming b and the reward's error."""
    broken = "reward.fns={'tests.integration.multi_lora_faults:raising_reward': 1.0}"
    runs = [{"name": "a", "overrides": ["seed=0"]}, {"name": "b", "overrides": ["seed=1", broken]}]
    code, err, summary = _run_job(tmp_path, runs, max_loras=2)
    assert code == 1, err[-3000:]
    assert "1 of 2 runs failed: b (" in err and "broken on purpose" in err, err[-3000:]
    a, b = summary["runs"]
    assert (a["ok"], a["steps"]) == (True, STEPS), a
    assert (b["ok"], b["steps"], b["evicted_from"]) == (False, 0, 1), b
    assert [r["policy_version"] for r in _rows(tmp_path, "a")] == list(range(1, STEPS + 1))
    assert b["seconds"] < a["seconds"]  # b ended first, and a went on without it


def test_a_run_whose_trainer_dies_ends_alone_while_the_other_trains_on(tmp_path: Path) -> None:
    """SIGKILL of run b's trainer process after b's first step (no trainer restarts in this app):
    b fails naming its trainer, its adapter is evicted; run a trains all its steps on the same
    policy replica; the job exits 1 naming b."""
    import psutil

    runs = [
        {"name": "a", "overrides": ["seed=0", "steps=8"]},
        {
            "name": "b",
            "overrides": [
                "seed=1",
                "steps=8",
                "faults.health_timeout_s=20",
                "trainer.env={OMP_NUM_THREADS: '1', MLORA_TEST_RUN: b}",
            ],
        },
    ]
    proc = _start_job(tmp_path, runs, max_loras=2)
    metrics = tmp_path / "out" / "b" / "metrics.jsonl"
    deadline = time.monotonic() + 100
    while not (metrics.is_file() and metrics.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            _finish_job(proc, tmp_path)
            pytest.fail("run b never logged a step")
        time.sleep(0.2)
    victims = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            env = child.environ()
            if env.get("MLORA_TEST_RUN") == "b" and child.parent().environ().get("MLORA_TEST_RUN") != "b":
                victims.append(child)
        except psutil.Error:
            continue
    assert len(victims) == 1, victims
    victims[0].kill()
    code, err, summary = _finish_job(proc, tmp_path)
    assert code == 1 and "1 of 2 runs failed: b (" in err, err[-3000:]
    a, b = summary["runs"]
    assert (a["ok"], a["steps"]) == (True, 8), a
    assert not b["ok"] and 1 <= b["steps"] < 8 and "trainer" in b["error"], b
    assert b["evicted_from"] == 1, b
