"""The two-node Slurm cluster the ``slurm`` tests run on (``scripts/slurm_cluster.sh``), and what
the tests ask it: the queue, a job's processes, a node's daemon.

The cluster is started by ``scripts/test.sh --slurm`` (or by hand), never by the tests: they
only check that it answers, and put a node they broke back before the next test.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
CLUSTER_DIR = Path(os.environ.get("FORGE_SLURM_DIR", "/tmp/forge-slurm"))


def slurm(*args: str, timeout: float = 30) -> str:
    """A Slurm command's output; a failed one fails the test with its error."""
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"`{' '.join(args)}` failed: {result.stderr.strip()}"
    return result.stdout


def idle_nodes() -> int:
    try:
        out = subprocess.run(["sinfo", "-h", "-p", "debug", "-t", "idle", "-o", "%D"], capture_output=True, text=True)
    except FileNotFoundError:
        return 0
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


def queued_jobs() -> list[str]:
    """The jobs squeue lists as pending, running or completing (ended jobs are not listed)."""
    return [line for line in slurm("squeue", "-h", "-o", "%i %T %r").splitlines() if line.strip()]


def job_processes(job_id: str) -> list[psutil.Process]:
    """Live processes of Slurm job ``job_id`` (its workers and their role processes)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SLURM_JOB_ID") == job_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def submitted_job(stderr: str) -> str:
    """The job id the app's log names ("Slurm job 12 submitted")."""
    match = re.search(r"Slurm job (\d+) submitted", stderr)
    assert match, f"the app never said which Slurm job it submitted:\n{stderr[-3000:]}"
    return match.group(1)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f}s"
        time.sleep(0.2)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[None]:
    """The cluster must be up with both nodes idle; the tests leave it that way."""
    if "SLURM_CONF" not in os.environ or idle_nodes() != 2:
        pytest.fail(
            "the slurm tests need the two-node test cluster: run them with `bash scripts/test.sh --slurm` "
            f"(or `bash {CLUSTER.relative_to(REPO)} start` and export SLURM_CONF={CLUSTER_DIR}/etc/slurm.conf)"
        )
    yield


def restore_node(node: str) -> None:
    """Put a node whose slurmd was killed back: restart its slurmd, and let slurmctld forget the
    job steps it never heard end there (DOWN then RESUME, as an admin would)."""
    result = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"the cluster did not come back: {result.stderr[-2000:]}"
    slurm("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=forge-test")
    slurm("scontrol", "update", f"NodeName={node}", "State=RESUME")


@pytest.fixture()
def clean_cluster(slurm_cluster: None) -> Iterator[None]:
    """After a test: nothing queued, and both nodes idle again."""
    yield
    for line in queued_jobs():
        slurm("scancel", line.split()[0])
    if idle_nodes() != 2:
        with contextlib.suppress(AssertionError):  # a job still completing: give it a moment
            wait_until(lambda: idle_nodes() == 2, 10, "both nodes were not idle again")
        if idle_nodes() != 2:
            for node in ("n1", "n2"):
                restore_node(node)
    wait_until(lambda: idle_nodes() == 2, 60, "both nodes were not idle again")
