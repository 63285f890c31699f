"""``hosts.job: slurm`` on a real two-node Slurm (``scripts/slurm_cluster.sh``): real slurmctld
and slurmd daemons, real Monarch workers started by the job, the GRPO app as a user runs it.

Run with ``bash scripts/test.sh --slurm`` (starts the cluster, installing Slurm when root).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from apps.common.roles import ROLE_ENV
from tests.integration.app_runs import finish_app, start_app
from tests.slurm.conftest import CLUSTER_DIR, job_processes, queued_jobs, restore_node, submitted_job, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("clean_cluster")]


def slurm_run(tmp_path: Path, *overrides: str, steps: int = 4, **options: object) -> subprocess.Popen:
    """The tiny GRPO app on the cluster's two nodes, the trainer spanning both."""
    opts = {"partition": "debug", "time_limit": "'00:30:00'", "job_start_timeout": 120, "python_exe": sys.executable}
    opts.update(options)
    text = ", ".join(f"{k}: {v}" for k, v in opts.items())
    return start_app(
        tmp_path,
        "weight_sync.transport=message",
        "hosts.job=slurm",
        "hosts.num_hosts=2",
        "trainer.hosts=2",
        f"hosts.options={{{text}}}",
        *overrides,
        steps=steps,
    )


def rows(tmp_path: Path) -> list[dict]:
    path = tmp_path / "out" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(proc: subprocess.Popen, tmp_path: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while len(rows(tmp_path)) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            code, out, err = finish_app(proc, 30)
            pytest.fail(f"the app (exit {code}) never got to step {step}\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
        time.sleep(0.2)


def roles_by_node(job_id: str) -> dict[str, set[str]]:
    """Role name -> the Slurm nodes its processes run on, now."""
    found: dict[str, set[str]] = {}
    for proc in job_processes(job_id):
        with contextlib.suppress(psutil.Error):
            env = proc.environ()
            if ROLE_ENV in env:
                found.setdefault(env[ROLE_ENV], set()).add(env.get("SLURMD_NODENAME", "?"))
    return found


def assert_job_gone(job_id: str) -> None:
    """The job is not queued any more and none of its processes lives on."""
    wait_until(lambda: not any(line.split()[0] == job_id for line in queued_jobs()), 30, f"job {job_id} still queued")
    wait_until(lambda: not job_processes(job_id), 30, f"processes of job {job_id} still alive")


def test_grpo_runs_every_step_on_two_nodes_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """The trainer spans n1 and n2; the run exits 0 with every step; the job's logs are under
    <output_dir>/jobs; afterwards no job is queued and no process of it is alive."""
    proc = slurm_run(tmp_path, steps=4)
    wait_for_step(proc, tmp_path, 1)
    placement = roles_by_node(submitted_job_from_log(tmp_path))
    code, out, err = finish_app(proc, 240)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4]
    assert placement.get("trainer") == {"n1", "n2"}, f"the trainer did not span both nodes: {placement}"
    job_id = submitted_job(err)
    logs = sorted(p.name for p in (tmp_path / "out" / "jobs").iterdir())
    assert f"slurm_{job_id}_n1.err" in logs and f"slurm_{job_id}_n2.err" in logs, logs
    assert "Traceback" not in err, err[-3000:]
    assert_job_gone(job_id)


def submitted_job_from_log(tmp_path: Path) -> str:
    """The job id, from the job's log files (the app's stderr is read only at its end)."""
    names = [p.name for p in (tmp_path / "out" / "jobs").glob("slurm_*.out")]
    assert names, f"no job logs under {tmp_path / 'out' / 'jobs'}"
    return names[0].split("_")[1].split(".")[0]


STEPS_PAST_A_LOSS = 40
"""Steps of the node-loss run: enough that training is still going when the loss is noticed."""


def test_a_node_lost_mid_run_is_a_lost_host(tmp_path: Path) -> None:
    """SIGKILL of n2's slurmd, its job steps and every process they started after step 2: n2 is
    reported dead by name, the rollout roles restart on n1, the trainer restarts there on one
    host (trainer.min_hosts=1) from its checkpoint, and the run completes every step."""
    proc = slurm_run(tmp_path, "trainer.min_hosts=1", "trainer.checkpoint_every=2", steps=STEPS_PAST_A_LOSS)
    wait_for_step(proc, tmp_path, 2)
    from forge.checkpoint import list_checkpoints

    wait_until(lambda: list_checkpoints(tmp_path / "out" / "checkpoints"), 60, "no checkpoint was written")
    job_id = submitted_job_from_log(tmp_path)
    on_n2 = [p for p in job_processes(job_id) if _node(p) == "n2"]
    assert on_n2, f"no process of job {job_id} on n2"
    steps = {p.parent() for p in on_n2 if p.parent() is not None and "slurmstepd" in p.parent().name()}
    slurmd = psutil.Process(int((CLUSTER_DIR / "run" / "slurmd-n2.pid").read_text()))
    for victim in [slurmd, *steps, *on_n2]:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    code, out, err = finish_app(proc, 300)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert "host n2 (tcp://127.0.0.1:" in err and "is not answering" in err, err[-3000:]
    assert "the trainer restarts on 1 host(s) instead of 2 (trainer.min_hosts=1)" in err, err[-3000:]
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, STEPS_PAST_A_LOSS + 1))
    # The app cancelled the job; Slurm completes it once n2 answers again.
    assert not any(line.split()[:2] == [job_id, "RUNNING"] for line in queued_jobs()), queued_jobs()
    restore_node("n2")
    assert_job_gone(job_id)


def _node(proc: psutil.Process) -> str | None:
    with contextlib.suppress(psutil.Error):
        return proc.environ().get("SLURMD_NODENAME")
    return None


def test_scancel_mid_run_stops_the_run_naming_the_job_and_its_state(tmp_path: Path) -> None:
    """scancel of the run's job after step 2: the run exits 1 with a message naming the job
    and CANCELLED, and nothing of the job is left."""
    proc = slurm_run(tmp_path, steps=60)
    wait_for_step(proc, tmp_path, 2)
    job_id = submitted_job_from_log(tmp_path)
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    code, out, err = finish_app(proc, 120)
    assert code == 1, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    last = err.strip().splitlines()[-1]
    assert f"Slurm job {job_id} is no longer running: it is CANCELLED" in last, err[-3000:]
    assert_job_gone(job_id)


@pytest.mark.parametrize(
    ("options", "reason"),
    # Right after submission slurmctld may give a partition limit as PartitionConfig, then PartitionNodeLimit.
    [({"slurm_args": "['--hold']"}, "JobHeldUser"), ({"partition": "one"}, "(PartitionNodeLimit|PartitionConfig)")],
    ids=["held", "partition-node-limit"],
)
def test_a_job_that_cannot_start_fails_naming_its_state_and_reason(tmp_path: Path, options: dict, reason: str) -> None:
    """Past job_start_timeout the run exits 1 naming the job, PENDING and squeue's reason, with
    no traceback, and the job is cancelled."""
    proc = slurm_run(tmp_path, job_start_timeout=4, **options)
    code, out, err = finish_app(proc, 120)
    assert code == 1, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    job_id = submitted_job(err)
    message = err.strip().splitlines()[-1]
    assert f"Slurm job {job_id} did not start within hosts.options.job_start_timeout=4s" in message, err[-3000:]
    assert re.search(rf"it is PENDING \(reason: {reason}\)", message), message
    assert "Traceback" not in err, err[-3000:]
    assert_job_gone(job_id)


def test_sigterm_while_queued_cancels_the_job(tmp_path: Path) -> None:
    """A run waiting for its (held) job takes SIGTERM: it exits 143 and the job is cancelled."""
    proc = slurm_run(tmp_path, slurm_args="['--hold']")
    wait_until(lambda: any("JobHeldUser" in line for line in queued_jobs()), 120, "the held job never queued")
    job_id = queued_jobs()[0].split()[0]
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish_app(proc, 60)
    assert code == 143, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert_job_gone(job_id)
