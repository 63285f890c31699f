"""A GRPO run outlives its rollout side: real role processes are SIGKILLed or SIGSTOPped mid-run.

The end-to-end tests start the app as a user does (``python -m apps.grpo.main``, the tiny config
shrunk by overrides) and find a role's processes through psutil and the ``FORGE_GRPO_ROLE``
variable each role's processes carry. The weight-sync test drives the app's own sync code
against a real two-replica service of a light actor, so that the death can land while the
sync is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from app_runs import finish_app, start_app

from apps.grpo.faults import role_processes
from forge.controller import ForgeActor, endpoint
from tests.unit.controller.waits import until

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(480)
STEPS = 8


def _app(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    return start_app(tmp_path, *overrides, steps=STEPS)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    return finish_app(proc, timeout)


def _rows(tmp_path: Path) -> list[dict]:
    path = tmp_path / "out" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(proc: subprocess.Popen, tmp_path: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(_rows(tmp_path)) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, out, err = _finish(proc, timeout=10)
            pytest.fail(f"the app never got to step {step}\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
        time.sleep(0.2)


def _wait_for_checkpoint(proc: subprocess.Popen, tmp_path: Path, timeout: float = 60) -> None:
    """Until the run has a complete checkpoint (one written in the background lands after its step)."""
    from forge.checkpoint import list_checkpoints

    deadline = time.monotonic() + timeout
    while not list_checkpoints(tmp_path / "out" / "checkpoints"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, out, err = _finish(proc, timeout=10)
            pytest.fail(f"the app wrote no checkpoint\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
        time.sleep(0.1)


def _kill_role_at_step(proc: subprocess.Popen, tmp_path: Path, step: int, role: str, marks: Path | None = None) -> None:
    """SIGKILL the role's one process once the run has logged ``step`` and, with ``marks`` (the
    slow environment's), once an environment step is in flight: trajectories are between turns."""
    _wait_for_step(proc, tmp_path, step)
    if marks is not None:
        _wait_for_env_step(proc, marks)
    (victim,) = role_processes(proc.pid, role)
    victim.kill()


def _wait_for_env_step(proc: subprocess.Popen, marks: Path, timeout: float = 60) -> None:
    """Until the slow environment has a step in flight (``slow_env.steps_in_flight``)."""
    from slow_env import steps_in_flight

    deadline = time.monotonic() + timeout
    while not steps_in_flight(marks):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, out, err = _finish(proc, timeout=10)
            pytest.fail(f"no environment step in flight\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
        time.sleep(0.01)


def _slow_env(tmp_path: Path) -> tuple[list[str], Path]:
    """Overrides for the slow environment (0.25 s steps) marking its steps in flight, and where."""
    marks = tmp_path / "env_steps"
    return ["env.cls=tests.integration.slow_env:SlowReverseWithFeedback", f"env.options.marks={marks}"], marks


def _every_step(proc: subprocess.Popen, tmp_path: Path) -> list[dict]:
    """The run's rows once it exited 0 having logged each of its steps once, in order."""
    code, out, err = _finish(proc)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no step twice, none missing
    return rows


def _accounted(row: dict, steps: int, prompts_per_step: int = 4) -> None:
    """Every group went somewhere, none twice, and exactly the steps' groups were trained."""
    assert row["groups/lost"] == 0 and row["groups/unaccounted"] == 0, row
    assert row["groups/duplicates"] == 0, row
    assert row["groups/trained"] == steps * prompts_per_step, row


def test_killed_policy_replica_restarts_resyncs_and_the_run_completes(tmp_path: Path) -> None:
    """SIGKILL of the only policy process at step 2: the run waits for its restart, which loads
    the current weights before serving, and completes every step (same numbers), exit 0. Rewards
    that take a while (``slow_reward``) keep the run from ending before the kill lands: with the
    toy reward a loaded machine once looked again after step 8 and the restart never happened."""
    from slow_reward import OVERRIDES as SLOW_REWARD

    proc = _app(tmp_path, *SLOW_REWARD)
    _kill_role_at_step(proc, tmp_path, 2, "policy")
    rows = _every_step(proc, tmp_path)
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["restarts/policy"] == 1 and rows[-1]["restarts/reference"] == 0
    # The restarted engine came up at version 0; it served only after loading the current weights
    # (with max_policy_age=1 its version-0 groups could never train past step 2).
    resyncs = [r for r in rows if r.get("weight_sync/resyncs")]
    assert resyncs and resyncs[0]["weight_sync/resync_version"] >= 2, [r.get("weight_sync/resyncs") for r in rows]
    _accounted(rows[-1], STEPS)


def test_multiturn_run_outlives_its_env_and_policy_replicas_dying_mid_trajectory(tmp_path: Path) -> None:
    """The multi-turn toy run: SIGKILL of the environment's process during step 3 and of the
    policy's during step 5, while trajectories are between turns. Each role restarts; a policy
    turn is resent to the restarted policy replica, and a trajectory whose episode died with the
    env replica is played again with its group (``groups/regenerated``), never counted as the
    environment's failure. The run completes every step with every group accounted for."""
    # Env steps of 0.25 s keep the trajectories between turns when the kills land (see slow_env).
    slow_env, marks = _slow_env(tmp_path)
    proc = start_app(tmp_path, *slow_env, steps=STEPS, config="configs/multiturn_tiny.yaml")
    for step, role in ((2, "env"), (4, "policy")):
        _kill_role_at_step(proc, tmp_path, step, role, marks)  # while an env step is in flight
    rows = _every_step(proc, tmp_path)
    last = rows[-1]
    assert last["restarts/env"] == 1 and last["restarts/policy"] == 1, last
    assert last["retried/env"] + last["groups/regenerated"] >= 1, last  # the env's death cut work short
    assert not any(r.get("rollout/failed_trajectories") for r in rows), [
        r.get("rollout/failed_trajectories") for r in rows
    ]
    _accounted(last, STEPS)


def test_with_rollout_workers_the_run_outlives_a_worker_and_a_policy_replica_dying(tmp_path: Path) -> None:
    """The multi-turn toy run with ``rollout.workers=2``: the workers play the trajectories
    (attached to the policy, env and reference services the controller owns). SIGKILL of one
    worker during step 3 and of the policy during step 5: the worker restarts and attaches
    again, the restarted policy reaches the workers in a new view, and the run completes every
    step with every group accounted for."""
    slow_env, marks = _slow_env(tmp_path)
    proc = start_app(tmp_path, *slow_env, "rollout.workers=2", steps=STEPS, config="configs/multiturn_tiny.yaml")
    _wait_for_step(proc, tmp_path, 2)
    _wait_for_env_step(proc, marks)  # the workers' trajectories are between turns
    workers = role_processes(proc.pid, "rollout")
    assert len(workers) == 2, workers
    workers[0].kill()
    _kill_role_at_step(proc, tmp_path, 4, "policy", marks)
    rows = _every_step(proc, tmp_path)
    last = rows[-1]
    assert last["restarts/rollout"] == 1 and last["restarts/policy"] == 1, last
    assert last["retried/rollout"] + last["groups/regenerated"] >= 1, last  # the worker's death cut work short
    _accounted(last, STEPS)


@pytest.mark.slow
def test_hung_reference_replica_is_found_by_health_probes_and_replaced(tmp_path: Path) -> None:
    """SIGSTOP of the reference process: probes fail it within faults.health_timeout_s, a new
    one takes over, the groups waiting on it are answered, and the run completes."""
    import psutil

    proc = _app(tmp_path, "faults.health_interval_s=1", "faults.health_timeout_s=5")
    _wait_for_step(proc, tmp_path, 2)
    (victim,) = role_processes(proc.pid, "reference")
    victim.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        while not any(p.pid != victim.pid for p in role_processes(proc.pid, "reference")):
            assert time.monotonic() - stopped_at < 5 + 1 + 30, "no new reference process 30 s past the timeout"
            time.sleep(0.2)
        code, out, err = _finish(proc)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()  # a stopped process takes SIGKILL (if the app's shutdown did not reap it)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert "failed: no answer for 5s" in err
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["restarts/reference"] == 1
    _accounted(rows[-1], STEPS)


@pytest.mark.slow  # ~40 s; test_grpo_app's role-failure test covers max_restarts=0 by default
def test_a_role_without_restarts_left_stops_the_run_naming_the_role(tmp_path: Path) -> None:
    """faults.max_restarts=0: the reward process's death ends the run, exit 1, and the message
    names the role and says that no restart was allowed."""
    proc = _app(tmp_path, "steps=1000", "faults.max_restarts=0")
    _kill_role_at_step(proc, tmp_path, 2, "reward")
    code, out, err = _finish(proc, timeout=90)
    assert code == 1, f"exit code {code}\nstderr:\n{err[-3000:]}"
    assert "grpo: FAILED: role 'reward' failed: replica 0 failed" in err, err[-3000:]
    assert "faults.max_restarts=0 allows no restart" in err
    assert "failed 0 times" not in err


@pytest.mark.slow
def test_a_role_with_no_healthy_replica_for_too_long_stops_the_run(tmp_path: Path) -> None:
    """A restart that cannot come within faults.max_unhealthy_s (its backoff is longer) ends the
    run with a message naming the role and the time it had no healthy replica."""
    proc = _app(tmp_path, "steps=1000", "faults.restart_backoff_s=60", "faults.max_unhealthy_s=3")
    _kill_role_at_step(proc, tmp_path, 2, "reference")
    code, out, err = _finish(proc, timeout=90)
    assert code == 1, f"exit code {code}\nstderr:\n{err[-3000:]}"
    assert "role 'reference' failed: no healthy replica for 3s (faults.max_unhealthy_s=3)" in err, err[-3000:]


PROBE_GAP = 1e-3
"""Largest |policy - trainer| logprob of the restore's probe tokens for a replica that serves the
trainer's weights: float32 vLLM against float32 torch differ by ~1e-6 here; the weights one
training step earlier or later move them by ~1e-2."""


def _restored_weights_served(rows: list[dict], tmp_path: Path, restored: int, replicas: int) -> None:
    """The row after the restore says the trainer holds checkpoint ``restored``'s weights and
    that every policy replica serves them at its version, each measured where it lives; and
    that a replica served a newer version before (so a missing resync would have shown)."""
    import torch

    from forge.checkpoint import read_checkpoint
    from forge.generation.weight_sync import TIED_EMBEDDING, TIED_HEAD, weights_fingerprint
    from tests.numerics import assert_close_to_scale

    model, _, training = read_checkpoint(tmp_path / "out" / "checkpoints" / f"step_{restored:08d}")
    if TIED_HEAD in model and torch.equal(model[TIED_HEAD], model[TIED_EMBEDDING]):
        del model[TIED_HEAD]  # the trainer publishes a tied head once, as the embedding
    want = weights_fingerprint(model.values())
    row = rows[restored]  # step restored + 1: the first one trained after the restore
    assert row["weight_sync/restore/rolled_back_from"] > training.policy_version, row
    got = [row["weight_sync/restore/trainer_sum"], row["weight_sync/restore/trainer_sumsq"]]
    # float64 sums of the same float32 values in other orders; one training step moves them ~1e-4.
    assert_close_to_scale(got, list(want), rel=1e-9, scale=want[1], what="the restored trainer's weights fingerprint")
    for i in range(replicas):
        assert row[f"weight_sync/restore/policy{i}_version"] == training.policy_version, row
        assert row[f"weight_sync/restore/policy{i}_logprob_gap"] <= PROBE_GAP, row  # NaN (no token) fails too
    assert f"weight_sync/restore/policy{replicas}_version" not in row, row


@pytest.mark.parametrize("procs", [1, 2])
def test_killed_trainer_is_replaced_from_its_checkpoint_and_the_run_completes(tmp_path: Path, procs: int) -> None:
    """SIGKILL of the trainer's process (of one rank of two) after step 3, checkpoints every 2
    steps: a new mesh of the same shape loads the step-2 checkpoint, the trainer and every policy
    replica (two with one rank) then hold its weights, steps 3 onward are trained again and logged
    once, and the run completes every step with exit 0, every group accounted for. With two ranks
    (faults.trainer_max_restarts=2) a rank of the new mesh is killed too as soon as it is up, while
    it restores: that death counts, and a third mesh restores the checkpoint."""
    from slow_reward import OVERRIDES as SLOW_REWARD

    replicas, deaths = (2, 1) if procs == 1 else (1, 2)
    # Slow rewards keep step 4 from being trained and checkpointed before the kill lands (once
    # it was: the step-4 checkpoint was what the policy served, so no rollback could show).
    proc = _app(
        tmp_path,
        *SLOW_REWARD,
        "trainer.checkpoint_every=2",
        f"trainer.procs={procs}",
        f"policy.num_replicas={replicas}",
        f"faults.trainer_max_restarts={deaths}",
        f"trainer.keep_checkpoints={STEPS}",  # the restored one is still there at the end
    )
    _wait_for_step(proc, tmp_path, 3)
    _wait_for_checkpoint(proc, tmp_path)  # written in the background: it may still be on its way
    ranks = role_processes(proc.pid, "trainer")
    assert len(ranks) == procs
    ranks[-1].kill()
    if deaths == 2:
        _kill_new_trainer_process(proc, {rank.pid for rank in ranks})
    code, out, err = _finish(proc)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no step twice, none missing
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))  # rewound with the step
    assert rows[-1]["restarts/trainer"] == deaths and rows[0]["restarts/trainer"] == 0, rows[-1]
    # The newest complete checkpoint when it died: step 2's, or a later one if the run got that far first.
    restored = re.findall(r"replacing it from step_(\d+) \(restart (\d) of", err)
    assert [int(n) for _, n in restored] == list(range(1, deaths + 1)), err[-3000:]
    assert int(restored[-1][0]) in (2, 4, 6) and err.count("the trainer is back at step") == 1, err[-3000:]
    if deaths == 2:  # the second death came while the first replacement restored, not after it was back
        assert re.search(r"\(while restoring step_\d+\)\); replacing it from step_\d+ \(restart 2 of 2\)", err)
    _restored_weights_served(rows, tmp_path, int(restored[-1][0]), replicas)
    last = rows[-1]
    assert last["groups/lost"] == 0 and last["groups/unaccounted"] == 0 and last["groups/duplicates"] == 0, last
    # Steps 3 (and a step cut short by the kill, if any) took groups twice; none was lost.
    assert last["groups/trained"] >= STEPS * 4, last


def _kill_new_trainer_process(proc: subprocess.Popen, old: set[int], timeout: float = 120) -> None:
    """SIGKILL the first process of the trainer's replacement as soon as it is up (mid-restore)."""
    deadline = time.monotonic() + timeout
    while not (new := [p for p in role_processes(proc.pid, "trainer") if p.pid not in old]):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, out, err = _finish(proc, timeout=10)
            pytest.fail(f"no new trainer process\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
        time.sleep(0.05)
    new[0].kill()


@pytest.mark.slow  # ~45 s; the replacement itself is in the default suite (the SIGKILL tests above)
def test_hung_trainer_is_found_by_its_call_timeout_and_replaced(tmp_path: Path) -> None:
    """SIGSTOP of the trainer after step 3: its next call goes unanswered past
    faults.health_timeout_s, the run kills it, starts a new trainer from the step-2 checkpoint
    and completes every step, each logged once, exit 0."""
    proc = _app(tmp_path, "trainer.checkpoint_every=2", "faults.health_timeout_s=8", "faults.health_interval_s=1")
    _wait_for_step(proc, tmp_path, 3)
    _wait_for_checkpoint(proc, tmp_path)
    (victim,) = role_processes(proc.pid, "trainer")
    victim.send_signal(signal.SIGSTOP)
    try:
        code, out, err = _finish(proc)
    finally:
        with contextlib.suppress(Exception):
            victim.kill()
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["restarts/trainer"] == 1
    assert "RequestTimeout" in err and re.search(r"replacing it from step_0000000[24]", err), err[-3000:]


@pytest.mark.slow  # ~40 s
def test_trainer_death_stops_the_run_and_says_how_to_resume(tmp_path: Path) -> None:
    """SIGKILL of the trainer after a checkpoint, with no restart allowed: exit 1, and the
    message names the trainer's death and the checkpoint to continue from with --resume."""
    from forge.checkpoint import latest_checkpoint

    proc = _app(tmp_path, "steps=1000", "trainer.checkpoint_every=2", "faults.trainer_max_restarts=0")
    _kill_role_at_step(proc, tmp_path, 3, "trainer")
    code, out, err = _finish(proc, timeout=90)
    assert code == 1, f"exit code {code}\nstderr:\n{err[-3000:]}"
    newest = latest_checkpoint(tmp_path / "out" / "checkpoints")
    assert newest is not None
    assert "grpo: FAILED: role 'trainer' failed: death 1: ReplicaFailed: " in err, err[-3000:]
    assert f"continue from its newest checkpoint ({newest.name}) with the same command plus --resume" in err


# ----------------------------------------------------------------------------- weight sync
class SlowPolicy(ForgeActor):
    """A policy stand-in whose weight load takes ``load_s``: long enough to kill it midway."""

    def __init__(self, load_s: float, marks: str) -> None:
        self.load_s = load_s
        self.marks = Path(marks)
        self.served = 0

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def update_weights(self, weights: dict, version: int) -> int:
        (self.marks / f"loading-{os.getpid()}").touch()  # the test kills once both loads began
        await asyncio.sleep(self.load_s)
        self.served = version
        return version

    @endpoint
    async def version(self) -> int:
        return self.served


async def test_weight_sync_to_a_replica_that_dies_midway_neither_fails_nor_hangs(tmp_path: Path) -> None:
    """A policy replica SIGKILLed while it loads new weights: the push returns once the live
    replica has loaded them, and the restarted replica loads them (resync) before serving."""
    from apps.common.weights import PolicyWeights

    marks = tmp_path / "marks"
    marks.mkdir()
    # The restart waits 3 s (backoff): a push that waited for the dead replica would return after it.
    svc = await SlowPolicy.options(name="policy", num_replicas=2, restart_backoff_s=3.0, max_restarts=2).as_service(
        1.5, str(marks)
    )
    try:
        weights = PolicyWeights(None, svc, "message", str(tmp_path), resync_timeout_s=300.0)
        svc.set_resync(weights.resync)
        replicas = svc.service.replicas
        victim = await replicas[0].call("pid", (), {}, 30.0)
        push = asyncio.create_task(weights.push({"w": 1}, 7))
        loading = lambda: len(list(marks.iterdir()))  # noqa: E731
        await until(lambda: loading() >= 2 or push.done(), "both replicas to begin loading", timeout=60)
        assert loading() >= 2, "the push ended before it reached both replicas"
        os.kill(victim, signal.SIGKILL)
        assert await asyncio.wait_for(push, 60.0) == 7
        assert replicas[0].restarts == 0, "the push waited for the dead replica's restart"
        assert await replicas[1].call("version", (), {}, 30.0) == 7
        await until(lambda: replicas[0].accepting and replicas[0].restarts == 1, "replica 0 to come back", 120, 0.1)
        assert await replicas[0].call("version", (), {}, 30.0) == 7, "the restarted replica took traffic unsynced"
    finally:
        await svc.shutdown()


def test_a_trainer_that_loses_a_host_restarts_on_the_hosts_left(tmp_path: Path) -> None:
    """The trainer spans two hosts (worker processes on loopback, hosts.job=attach) with
    trainer.min_hosts=1. SIGKILL of the second host's worker and every process it started, after
    step 3: the host is found dead, the trainer restarts on the one host left from the newest
    checkpoint (resharded to one rank), the roles that lived there restart on the first host, and
    the run completes every step, each logged once, every group accounted for."""
    import psutil

    from forge.controller.hosts import start_local_worker
    from tests.unit.controller.test_hosts_spanning import free_port

    ports = [free_port(), free_port()]
    workers = [start_local_worker(port) for port in ports]
    try:
        addresses = ",".join(f"tcp://127.0.0.1:{port}" for port in ports)
        proc = start_app(
            tmp_path,
            "hosts.job=attach",
            f"hosts.addresses=[{addresses}]",
            "trainer.hosts=2",
            "trainer.min_hosts=1",
            "trainer.checkpoint_every=2",
            steps=5,
        )
        _wait_for_step(proc, tmp_path, 3)
        _wait_for_checkpoint(proc, tmp_path)
        lost = psutil.Process(workers[1].pid)
        for process in [*lost.children(recursive=True), lost]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        code, out, err = _finish(proc)
    finally:
        for worker in workers:
            with contextlib.suppress(Exception):
                for child in psutil.Process(worker.pid).children(recursive=True):
                    child.kill()
            worker.kill()
            worker.wait(10)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert f"host tcp://127.0.0.1:{ports[1]} is not answering" in err, err[-3000:]
    assert re.search(rf"\(hosts lost: tcp://127\.0\.0\.1:{ports[1]}\)\); replacing it from step_", err), err[-3000:]
    assert "the trainer restarts on 1 host(s) instead of 2 (trainer.min_hosts=1)" in err, err[-3000:]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 6))
    assert rows[-1]["restarts/trainer"] == 1
    last = rows[-1]
    assert last["groups/lost"] == 0 and last["groups/unaccounted"] == 0 and last["groups/duplicates"] == 0, last
