"""Hosts beyond this one: Monarch hosts that replicas can be placed on.

A ``HostPool`` is one Monarch host mesh. It comes from running workers::

    # on each machine, on its private interface (see forge.controller.worker for the trust model)
    python -m forge.controller.worker --address tcp://10.0.0.7:29501

    pool = HostPool.attach(["tcp://10.0.0.7:29501", "tcp://10.0.0.8:29501"])

or from a Monarch job (``monarch.job``'s Kubernetes job, ``ProcessJob``, ``LocalJob``, or for
Slurm forge's adapter of its ``SlurmJob``: ``forge.controller.jobs.open_host_pool``), which
starts the workers itself::

    pool = HostPool.from_job(ProcessJob({"hosts": 2}))

Then ``options(host_pool=pool)`` places each replica on a host of the pool, in turn, and
``options(hosts=H, host_pool=pool)`` places ONE replica's processes on H hosts: a slice of H
neighbouring live hosts of the host mesh. The replica's proc mesh is flattened to one ``procs``
dimension of ``H x procs`` ranks (host 0's ranks first), so to the actor it is an ordinary proc
mesh and SPMD code (torch.distributed) sees ``world_size = H x procs``.

A host whose worker stops answering is marked dead, and no replica goes there any more: a
replica that lived on it is restarted on live hosts, and a replica that needs more live hosts
than are left fails with ``NotEnoughHosts``, naming the dead ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from monarch.actor import attach_to_workers

import forge.controller._env  # noqa: F401  (the package imports it before monarch)

logger = logging.getLogger("forge.hosts")

JOB_POLL_S = 5.0
"""How often ``watch_job`` asks the scheduler whether the pool's job still runs."""
JOB_CHECK_TIMEOUT_S = 60.0
"""Longest one such question may take (``squeue`` has its own, shorter timeout)."""

PROBE_TIMEOUT_S = 2.0
"""How long a worker's port may take to accept a connection before the host counts as dead."""


class NotEnoughHosts(ValueError):
    """A replica needs more (live) hosts than its pool has."""


class HostPool:
    """A Monarch host mesh whose hosts are handed out to replica starts, one slice each."""

    def __init__(self, host_mesh: Any, addresses: Sequence[str] | None = None, job: Any = None) -> None:
        """``host_mesh``: a Monarch ``HostMesh`` (one ``hosts`` dimension, or none for one host).
        ``addresses``: each host's worker address, used to name hosts in messages and to probe
        them; None when unknown (a job's hosts). ``job``: the Monarch job that owns the hosts."""
        self.host_mesh = host_mesh
        labels = list(host_mesh.extent.labels)
        if labels not in ([], ["hosts"]):
            raise ValueError(f"a HostPool needs a host mesh with one 'hosts' dimension, got {host_mesh.extent}")
        self._sliceable = bool(labels)
        self.size = dict(zip(labels, host_mesh.extent.sizes)).get("hosts", 1)
        if addresses is not None and len(addresses) != self.size:
            raise ValueError(f"{len(addresses)} addresses for a host mesh of {self.size} hosts: {list(addresses)}")
        self.addresses = list(addresses) if addresses is not None else None
        self.job = job
        self.node_names: list[str] | None = None
        """Each host's name in its job (a Slurm node's), used in messages; None: the addresses."""
        self.dead: set[int] = set()
        self._next = 0

    # ----------------------------------------------------------- making pools
    @classmethod
    def attach(cls, addresses: Sequence[str]) -> HostPool:
        """Connect to running workers (``tcp://host:port`` each). Connection is lazy."""
        if isinstance(addresses, str) or not addresses or not all(isinstance(a, str) and "://" in a for a in addresses):
            raise ValueError(f"HostPool.attach needs worker addresses like 'tcp://host:port', got {addresses!r}")
        mesh = attach_to_workers(ca="trust_all_connections", workers=list(addresses), name="forge_hosts")
        return cls(mesh, addresses)

    @classmethod
    def from_job(cls, job: Any, mesh: str = "hosts") -> HostPool:
        """The host mesh ``mesh`` of a Monarch job (``monarch.job``), started if it is not yet.

        ``job.state()`` applies the job (Slurm: ``sbatch``; ProcessJob: local worker processes)
        and attaches to its workers. The pool owns the job: ``close()`` kills it.
        """
        if not hasattr(job, "state"):
            raise TypeError(f"HostPool.from_job needs a monarch.job job (SlurmJob, ProcessJob, ...), got {job!r}")
        state = job.state(cached_path=None)  # no state file: this controller owns the job
        try:
            host_mesh = getattr(state, mesh)
        except AttributeError as exc:
            raise ValueError(f"the job has no host mesh named {mesh!r}: {exc}") from None
        return cls(host_mesh, job=job)

    def close(self) -> None:
        """Kill the job that started the pool's hosts, if any (attached workers keep running)."""
        job, self.job = self.job, None
        if job is not None:
            job.kill()

    def job_error(self) -> Exception | None:
        """Why the pool's job no longer runs (e.g. a Slurm job cancelled or past its time
        limit), or None while it runs, for jobs that can tell (forge's Slurm job)."""
        check = getattr(self.job, "job_error", None)
        return check() if check is not None else None

    async def watch_job(self, interval_s: float = JOB_POLL_S) -> None:
        """Return never while the pool's job runs; raise ``job_error()`` once it stops (a run
        awaits this beside its work, so a cancelled job ends the run with the job's state)."""
        while True:
            await asyncio.sleep(interval_s)
            error = await asyncio.wait_for(asyncio.to_thread(self.job_error), JOB_CHECK_TIMEOUT_S)
            if error is not None:
                raise error

    # ----------------------------------------------------------- placement
    def alive(self) -> list[int]:
        return [i for i in range(self.size) if i not in self.dead]

    def pick_hosts(self, count: int, avoid: Sequence[int] = (), who: str = "a replica") -> list[int]:
        """``count`` neighbouring live hosts, in turn, preferring a slice without ``avoid``'s hosts.

        Hosts whose worker no longer accepts connections are marked dead first. Raises
        ``NotEnoughHosts`` when the pool is smaller than ``count`` or too few hosts are alive.
        """
        self.check_count(count, who)
        self.mark_unreachable()
        windows = [list(range(s, s + count)) for s in range(self.size - count + 1)]
        windows = [w for w in windows if not self.dead.intersection(w)]
        if not windows:
            raise NotEnoughHosts(
                f"{who} needs {count} neighbouring live host(s), but only {len(self.alive())} of the pool's "
                f"{self.size} hosts are alive; dead: {[self.describe(i) for i in sorted(self.dead)]}"
            )
        choices = [w for w in windows if not set(avoid).intersection(w)] or windows
        window = choices[self._next % len(choices)]
        self._next += 1
        return window

    def check_count(self, count: int, who: str = "a replica") -> None:
        """``NotEnoughHosts`` when ``count`` hosts are more than the pool has."""
        if count > self.size:
            raise NotEnoughHosts(
                f"{who} asks for hosts={count}, but the host pool has only {self.size} host(s) ({self.names()})"
            )

    def hosts(self, indices: Sequence[int]) -> Any:
        """The host mesh over ``indices`` (neighbours, as ``pick_hosts`` returns them)."""
        indices = list(indices)
        if not indices or indices != list(range(indices[0], indices[0] + len(indices))):
            raise ValueError(f"host indices must be neighbours, got {indices}")
        if not self._sliceable:
            return self.host_mesh
        return self.host_mesh.slice(hosts=slice(indices[0], indices[-1] + 1))

    def host(self, index: int) -> Any:
        return self.hosts([index])

    # ----------------------------------------------------------- liveness
    def probe(self, index: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
        """Whether host ``index``'s worker accepts a connection; None when it cannot be told
        (no known address, or a transport other than tcp/ipc)."""
        if self.addresses is None:
            return None
        return probe_address(self.addresses[index], timeout_s)

    def mark_unreachable(self) -> None:
        """Probe every live host and mark the ones whose worker refuses or ignores a connection
        dead. A blocking connect, but short: a refused port answers at once, and a silent host
        costs PROBE_TIMEOUT_S once (it is dead from then on, and never probed again)."""
        for index in self.alive():
            if self.probe(index) is False:
                self.mark_dead(index)

    def mark_dead(self, index: int) -> None:
        if index not in self.dead:
            logger.warning("host %s is not answering; no more replicas go there", self.describe(index))
            self.dead.add(index)

    def blame(self, indices: Sequence[int]) -> str:
        """After a replica on ``indices`` went silent: mark its unreachable hosts dead, and say
        which they are (all of them when none can be probed)."""
        answers = {i: self.probe(i) for i in indices}
        gone = [i for i, ok in answers.items() if ok is False]
        if not gone and all(ok is None for ok in answers.values()):
            gone = list(indices)  # cannot probe: the replica's hosts are the suspects
        for i in gone:
            self.mark_dead(i)
        return f"host {', '.join(self.describe(i) for i in gone)} stopped answering" if gone else ""

    def describe(self, index: int) -> str:
        if self.node_names is not None:
            return f"{self.node_names[index]} ({self.addresses[index]})" if self.addresses else self.node_names[index]
        return self.addresses[index] if self.addresses is not None else f"#{index}"

    def names(self) -> list[str]:
        return [self.describe(i) for i in range(self.size)]

    def __repr__(self) -> str:
        return f"HostPool({self.names()}, dead={sorted(self.dead)})"


def probe_address(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether a worker address (``tcp://h:p``, ``ipc:///path``, optionally ``id@`` first)
    accepts a connection; None for a transport this cannot probe."""
    address = address.rsplit("@", 1)[-1]  # Monarch's "service-proc-id@channel" form
    parts = urlsplit(address)
    try:
        if parts.scheme in ("tcp", "metatls"):
            with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
                return True
        if parts.scheme in ("ipc", "unix") and parts.path:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                s.connect(parts.path)
                return True
    except OSError:
        return False
    return None


def start_local_worker(port: int, *, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> subprocess.Popen:
    """Start a worker process on loopback and wait until it listens (tests, demos)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "forge.controller.worker", "--address", f"tcp://127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"worker on port {port} exited with code {proc.returncode} before listening")
        if probe_address(f"tcp://127.0.0.1:{port}", 0.5):
            return proc
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"worker on port {port} did not listen within {timeout_s}s")
        time.sleep(0.1)
