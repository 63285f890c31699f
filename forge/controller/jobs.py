"""Cluster launch through Monarch's job API: one config section -> a ``HostPool``.

Monarch's jobs (``monarch.job``) allocate machines and start a Monarch worker on each: a Slurm
allocation (``SlurmJob``, via ``sbatch``), Kubernetes pods (``KubernetesJob``), worker
processes on this machine (``ProcessJob``, for tests and demos) or this host itself
(``LocalJob``). forge does not launch anything itself; it names the job and its size::

    hosts:
      job: slurm
      num_hosts: 2
      options: {partition: gpu, gpus_per_node: 8, time_limit: "04:00:00", account: my-account}

and ``open_host_pool(cfg, log_dir)`` applies the job and returns the pool that replicas are placed
on (``options(host_pool=pool, hosts=H)``). The pool owns the job: ``pool.close()`` kills it.
Slurm goes through forge's adapter of Monarch's ``SlurmJob`` (``forge.controller.slurm.job``):
its logs go under ``log_dir`` (the apps pass ``<logging.output_dir>/jobs``), it waits for the
job without blocking the event loop, and any failure cancels the job with a clear error.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge.checks import check_int
from forge.controller.hosts import HostPool

JOB_KINDS = ("none", "attach", "local", "process", "slurm", "kubernetes")

JOB_LOGS = "jobs"
"""The apps' folder for a job's logs, under ``logging.output_dir``."""

MESH = "hosts"
"""Name of the job's one host mesh (Monarch jobs name their meshes)."""


@dataclass(kw_only=True)
class HostsConfig:
    """Where a run's hosts come from, besides the controller's own machine."""

    job: str = "none"
    """``none``: this host only. ``attach``: running ``python -m forge.controller.worker``
    processes at ``addresses``. ``local``, ``process``, ``slurm``, ``kubernetes``: Monarch's
    ``LocalJob``, ``ProcessJob`` (``num_hosts`` worker processes on this machine),
    ``SlurmJob`` (``num_hosts`` nodes) or ``KubernetesJob`` (``num_hosts`` pods)."""
    num_hosts: int = 1
    """Hosts the job allocates (``process``, ``slurm``, ``kubernetes``)."""
    addresses: list[str] = field(default_factory=list)
    """Worker addresses for ``attach``, e.g. ``["tcp://10.0.0.7:29501", "tcp://10.0.0.8:29501"]``."""
    gpus_per_host: int | None = None
    """GPUs of each host, split between the roles; None: ``options.gpus_per_node`` (Slurm),
    else the GPUs the controller sees (which may be none, e.g. on a login node)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the job: ``SlurmJob``'s (``partition``, ``gpus_per_node``,
    ``time_limit``, ``account``, ``qos``, ``python_exe``, ``slurm_args``, ``monarch_port``,
    ``log_dir``, ``bind_to``, ...), ``ProcessJob``'s ``env``, or for Kubernetes ``namespace``,
    ``image`` and ``resources`` (e.g. ``{"nvidia.com/gpu": 8}``)."""

    def __post_init__(self) -> None:
        if self.job not in JOB_KINDS:
            raise ValueError(f"hosts.job must be one of {list(JOB_KINDS)}, got {self.job!r}")
        check_int("hosts.num_hosts", self.num_hosts, 1)
        if self.job == "attach" and not self.addresses:
            raise ValueError("hosts.job 'attach' needs hosts.addresses (e.g. ['tcp://10.0.0.7:29501'])")
        if self.job != "attach" and self.addresses:
            raise ValueError(f"hosts.addresses are used only with hosts.job 'attach', not {self.job!r}")
        if self.job == "kubernetes" and "namespace" not in self.options:
            raise ValueError("hosts.job 'kubernetes' needs hosts.options.namespace")
        if self.gpus_per_host is not None and self.gpus_per_host < 0:
            raise ValueError(f"hosts.gpus_per_host must be >= 0, got {self.gpus_per_host}")

    def host_gpus(self) -> list[str] | None:
        """Device ids of each host of the pool, if known from this section; None otherwise."""
        n = self.gpus_per_host if self.gpus_per_host is not None else self.options.get("gpus_per_node")
        return None if n is None or self.job == "none" else [str(i) for i in range(int(n))]


def make_job(cfg: HostsConfig, log_dir: str | Path | None = None) -> Any:
    """The Monarch job ``cfg`` describes (not yet applied); None for ``none`` and ``attach``.
    ``log_dir``: where a Slurm job's logs go (``options.log_dir`` wins; one of them is needed)."""
    opts = dict(cfg.options)
    if cfg.job in ("none", "attach"):
        return None
    if cfg.job == "local":
        from monarch.job import LocalJob

        return LocalJob(hosts=(MESH,), **opts)
    if cfg.job == "process":
        from monarch.job import ProcessJob

        return ProcessJob({MESH: cfg.num_hosts}, **opts)
    if cfg.job == "slurm":
        from forge.controller.slurm.job import make_slurm_job

        log_dir = opts.get("log_dir") or log_dir
        if not log_dir:
            raise ValueError("hosts.job 'slurm' needs a folder for the job's logs: hosts.options.log_dir or log_dir=")
        return make_slurm_job(cfg.num_hosts, MESH, log_dir, opts)
    from monarch.job.kubernetes import ImageSpec, KubernetesJob  # needs the kubernetes package

    image, resources = opts.pop("image", None), opts.pop("resources", None)
    job = KubernetesJob(**opts)
    job.add_mesh(MESH, cfg.num_hosts, image_spec=ImageSpec(image, resources=resources) if image else None)
    return job


def host_pool_from(cfg: HostsConfig, log_dir: str | Path | None = None) -> HostPool | None:
    """The pool of hosts ``cfg`` describes, its job applied; None for ``none`` (this host).
    Blocks until a Slurm job runs; in async code use ``open_host_pool``."""
    if cfg.job == "none":
        return None
    if cfg.job == "attach":
        return HostPool.attach(cfg.addresses)
    if cfg.job == "slurm":  # one start path, with its waits, errors and cancellation
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(open_host_pool(cfg, log_dir))
        raise RuntimeError("host_pool_from blocks until a Slurm job runs; in async code await open_host_pool")
    return _pool(HostPool.from_job(make_job(cfg, log_dir), MESH))


async def open_host_pool(cfg: HostsConfig, log_dir: str | Path | None = None) -> HostPool | None:
    """``host_pool_from``, with a Slurm job waited for off the event loop: Ctrl-C or SIGTERM while
    it is queued cancels it, and so does any failure (a ``SlurmJobError`` naming the job)."""
    if cfg.job != "slurm":
        return host_pool_from(cfg, log_dir)
    from forge.controller.slurm.job import start_slurm_job

    job = make_job(cfg, log_dir)
    mesh = await start_slurm_job(job, MESH)
    return _pool(HostPool(mesh, job=job))


def _pool(pool: HostPool) -> HostPool:
    """``pool`` with its hosts named after the job's nodes and probed at their workers, where
    the job knows them (forge's Slurm job)."""
    workers, nodes = getattr(pool.job, "workers", None), getattr(pool.job, "nodes", None)
    if workers and len(workers) == pool.size:
        pool.addresses, pool.node_names = list(workers), list(nodes)
    return pool
