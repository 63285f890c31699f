"""forge's adapter of Monarch's ``SlurmJob``: the job found by its id, its workers where Slurm
says its nodes are, its logs where the run keeps its files, and every failure a clear error.

Monarch 0.7's ``SlurmJob`` (``monarch.job``) submits an ``sbatch`` script that starts one
Monarch worker per node, then polls ``squeue --json`` until the job runs and attaches to the
workers. On a real Slurm it breaks in ways a user cannot work around:

- it takes ``jobs[0]`` of ``squeue --json``, which on Slurm 22.05 is whichever job the controller
  lists first (an earlier job of yours, or another user's), and it reads only the newest JSON
  schema (``queue.py`` reads both, by the job's id);
- it dials each worker at the node's *name* on one fixed port, so nodes whose name is not their
  host name (``NodeName=n1 NodeAddr=10.0.0.7``), or several nodes on one machine, are unreachable;
- one node that fails makes Slurm end the whole job, although forge handles a lost host;
- its logs go into the current folder, and its errors are raw tracebacks of its own code.

``ForgeSlurmJob`` keeps Monarch's submission options, service identities, attach and ``kill``,
and replaces the parts above: its batch script starts one ``srun`` step per node (``--no-kill``:
a node lost is a host lost, not the end of the job), each worker on the node's ``NodeAddr``
(``bind_to`` still overrides where it listens) and on ``monarch_port``, plus one for each node of
the job before it on the same machine. ``start_slurm_pool`` submits, waits for the job to run
without blocking the event loop, and cancels the job on any failure or cancellation (Ctrl-C,
SIGTERM) before it raises ``SlurmJobError``.

Out of the way when Monarch is fixed: the adapter is used with the Monarch versions in
``ADAPTED_MONARCH`` (the ones whose ``SlurmJob`` was read for it); with any other version,
``make_slurm_job`` returns Monarch's own ``SlurmJob`` and forge only adds the log folder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from monarch._rust_bindings.monarch_hyperactor.config import configure
from monarch.actor import attach_to_workers
from monarch.config import get_global_config
from monarch.job import JobState, SlurmJob, serialize_service_proc_ids, service_proc_addrs

from forge.controller.errors import ForgeError
from forge.controller.hosts import probe_address
from forge.controller.slurm.queue import (
    COMMAND_TIMEOUT_S,
    JobInfo,
    SlurmCommandError,
    node_addresses,
    query_job,
    run_command,
)
from forge.controller.slurm.worker import NODE_INDEX_ENV

logger = logging.getLogger("forge.slurm")
# Monarch's job code prints its progress ("Job is running...", "Cancelled SLURM job") to stderr
# with handlers of its own; forge reports the job itself, so only its warnings get through.
for _name in ("monarch._src.job.job", "monarch._src.job.slurm"):
    logging.getLogger(_name).setLevel(logging.WARNING)

ADAPTED_MONARCH = ("0.7.",)
"""torchmonarch versions (prefixes) whose ``SlurmJob`` this adapter corrects."""

POLL_S = 1.0
"""How often ``squeue`` is asked while the job waits to start."""

WORKER_START_TIMEOUT_S = 180.0
"""How long a running job's workers may take to listen (Python and Monarch start on each node)."""

UNSUPPORTED = ("out_of_cluster", "attach_to")
"""``SlurmJob`` options the adapter does not implement (a controller outside the cluster)."""


class SlurmJobError(ForgeError):
    """The Slurm job did not start, or stopped: names the job, its state and what to check."""

    def __init__(self, message: str, job_id: str | None = None, state: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.state = state


def adapter_needed(version: str | None = None) -> bool:
    """Whether the installed (or the given) torchmonarch's ``SlurmJob`` needs forge's adapter."""
    if version is None:
        try:
            version = metadata.version("torchmonarch")
        except metadata.PackageNotFoundError:
            return True
    return version.startswith(ADAPTED_MONARCH)


def make_slurm_job(num_hosts: int, mesh: str, log_dir: str | Path, options: dict[str, Any]) -> SlurmJob:
    """The Slurm job of ``num_hosts`` nodes for host mesh ``mesh``, its logs under ``log_dir``
    (``options.log_dir`` wins); ``options`` are ``SlurmJob``'s keyword arguments."""
    opts = dict(options)
    opts["log_dir"] = str(Path(opts.get("log_dir") or log_dir).resolve())
    cls = ForgeSlurmJob if adapter_needed() else SlurmJob
    try:
        return cls({mesh: num_hosts}, **opts)
    except TypeError as exc:  # an option SlurmJob does not take
        raise ValueError(f"hosts.options: {exc} (the options are monarch.job.SlurmJob's keyword arguments)") from None


def worker_ports(addresses: list[str], base: int) -> list[int]:
    """Each node's worker port: ``base``, plus one for each earlier node on the same address
    (several Slurm nodes on one machine cannot all listen on one port)."""
    seen: Counter[str] = Counter()
    ports = []
    for address in addresses:
        ports.append(base + seen[address])
        seen[address] += 1
    return ports


# The batch script's per-node loop computes the same ports as worker_ports: one rule, written
# twice, because the script learns the nodes on the job's first node and the controller from
# squeue and scontrol, each on its own.
_NODE_LOOP = """\
declare -A seen
index=0
for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
    addr=$(scontrol -o show node "$node" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
    addr=${{addr:-$node}}
    port=$(({port} + ${{seen[$addr]:-0}}))
    seen[$addr]=$((${{seen[$addr]:-0}} + 1))
    listen="tcp://$addr:$port"{bind}
    {env}={index_ref} srun --nodes=1 --ntasks=1 --nodelist="$node" --no-kill --kill-on-bad-exit=0 \\
        --output={log}/slurm_%j_"$node".out --error={log}/slurm_%j_"$node".err \\
        {python} -m forge.controller.slurm.worker "$listen" &
    index=$((index + 1))
done
wait
"""


class ForgeSlurmJob(SlurmJob):
    """Monarch's ``SlurmJob`` as forge runs it on Slurm 22.05 and later (see the module)."""

    def __init__(self, meshes: dict[str, int], **options: Any) -> None:
        for name in UNSUPPORTED:
            if options.get(name):
                raise ValueError(
                    f"hosts.options.{name} is not supported by forge's Slurm job; run the controller "
                    "on a node of the cluster (a login node) instead"
                )
        if not options.get("log_dir"):
            raise ValueError("a Slurm job needs log_dir, the folder for its logs (forge passes <output_dir>/jobs)")
        previous = get_global_config()["default_transport"]
        super().__init__(meshes, **options)
        # SlurmJob's constructor switches this whole process to TCP at the host name; forge picks
        # the controller's address when it attaches (_state), and until then nothing changes.
        configure(default_transport=previous)
        self.nodes: list[str] = []
        """The job's nodes, in Slurm's order, once it runs."""
        self.workers: list[str] = []
        """Each node's worker address (``tcp://NodeAddr:port``), in the same order."""

    # --------------------------------------------------------------- submit
    def batch_script(self, num_nodes: int) -> str:
        """The ``sbatch`` script: Monarch's directives, then one worker ``srun`` step per node."""
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={self._job_name}_{os.getpid()}",
            f"#SBATCH --nodes={num_nodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --output={self._log_dir}/slurm_%j.out",
            f"#SBATCH --error={self._log_dir}/slurm_%j.err",
            "#SBATCH --no-kill",  # a failed node is a lost host for forge, not the end of the job
        ]
        for flag, value in [
            ("time", self._time_limit),
            ("gpus-per-node", self._gpus_per_node),
            ("cpus-per-task", self._cpus_per_task),
            ("mem", self._mem),
            ("partition", self._partition),
            ("account", self._account),
            ("qos", self._qos),
        ]:
            if value is not None:
                lines.append(f"#SBATCH --{flag}={value}")
        if self._exclusive:
            lines.append("#SBATCH --exclusive")
        lines += [f"#SBATCH {arg}" for arg in self._slurm_args if arg.startswith("-")]
        lines.append(
            f"export MONARCH_SERVICE_PROC_IDS={shlex.quote(serialize_service_proc_ids(self._service_proc_ids))}"
        )
        bind = f'"@tcp://{self._bind_to}:$port"' if self._bind_to else ""
        loop = _NODE_LOOP.format(
            port=self._port,
            bind=bind,
            env=NODE_INDEX_ENV,
            index_ref="$index",
            log=shlex.quote(self._log_dir),
            python=shlex.quote(self._python_exe),
        )
        return "\n".join(lines) + "\n" + loop

    def _submit_slurm_job(self, num_nodes: int, client_script: str | None = None) -> str:
        if client_script is not None:
            raise ValueError("forge's Slurm job runs workers only; the controller attaches from outside the job")
        self._ensure_service_proc_ids(num_nodes)
        os.makedirs(self._log_dir, exist_ok=True)
        try:
            out = run_command(["sbatch", "--parsable"], input_text=self.batch_script(num_nodes))
        except SlurmCommandError as exc:
            raise SlurmJobError(
                f"Slurm refused the job: {exc}; check hosts.options (partition {self._partition!r}, "
                f"time_limit {self._time_limit!r}, account, qos) against `sinfo` and your site's limits"
            ) from None
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmJobError(f"Slurm: sbatch --parsable printed {out.strip()!r}, not a job id")
        logger.warning(
            "Slurm job %s submitted (%d nodes); its logs: %s/slurm_%s*", job_id, num_nodes, self._log_dir, job_id
        )
        return job_id

    # --------------------------------------------------------------- the queue
    def info(self) -> JobInfo | None:
        """The job as ``squeue`` sees it now (by its id); None when not submitted or gone."""
        job_id = self._slurm_job_id
        return None if job_id is None else query_job(job_id)

    def _get_job_info_json(self, job_id: str) -> dict[str, Any] | None:
        # Monarch's own checks (_jobs_active, can_run) read this: give them the job itself.
        try:
            info = query_job(job_id)
        except SlurmCommandError as exc:
            logger.warning("could not read Slurm job %s: %s", job_id, exc)
            return None
        return None if info is None else info.as_monarch()

    def check_started(self, info: JobInfo | None, expected_nodes: int) -> bool:
        """True once ``info`` shows the job running on ``expected_nodes`` nodes (and records
        them); False while it waits; ``SlurmJobError`` when it ended or left the queue."""
        job_id = self._slurm_job_id
        if info is None:
            raise SlurmJobError(
                f"Slurm job {job_id} left the queue before it ran; check `sacct -j {job_id}` and its logs "
                f"({self._log_dir}/slurm_{job_id}.err)",
                job_id,
                "GONE",
            )
        if info.ended:
            raise SlurmJobError(
                f"Slurm job {job_id} ended before its workers started: {info.describe()}; check its logs "
                f"({self._log_dir}/slurm_{job_id}.err) and `sacct -j {job_id}`",
                job_id,
                info.state,
            )
        if not info.running:
            return False
        if len(info.nodes) != expected_nodes:
            raise SlurmJobError(
                f"Slurm job {job_id} runs on {len(info.nodes)} node(s) {info.nodes}, not the {expected_nodes} "
                "asked for",
                job_id,
                info.state,
            )
        self.use_nodes(info.nodes)
        return True

    def use_nodes(self, nodes: list[str]) -> None:
        """Record the job's nodes and each one's worker address (``NodeAddr`` and port)."""
        addresses = node_addresses(nodes)
        hosts = [addresses[n] for n in nodes]
        self.nodes = list(nodes)
        self.workers = [f"tcp://{h}:{p}" for h, p in zip(hosts, worker_ports(hosts, self._port))]
        self._all_hostnames = list(nodes)
        logger.warning(
            "Slurm job %s runs on %s", self._slurm_job_id, ", ".join(f"{n} ({w})" for n, w in zip(nodes, self.workers))
        )

    def timed_out(self, info: JobInfo | None, waited_s: float) -> SlurmJobError:
        job_id = self._slurm_job_id
        state = info.describe() if info is not None else "gone from the queue"
        return SlurmJobError(
            f"Slurm job {job_id} did not start within hosts.options.job_start_timeout={self._job_start_timeout}s "
            f"(waited {waited_s:.0f}s): it is {state}; check `squeue -j {job_id}` and `scontrol show job {job_id}` "
            "(partition limits, a held job, busy nodes), or raise job_start_timeout. The job was cancelled",
            job_id,
            info.state if info is not None else "GONE",
        )

    def _wait_for_job_start(self, job_id: str, expected_nodes: int, timeout: int | None = None) -> list[str]:
        # Monarch's _state calls this when the job's nodes are not known yet (a direct state()).
        start, info = time.monotonic(), None
        while not self.check_started(info := query_job(job_id), expected_nodes):
            if timeout is not None and time.monotonic() - start > timeout:
                raise self.timed_out(info, time.monotonic() - start)
            time.sleep(POLL_S)
        return list(self.nodes)

    def job_error(self) -> SlurmJobError | None:
        """Why the started job no longer runs (cancelled, timed out, ended), or None while it
        runs or when it cannot be told (squeue not answering)."""
        job_id = self._slurm_job_id
        if job_id is None:
            return None
        try:
            info = query_job(job_id)
        except SlurmCommandError:
            return None
        if info is not None and info.running:
            return None
        state = "gone from the queue" if info is None else info.describe()
        return SlurmJobError(
            f"Slurm job {job_id} is no longer running: it is {state}; the run stopped. Check `sacct -j {job_id}` "
            f"and the job's logs ({self._log_dir}/slurm_{job_id}*)",
            job_id,
            "GONE" if info is None else info.state,
        )

    def _kill(self) -> None:
        # Monarch's waits on scancel without a limit; a slurmctld that does not answer must not hang the run's end.
        job_id = self._slurm_job_id
        if job_id is not None:
            try:
                run_command(["scancel", job_id])
                logger.info("Slurm job %s cancelled", job_id)
            except SlurmCommandError as exc:
                logger.warning("could not cancel Slurm job %s (%s); run `scancel %s`", job_id, exc, job_id)
        self._slurm_job_id = None
        self._all_hostnames.clear()

    # --------------------------------------------------------------- attach
    def silent_workers(self) -> list[str]:
        """The nodes (``"n2 (tcp://...)"``) whose worker does not accept a connection yet."""
        return [f"{n} ({w})" for n, w in zip(self.nodes, self.workers) if probe_address(w, 1.0) is False]

    def workers_timed_out(self, silent: list[str], timeout_s: float) -> SlurmJobError:
        job_id = self._slurm_job_id
        return SlurmJobError(
            f"Slurm job {job_id} is RUNNING but the worker on {', '.join(silent)} did not listen within "
            f"{timeout_s:.0f}s; check its log ({self._log_dir}/slurm_{job_id}_<node>.err): python_exe must be "
            "a Python with forge and Monarch on every node (a venv on a shared filesystem). The job was cancelled",
            job_id,
            "RUNNING",
        )

    def _state(self) -> JobState:
        if not self.workers:  # a direct job.state(): wait here (start_slurm_job waited already)
            job_id = self._slurm_job_id
            if job_id is None:
                raise SlurmJobError("the Slurm job was never submitted (apply() first)")
            self._wait_for_job_start(job_id, sum(self._meshes.values()), self._job_start_timeout)
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while silent := self.silent_workers():
            if time.monotonic() > deadline:
                raise self.workers_timed_out(silent, WORKER_START_TIMEOUT_S)
            time.sleep(POLL_S)
        # Monarch's SlurmJob makes the controller listen at its host name, which may resolve to
        # loopback only (then Monarch panics); listen where this machine reaches the nodes instead.
        configure(default_transport=f"tcp://{controller_ip(self.workers[0])}:0")
        meshes, start = {}, 0
        for name, count in self._meshes.items():
            workers = self.workers[start : start + count]
            ids = self._service_proc_ids[start : start + count]
            meshes[name] = attach_to_workers(
                name=name, ca="trust_all_connections", workers=service_proc_addrs(workers, ids)
            )
            start += count
        return JobState(meshes)


def controller_ip(worker: str) -> str:
    """This machine's address on the route to ``worker`` (``tcp://host:port``): the interface
    the workers can reach the controller on. No packet is sent (a UDP socket's connect only
    picks the route)."""
    parts = urlsplit(worker.rsplit("@", 1)[-1])
    family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((parts.hostname, parts.port or 1))
        ip = s.getsockname()[0]
    return f"[{ip}]" if family == socket.AF_INET6 else ip


# ----------------------------------------------------------------------------- starting a pool
async def wait_until_running(job: ForgeSlurmJob, clock: Callable[[], float] = time.monotonic) -> None:
    """Poll ``squeue`` (off the event loop) until ``job`` runs; ``SlurmJobError`` when it ends,
    leaves the queue, or ``job_start_timeout`` passes first."""
    start, expected = clock(), sum(job._meshes.values())
    timeout = job._job_start_timeout
    while True:
        info = await asyncio.wait_for(asyncio.to_thread(job.info), COMMAND_TIMEOUT_S + 5)
        if await asyncio.to_thread(job.check_started, info, expected):
            return
        if timeout is not None and clock() - start > timeout:
            raise job.timed_out(info, clock() - start)
        await asyncio.sleep(POLL_S)


async def wait_for_workers(job: ForgeSlurmJob, timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
    """Until every node's worker accepts connections (a job runs seconds before its workers
    have imported Monarch and listen); ``SlurmJobError`` naming the silent nodes and their logs
    when ``timeout_s`` passes or the job stops first."""
    deadline = time.monotonic() + timeout_s
    while True:
        silent = await asyncio.to_thread(job.silent_workers)
        if not silent:
            return
        error = await asyncio.to_thread(job.job_error)
        if error is not None:
            raise error
        if time.monotonic() > deadline:
            raise job.workers_timed_out(silent, timeout_s)
        await asyncio.sleep(POLL_S)


async def start_slurm_job(job: SlurmJob, mesh: str) -> Any:
    """Submit ``job``, wait until it runs, attach to its workers; returns its host mesh ``mesh``.

    Any failure, and a cancellation (Ctrl-C, SIGTERM) while it is queued, cancels the job first.
    Errors are ``SlurmJobError``s that name the job, its state and what to check.
    """
    try:
        job.apply()  # sbatch, on the loop: a cancellation cannot land between submit and the job id
        if isinstance(job, ForgeSlurmJob):
            await wait_until_running(job)
            await wait_for_workers(job)
        state = job.state(cached_path=None)
        return getattr(state, mesh)
    except BaseException as exc:
        job_id = getattr(job, "_slurm_job_id", None)
        _cancel(job)
        if isinstance(exc, (SlurmJobError, KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
            raise  # a cancelled start is not a failure to report; the job is cancelled all the same
        if isinstance(exc, SlurmCommandError):
            raise SlurmJobError(f"Slurm job {job_id}: {exc}; the job was cancelled", job_id) from None
        raise SlurmJobError(
            f"Slurm job {job_id} started but forge could not attach to its workers ({type(exc).__name__}: "
            f"{str(exc)[:300]}); check the workers' logs (slurm_{job_id}_<node>.err under hosts.options.log_dir) "
            "and that this machine reaches the nodes' NodeAddr on monarch_port. The job was cancelled",
            job_id,
        ) from exc


def _cancel(job: Any) -> None:
    """``scancel`` the job if it was submitted; never raises (the caller is failing already)."""
    if getattr(job, "_slurm_job_id", None) is None:
        return
    try:
        job.kill()
    except Exception as exc:  # the caller's error matters more; say what is left over
        print(f"forge: could not cancel Slurm job {job._slurm_job_id}: {exc}; run scancel", file=sys.stderr)


__all__ = [
    "ADAPTED_MONARCH",
    "ForgeSlurmJob",
    "SlurmJobError",
    "adapter_needed",
    "make_slurm_job",
    "start_slurm_job",
    "worker_ports",
]
