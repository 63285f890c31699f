"""Cluster launch through Monarch's job API: one config section -> a ``HostPool``.

Monarch's jobs (``monarch.job``) allocate machines and start a Monarch worker on each: a Slurm
allocation (``SlurmJob``, via ``sbatch``), Kubernetes pods (``KubernetesJob``), worker
processes on this machine (``ProcessJob``, for tests and demos) or this host itself
(``LocalJob``). forge does not launch anything itself; it names the job and its size::

    hosts:
      job: slurm
      num_hosts: 2
      options: {partition: gpu, gpus_per_node: 8, time_limit: "04:00:00", account: my-account}

and ``host_pool_from(cfg)`` applies the job and returns the pool that replicas are placed on
(``options(host_pool=pool, hosts=H)``). The pool owns the job: ``pool.close()`` kills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forge.checks import check_int
from forge.controller.hosts import HostPool

JOB_KINDS = ("none", "attach", "local", "process", "slurm", "kubernetes")

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


def make_job(cfg: HostsConfig) -> Any:
    """The Monarch job ``cfg`` describes (not yet applied); None for ``none`` and ``attach``."""
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
        from monarch.job import SlurmJob

        return SlurmJob({MESH: cfg.num_hosts}, **opts)
    from monarch.job.kubernetes import ImageSpec, KubernetesJob  # needs the kubernetes package

    image, resources = opts.pop("image", None), opts.pop("resources", None)
    job = KubernetesJob(**opts)
    job.add_mesh(MESH, cfg.num_hosts, image_spec=ImageSpec(image, resources=resources) if image else None)
    return job


def host_pool_from(cfg: HostsConfig) -> HostPool | None:
    """The pool of hosts ``cfg`` describes, its job applied; None for ``none`` (this host)."""
    if cfg.job == "none":
        return None
    if cfg.job == "attach":
        return HostPool.attach(cfg.addresses)
    return HostPool.from_job(make_job(cfg), MESH)
