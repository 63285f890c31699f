"""The GRPO app end to end, as a user runs it: ``python -m apps.grpo.main --config ...``.

Each test starts the app in a subprocess with the tiny config shrunk by overrides (a few steps,
a few prompts), so it exercises the real roles: vLLM policy, reference, reward and trainer
processes, the buffer and dataset actors, weight sync, checkpoints and shutdown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from app_runs import finish_app, start_app

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)

REQUIRED_KEYS = {"step", "reward_mean", "loss", "kl", "step_time_s", "policy_version", "padding_fraction"}
_reward_calls = 0


def crash_after_warmup(prompt, response_text):  # noqa: ANN001  (a reward function)
    """A reward function whose process dies on its 41st call: a role failing mid-run."""
    global _reward_calls
    _reward_calls += 1
    if _reward_calls > 40:
        os._exit(3)
    return 0.5


def _app(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    return start_app(tmp_path, *overrides, steps=3)


def _finish(proc: subprocess.Popen, timeout: float = 150) -> tuple[int, str, str]:
    return finish_app(proc, timeout)


def test_app_learns_reward_rises_from_an_on_policy_first_step(tmp_path: Path) -> None:
    """30 steps of 32 prompts on the toy task exit 0 with metrics.jsonl (the required keys, one
    line a step, one policy version a step), the PNG and the summary line; the reward of the
    last 5 steps is well above that of the first 5, and step 1 (policy, trainer and reference
    all at the initial weights) has an importance ratio of about 1 and a KL of about 0; by the last
    5 steps the policy has moved off the reference, and the KL, measured against the reference,
    is clearly above zero and far above the trainer-vs-sampler drift."""
    code, out, err = _finish(_app(tmp_path, "steps=30", "prompts_per_step=32", "group_size=8"), timeout=170)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(REQUIRED_KEYS <= set(r) for r in rows), rows[0].keys()
    assert [r["policy_version"] for r in rows] == list(range(1, 31))
    assert (tmp_path / "out" / "reward_loss.png").stat().st_size > 0
    assert "grpo: 30 steps" in out and "reward first-10" in out
    assert list((tmp_path / "weights").iterdir()) == []  # the run's own weight folder went with it
    first, last = (sum(r["reward_mean"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last > first + 0.08, [round(r["reward_mean"], 3) for r in rows]
    # The mean ratio is ~1 in expectation for any pair of policies, so the bound is tight: a
    # trainer at another temperature than the policy gave 0.995 here.
    assert abs(rows[0]["ratio_mean"] - 1.0) < 1e-3, rows[0]
    assert abs(rows[0]["kl"]) < 1e-3, rows[0]
    # The KL is against the reference: ~2 here by the last steps (0.3 by step 8). Measured against
    # the behaviour logprobs instead (a reference mixed up with them), it is the k3 of the
    # trainer-vs-sampler drift, ~0.02 and well under the drift's own mean (`mismatch_mean`, ~0.1).
    late_kl, late_mismatch = (sum(r[key] for r in rows[-5:]) / 5 for key in ("kl", "mismatch_mean"))
    assert late_kl > max(0.3, 3 * late_mismatch), [(round(r["kl"], 3), round(r["mismatch_mean"], 3)) for r in rows]


def test_a_run_with_in_flight_weight_updates_logs_each_tokens_age_within_max_policy_age(tmp_path: Path) -> None:
    """weight_sync.mode=in_flight: the policy takes each update between engine steps; the run
    completes with one version a step, and the age of every trained token (policy/token_age_*)
    is logged and bounded by max_policy_age, which goes by a sequence's oldest token."""
    code, out, err = _finish(_app(tmp_path, "steps=5", "weight_sync.mode=in_flight", "max_policy_age=1"))
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, 6))
    assert all(0 <= r["policy/token_age_mean"] <= r["policy/token_age_max"] <= 1 for r in rows), rows
    assert all(0 <= r["policy/spanning_fraction"] <= 1 for r in rows), rows


def test_a_rolling_run_over_two_policy_replicas_completes_with_one_version_a_step(tmp_path: Path) -> None:
    """weight_sync.mode=rolling with two policy replicas, one loading at a time: the run completes
    with one version a step, and no trained sequence spans two versions (each replica drains)."""
    overrides = ("steps=4", "weight_sync.mode=rolling", "weight_sync.max_updating=1", "policy.num_replicas=2")
    code, out, err = _finish(_app(tmp_path, *overrides))
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, 5))
    assert all(r["policy/spanning_fraction"] == 0.0 for r in rows), rows


def test_role_failure_stops_the_run_with_a_clear_message(tmp_path: Path) -> None:
    """The reward process dying mid-run, with no restart allowed (faults.max_restarts=0), ends the
    app at once, exit code != 0, naming the role (restarts: tests/integration/test_grpo_faults.py):
    the reward dies on its 41st call, during the third step's groups (16 completions a step, at
    most 16 more generated ahead), and no step after that one is logged."""
    code, out, err = _finish(
        _app(
            tmp_path,
            "steps=50",
            "reward.fns={tests.integration.test_grpo_app:crash_after_warmup: 1.0}",
            "faults.max_restarts=0",
        ),
        timeout=120,
    )
    assert code != 0
    assert "role 'reward' failed" in err, err[-3000:]
    metrics = tmp_path / "out" / "metrics.jsonl"
    logged = metrics.read_text().count("\n") if metrics.exists() else 0
    assert logged <= 3, f"{logged} steps were logged after the reward role died"


def test_ctrl_c_stops_every_role_and_exits_130(tmp_path: Path) -> None:
    """SIGINT during training shuts the roles down and exits with 130, leaving no child behind."""
    import psutil

    proc = _app(tmp_path, "steps=1000")
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            _, out, err = _finish(proc, timeout=5)
            pytest.fail(f"the app never got to step 2\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
        time.sleep(0.5)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the roles' processes should be children of the app"
    proc.send_signal(signal.SIGINT)
    code, out, err = _finish(proc, timeout=60)
    assert code == 130, f"exit code {code}\nstderr:\n{err[-3000:]}"
    assert "interrupted" in err
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def _metrics_lines(tmp_path: Path) -> list[str]:
    return (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()


@pytest.mark.slow  # ~90 s; the trainer's exact resume stays in test_trainer_sharded, the resume errors here
@pytest.mark.timeout(300)
def test_killed_run_resumes_from_its_last_checkpoint_with_the_same_step_numbers(tmp_path: Path) -> None:
    """SIGKILL after a checkpoint, then --resume: exit 0, steps 1..N once each, versions continue."""
    import psutil

    from forge.checkpoint import latest_checkpoint, read_training_state

    checkpoints = tmp_path / "out" / "checkpoints"
    proc = _app(tmp_path, "steps=1000", "trainer.checkpoint_every=2")
    deadline = time.monotonic() + 120
    while latest_checkpoint(checkpoints) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, out, err = _finish(proc, timeout=5)
            pytest.fail(f"the app never wrote a checkpoint\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
        time.sleep(0.1)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()  # SIGKILL: no cleanup of any kind runs in the controller
    proc.communicate()
    _, alive = psutil.wait_procs(children, timeout=15)
    for child in alive:
        child.kill()
    assert not alive, f"the killed app left processes behind: {[c.pid for c in alive]}"

    saved = read_training_state(latest_checkpoint(checkpoints))
    k, killed_lines = saved.step, _metrics_lines(tmp_path)
    assert saved.policy_version == k and saved.extra["dataset_position"] >= k * 4
    assert len(killed_lines) >= k
    steps = k + 3
    code, out, err = _finish(_app(tmp_path, f"steps={steps}", "trainer.checkpoint_every=2", "--resume"))
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert f"grpo: {steps} steps (resumed after step {k})" in out

    lines = _metrics_lines(tmp_path)
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert lines[:k] == killed_lines[:k]  # the record up to the checkpoint is kept as it was
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    # The first resumed step trained on groups the policy sampled with the checkpoint's weights.
    assert rows[k]["policy_age_mean"] == 0.0
    last = latest_checkpoint(checkpoints)
    assert last.name == f"step_{steps:08d}"  # the last step is always checkpointed
    assert read_training_state(last).extra["dataset_position"] > saved.extra["dataset_position"]
    assert not list((tmp_path / "weights").iterdir()), "the killed trainer's weight files were not removed"


def test_resume_without_a_checkpoint_fails_naming_the_folder(tmp_path: Path) -> None:
    """--resume with no checkpoint under <output_dir>/checkpoints exits 2 and says where it looked."""
    code, out, err = _finish(_app(tmp_path, "--resume"), timeout=60)
    assert code == 2
    assert f"--resume found no complete checkpoint under {tmp_path / 'out' / 'checkpoints'}" in err


def test_fresh_run_refuses_an_output_dir_that_holds_checkpoints(tmp_path: Path) -> None:
    """Without --resume, a run into a folder with checkpoints exits 2 instead of mixing two runs."""
    from forge.checkpoint import TrainingState, write_checkpoint

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    write_checkpoint(tmp_path / "out" / "checkpoints", model, optimizer, TrainingState(4, 4))
    code, out, err = _finish(_app(tmp_path), timeout=60)
    assert code == 2
    assert "holds checkpoints of an earlier run (newest step_00000004); add --resume" in err
