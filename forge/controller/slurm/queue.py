"""What Slurm says about one job, read by its id whichever ``squeue --json`` schema comes back.

Slurm's JSON changed shape between releases, and Monarch 0.7 reads only the newest one:

- 22.05 (OpenAPI v0.0.38; Debian 12, Ubuntu 22.04): ``squeue --json`` ignores ``--job`` and
  lists every job the controller remembers, other users' too; ``job_state`` is a string
  (``"RUNNING"``); ``nodes`` is a hostlist string; ``job_resources`` is absent while pending and
  lists ``allocated_nodes[].nodename`` once running.
- 23.11 and later (data_parser v0.0.40+, the schema Monarch 0.7 reads): ``--job`` filters;
  ``job_state`` is a list (``["RUNNING"]``, later entries being flags such as ``COMPLETING``);
  ``job_resources.nodes`` is an object whose ``allocation[].name`` are the nodes.

So a job is always picked out of the list by its ``job_id`` (never ``jobs[0]``), its state is
the first entry of either form, and its nodes come from the hostlist ``nodes`` string when it is
there, else from either allocation list. If the JSON cannot be had or read (``--json`` missing
in a site's build, an unknown schema), ``squeue -h -j <id> -o ...`` gives the same facts.
"""

from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import dataclass, field
from typing import Any

from forge.controller.slurm.hostlist import expand

logger = logging.getLogger("forge.slurm")

COMMAND_TIMEOUT_S = 30.0
"""Longest one ``squeue`` / ``scontrol`` call may take (a busy slurmctld answers in well under this)."""

TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)
"""Job states after which the job's workers are gone (``squeue``'s JOB STATE CODES)."""


class SlurmCommandError(RuntimeError):
    """A Slurm command failed or could not be run (not installed, slurmctld unreachable)."""


@dataclass(frozen=True)
class JobInfo:
    """One job as ``squeue`` reports it."""

    job_id: str
    state: str
    """The base state, e.g. ``PENDING``, ``RUNNING``, ``CANCELLED``."""
    reason: str = ""
    """Why it is pending or ended (``state_reason``, e.g. ``PartitionNodeLimit``); "" for none."""
    nodes: list[str] = field(default_factory=list)
    """The allocated nodes, in Slurm's order (``$SLURM_NODEID``); empty until it runs."""
    flags: tuple[str, ...] = ()
    """Further state flags of the newer schema (``COMPLETING``, ``CONFIGURING``, ...)."""

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL_STATES

    def describe(self) -> str:
        """``"PENDING (reason: JobHeldUser)"``: the state and, when there is one, the reason."""
        return self.state + (f" (reason: {self.reason})" if self.reason else "")

    def as_monarch(self) -> dict[str, Any]:
        """This job in the schema Monarch 0.7's ``SlurmJob`` reads (``job_state`` a list,
        ``job_resources.nodes.allocation[].name``), for the Monarch code that still reads it."""
        allocation = [{"name": n} for n in self.nodes]
        return {
            "job_id": self.job_id,
            "job_state": [self.state, *self.flags],
            "state_reason": self.reason,
            "job_resources": {"nodes": {"allocation": allocation}},
        }


# ----------------------------------------------------------------------------- the JSON
def job_from_json(data: dict[str, Any] | str, job_id: str | int) -> JobInfo | None:
    """Job ``job_id`` out of ``squeue --json`` output (either schema); None when it is not listed.

    Raises ``ValueError`` naming the job when the output is not ``squeue --json``'s.
    """
    if isinstance(data, str):
        data = json.loads(data)
    jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(jobs, list):
        raise ValueError(f"squeue --json output for job {job_id} has no 'jobs' list: {str(data)[:200]}")
    wanted = str(job_id)
    for job in jobs:
        if isinstance(job, dict) and _number(job.get("job_id")) == wanted:
            return _job_info(job, wanted)
    return None


def _job_info(job: dict[str, Any], job_id: str) -> JobInfo:
    states = job.get("job_state")
    states = [states] if isinstance(states, str) else list(states or [])
    if not states or not all(isinstance(s, str) for s in states):
        raise ValueError(f"squeue --json: job {job_id} has no readable job_state: {job.get('job_state')!r}")
    reason = job.get("state_reason") or ""
    reason = "" if reason == "None" else str(reason)
    return JobInfo(job_id, states[0], reason, _nodes(job), tuple(states[1:]))


def _nodes(job: dict[str, Any]) -> list[str]:
    """The job's nodes: the hostlist ``nodes`` string (both schemas), else an allocation list."""
    if isinstance(job.get("nodes"), str) and job["nodes"].strip():
        return expand(job["nodes"])
    resources = job.get("job_resources") or {}
    nodes = resources.get("nodes")
    if isinstance(nodes, dict):  # 23.11 and later
        if nodes.get("allocation"):
            return [str(n["name"]) for n in nodes["allocation"]]
        if isinstance(nodes.get("list"), str):
            return expand(nodes["list"])
    if isinstance(nodes, str) and nodes.strip():  # 22.05
        return expand(nodes)
    return [str(n["nodename"]) for n in resources.get("allocated_nodes") or []]


def _number(value: Any) -> str:
    """A job id as a string, whether plain or the newer ``{"set": true, "number": 12}`` form."""
    if isinstance(value, dict):
        value = value.get("number")
    return str(value)


# ----------------------------------------------------------------------------- the commands
def run_command(args: list[str], timeout_s: float = COMMAND_TIMEOUT_S, input_text: str | None = None) -> str:
    """``args``' standard output (``input_text`` on its standard input); ``SlurmCommandError``
    naming the command and its error otherwise."""
    try:
        result = subprocess.run(args, input=input_text, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise SlurmCommandError(f"{args[0]} is not installed on this machine (is this a Slurm login node?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(
            f"`{' '.join(args)}` did not answer within {timeout_s:.0f}s (is slurmctld up?)"
        ) from None
    if result.returncode != 0:
        raise SlurmCommandError(f"`{' '.join(args)}` failed (exit {result.returncode}): {result.stderr.strip()[:300]}")
    return result.stdout


_FIELDS = "%i|%T|%r|%N"


def query_job(job_id: str, timeout_s: float = COMMAND_TIMEOUT_S) -> JobInfo | None:
    """Job ``job_id`` as ``squeue`` sees it now; None once it left the queue.

    ``squeue --json`` first; if it fails or its output cannot be read, the plain format.
    """
    try:
        return job_from_json(run_command(["squeue", "--job", str(job_id), "--json"], timeout_s), job_id)
    except (SlurmCommandError, ValueError, KeyError, TypeError) as exc:
        logger.debug("squeue --json for job %s unusable (%s); reading the plain format", job_id, exc)
    try:
        out = run_command(["squeue", "-h", "-j", str(job_id), "-o", _FIELDS], timeout_s)
    except SlurmCommandError as exc:
        if "Invalid job id" in str(exc):  # squeue's answer for a job it no longer remembers
            return None
        raise
    return job_from_line(out, job_id)


def job_from_line(out: str, job_id: str | int) -> JobInfo | None:
    """Job ``job_id`` from ``squeue -h -o '%i|%T|%r|%N'`` lines; None when it is not listed."""
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0] == str(job_id):
            reason = "" if parts[2] in ("None", "") else parts[2]
            return JobInfo(str(job_id), parts[1], reason, expand(parts[3]) if parts[3] else [])
    return None


def node_addresses(nodes: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, str]:
    """Each node's ``NodeAddr`` (the address slurmctld reaches it at), by name.

    A node's name is not always its host name (``NodeName=n1 NodeAddr=10.0.0.7``); the address
    Slurm itself uses is the one a worker is reachable at. A node without one keeps its name.
    """
    if not nodes:
        return {}
    out = run_command(["scontrol", "-o", "show", "node", ",".join(nodes)], timeout_s)
    return {**{n: n for n in nodes}, **addresses_from_scontrol(out)}


def addresses_from_scontrol(out: str) -> dict[str, str]:
    """``NodeName`` -> ``NodeAddr`` from ``scontrol -o show node`` lines (one node a line)."""
    found: dict[str, str] = {}
    for line in out.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        if "NodeName" in fields:
            found[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return found
