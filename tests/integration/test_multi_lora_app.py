"""The multi-adapter app end to end, as a user runs it: ``python -m apps.multi_lora.main``.

Real runs: one vLLM policy replica serving two runs' adapters, each run with its own LoRA trainer,
reward, buffer and dataset processes or actors; each run's own ``metrics.jsonl``; a run whose
reward raises ends alone, its adapter evicted, while the other trains on; each of two runs learns
its own task on the shared policy (slow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from app_runs import REPO, finish_app

pytest.importorskip("vllm")

pytestmark = pytest.mark.timeout(150)

STEPS = 3
LEARN_STEPS = 40
LEARN_GAIN = 0.05
"""A run's reward gain, last 5 steps over first 5, that the slow learning test asks of each run: one
run gained 0.13 (reverse3) and 0.105 (reverse2), its step-to-step noise is about 0.015; half the
smaller gain. A policy that never serves the trained adapter gains about 0."""


def _start_job(
    tmp_path: Path,
    runs: list[dict],
    max_loras: int,
    shared: tuple[str, ...] = (f"steps={STEPS}", "prompts_per_step=4"),
    args: tuple[str, ...] = (),
) -> subprocess.Popen:
    """The app on a config of ``runs`` (3 steps of 4 prompts x 4 each unless ``shared`` or a run
    overrides them); ``args``: more command-line arguments (``--resume``)."""
    config = {
        "grpo": "configs/grpo_tiny_lora.yaml",
        "shared": [
            "group_size=4",
            *shared,
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
    command = [sys.executable, "-m", "apps.multi_lora.main", "--config", str(tmp_path / "job.yaml"), *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish_job(proc: subprocess.Popen, tmp_path: Path, timeout: float = 140) -> tuple[int, str, dict]:
    """The job's exit code, stderr and summary.json; a job past ``timeout`` is killed and fails the test."""
    _, _, err = finish_app(proc, timeout)
    summary_path = tmp_path / "out" / "summary.json"
    assert summary_path.is_file(), f"exit {proc.returncode}\nstderr:\n{err[-3000:]}"
    return proc.returncode, err, json.loads(summary_path.read_text())


def _run_job(tmp_path: Path, runs: list[dict], max_loras: int) -> tuple[int, str, dict]:
    return _finish_job(_start_job(tmp_path, runs, max_loras), tmp_path)


class _StderrWatch:
    """The job's stderr read as it comes: ``probe()``'s value when the first line holding
    ``needle`` arrived (``at_line``), so a test can tell what had happened by then."""

    def __init__(self, proc: subprocess.Popen, needle: str, probe: Callable[[], object]) -> None:
        self.proc, self.needle, self.probe = proc, needle, probe
        self.lines: list[str] = []
        self.at_line: object = None
        self._threads = [
            threading.Thread(target=self._read_stderr, daemon=True),
            threading.Thread(target=proc.stdout.read, daemon=True),  # drained, so the job never blocks on it
        ]
        for t in self._threads:
            t.start()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            if self.at_line is None and self.needle in line:
                self.at_line = self.probe()
            self.lines.append(line)

    def finish(self, tmp_path: Path, timeout: float = 140) -> tuple[int, str, dict]:
        """As ``_finish_job``: the exit code, stderr and summary.json."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the job did not finish within {timeout}s\nstderr:\n{''.join(self.lines)[-3000:]}")
        for t in self._threads:
            t.join(30)
        err = "".join(self.lines)
        summary_path = tmp_path / "out" / "summary.json"
        assert summary_path.is_file(), f"exit {self.proc.returncode}\nstderr:\n{err[-3000:]}"
        return self.proc.returncode, err, json.loads(summary_path.read_text())


def _rows(tmp_path: Path, name: str) -> list[dict]:
    path = tmp_path / "out" / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


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
    that held it; run a, whose reward scores nothing before b's has raised, trains all its steps
    after b's failure; the job exits 1 naming b and the reward's error."""
    faults = "tests.integration.multi_lora_faults"
    env = f"reward.env={{OMP_NUM_THREADS: '1', MLORA_TEST_RAISED: '{tmp_path / 'raised'}'}}"
    runs = [
        {"name": "a", "overrides": ["seed=0", f"reward.fns={{'{faults}:toy_after_the_raise': 1.0}}", env]},
        {"name": "b", "overrides": ["seed=1", f"reward.fns={{'{faults}:raising_reward': 1.0}}", env]},
    ]
    watch = _StderrWatch(_start_job(tmp_path, runs, max_loras=2), "run b failed", lambda: len(_rows(tmp_path, "a")))
    code, err, summary = watch.finish(tmp_path)
    assert code == 1, err[-3000:]
    assert "1 of 2 runs failed: b (" in err and "broken on purpose" in err, err[-3000:]
    a, b = summary["runs"]
    assert (a["ok"], a["steps"]) == (True, STEPS), a
    assert (b["ok"], b["steps"], b["evicted_from"]) == (False, 0, 1), b
    assert [r["policy_version"] for r in _rows(tmp_path, "a")] == list(range(1, STEPS + 1))
    assert watch.at_line is not None and watch.at_line < STEPS, watch.at_line  # a trained on after b's end


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


MULTITURN = (
    "env.cls=forge.envs.toy:ReverseWithFeedback",
    "env.options={max_guesses: 3}",
    "env.max_turns=3",
    "env.env={OMP_NUM_THREADS: '1'}",
)
"""A run that plays ``configs/multiturn_tiny.yaml``'s reversal game with feedback."""


def test_a_run_evaluates_through_its_adapter_while_a_multi_turn_run_trains_beside_it(tmp_path: Path) -> None:
    """Run a (a generated addition task, eval.every=2): held-out evaluations at step 0 (its
    adapter's version 0, the base) and after its last step, each sampled with the adapter version
    of the step it evaluates. Run b plays the multi-turn game on the same replica: more than one
    turn per trajectory, every turn from its own adapter (a policy age of at most 1 at each step;
    the base's turns would be 2 versions old by step 3)."""
    runs = [
        {
            "name": "a",
            "overrides": [
                "seed=0",
                "data.source=dataset",
                f"data.path={tmp_path / 'addition'}",
                "data.make_if_missing={task: addition, digits: 1, train_size: 80, test_size: 20}",
                "reward.fns={exact_match: 1.0}",
                "eval.every=2",
                "eval.data.split=test",
                "eval.max_prompts=8",
                "eval.samples=2",
            ],
        },
        {"name": "b", "overrides": ["seed=1", *MULTITURN]},
    ]
    code, err, summary = _run_job(tmp_path, runs, max_loras=2)
    assert code == 0, err[-3000:]
    assert [(r["name"], r["ok"], r["steps"]) for r in summary["runs"]] == [("a", True, STEPS), ("b", True, STEPS)]
    rows = _rows(tmp_path, "a")
    evals = [
        (r["step"], r["eval/step"], r["eval/policy_version"], r["eval/prompts"]) for r in rows if "eval/accuracy" in r
    ]
    assert evals[0] == (1, 0, 0, 8) and evals[-1] == (STEPS, STEPS, STEPS, 8), evals
    rows = _rows(tmp_path, "b")
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1)), rows
    assert all(0 <= r["policy_age_mean"] <= 1 for r in rows), [r["policy_age_mean"] for r in rows]
    turns = [r["rollout/turns"] for r in rows if "rollout/turns" in r]
    assert turns and max(turns) > 1.5, turns


def test_a_dead_trainer_is_replaced_from_its_runs_checkpoint_and_the_job_resumes_each_run(tmp_path: Path) -> None:
    """Every run checkpoints every 2 steps. SIGKILL of run b's trainer after its step 3: a new
    trainer loads b's newest checkpoint (step 2, or 4 if b got there first), every replica serves
    b's adapter at that version again
    (its catalog's version; the logprobs of a probe sampled with it equal the trainer's), b
    trains steps 3..6 again and the job exits 0, run a untouched. Then the same job with
    steps=8 and --resume: each run continues from its own step-6 checkpoint, steps 7 and 8
    appended to its metrics."""
    from apps.grpo.faults import role_processes

    runs = [{"name": "a", "overrides": ["seed=0"]}, {"name": "b", "overrides": ["seed=1"]}]
    shared = ("prompts_per_step=4", "trainer.checkpoint_every=2", "faults.health_timeout_s=30")
    proc = _start_job(tmp_path, runs, max_loras=2, shared=("steps=6", *shared))
    deadline = time.monotonic() + 100
    while len(_rows(tmp_path, "b")) < 3:
        if proc.poll() is not None or time.monotonic() > deadline:
            _finish_job(proc, tmp_path)
            pytest.fail("run b never logged 3 steps")
        time.sleep(0.2)
    victims = role_processes(proc.pid, "trainer", run="b")
    assert len(victims) == 1, victims
    victims[0].kill()
    code, err, summary = _finish_job(proc, tmp_path)
    assert code == 0, err[-3000:]
    a, b = summary["runs"]
    assert (a["ok"], a["steps"], b["ok"], b["steps"]) == (True, 6, True, 6), summary
    rows = _rows(tmp_path, "b")
    assert [r["step"] for r in rows] == list(range(1, 7)) and [r["policy_version"] for r in rows] == list(range(1, 7))
    (restored,) = [r for r in rows if "weight_sync/restore/policy0_version" in r]
    # Killed after step 3 was logged (b may have logged another step or two before the death was
    # seen): the first step after b's newest checkpoint, which every replica serves again.
    assert restored["step"] in (3, 5) and restored["restarts/trainer"] == 1, restored
    assert restored["weight_sync/restore/policy0_version"] == restored["step"] - 1, restored
    assert restored["weight_sync/restore/policy0_logprob_gap"] <= 1e-3, restored
    assert [r["step"] for r in _rows(tmp_path, "a")] == list(range(1, 7))

    code, err, summary = _finish_job(
        _start_job(tmp_path, runs, 2, shared=("steps=8", *shared), args=("--resume",)), tmp_path
    )
    assert code == 0, err[-3000:]
    for name in ("a", "b"):
        rows = _rows(tmp_path, name)
        assert [r["step"] for r in rows] == list(range(1, 9)), (name, [r["step"] for r in rows])
        assert [r["policy_version"] for r in rows[6:]] == [7, 8], (name, rows[6:])


@pytest.mark.slow  # ~5 min; by default: newest adapters served (test_multi_lora_policy), trained (test_trainer_lora)
@pytest.mark.timeout(900)
def test_each_run_learns_its_own_task_on_one_replica_holding_one_adapter_at_a_time(tmp_path: Path) -> None:
    """Two runs on one replica with max_loras=1 (each run's batches reload its newest adapter):
    3-digit reversal, and 2-digit reversal with an exact-answer bonus, 40 steps of 32 prompts x 8
    each: each run's reward over its last 5 steps is above its first 5 steps' by LEARN_GAIN."""
    runs = [
        {"name": "reverse3", "overrides": ["seed=0"]},
        {
            "name": "reverse2",
            "overrides": [
                "seed=1",
                "data.options={min_digits: 2, max_digits: 2}",
                "reward.fns={toy: 0.8, exact_match: 0.2}",
            ],
        },
    ]
    shared = (f"steps={LEARN_STEPS}", "prompts_per_step=32", "group_size=8", "policy.prompt_seeds=true")
    code, err, summary = _finish_job(_start_job(tmp_path, runs, 1, shared), tmp_path, timeout=850)
    assert code == 0, err[-3000:]
    for name in ("reverse3", "reverse2"):
        rewards = [r["reward_mean"] for r in _rows(tmp_path, name)]
        assert len(rewards) == LEARN_STEPS, name
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        assert last > first + LEARN_GAIN, (name, [round(r, 3) for r in rewards])
