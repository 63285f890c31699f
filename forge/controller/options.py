"""``ActorOptions``: how many processes, replicas and GPUs an actor or service gets.

Built by ``ForgeActor.options(...)``; every value is checked here so that a bad option fails at
the call site, naming the option, the value and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forge.checks import check_int
from forge.controller.routing import Router, make_router


def _check_int(name: str, value: Any, minimum: int) -> None:
    check_int(f"options({name}=...)", value, minimum)


def _check_timeout(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f"options({name}=...) must be a number of seconds > 0 or None, got {value!r}")


@dataclass(frozen=True)
class ActorOptions:
    procs: int = 1
    """Processes per replica (per actor mesh). Service endpoints run on every rank and
    return rank 0's result."""
    hosts: int = 1
    """Hosts per replica: its ``procs`` processes run on each of ``hosts`` neighbouring live hosts
    of ``host_pool`` (a Monarch host-mesh slice), as one flat proc mesh of ``hosts x procs``
    ranks. More than 1 needs a ``host_pool`` with at least that many hosts."""
    with_gpus: bool = False
    """Give each process ``gpus_per_proc`` GPUs of its own (``CUDA_VISIBLE_DEVICES``), taken from
    the visible ones and split across replicas."""
    gpus: tuple[str, ...] | None = None
    """The device ids this actor or service uses (implies ``with_gpus``), split across its
    replicas and processes in order; e.g. ``gpus=["0"]`` for a policy and a trainer that share
    GPU 0. None: the visible devices (``CUDA_VISIBLE_DEVICES``). With ``hosts > 1`` the same ids
    are used on every host."""
    gpus_per_proc: int = 1
    """GPUs each process sees, e.g. ``tensor_parallel_size`` of a vLLM engine that runs its
    workers inside one process."""
    num_replicas: int = 1
    """Replicas of a service, each on its own proc mesh."""
    router: Any = None
    """Default router of the service's endpoints: a registered name, a Router class or instance.
    None: ``round_robin``, and ``model_aware`` for multiplexed endpoints."""
    endpoint_routers: dict[str, Any] = field(default_factory=dict)
    """Per-endpoint routers, overriding ``router``: ``{"generate": "key_affinity"}``."""
    concurrent_batches: dict[str, int] = field(default_factory=dict)
    """Per batched endpoint, how many of its batches may be in flight to one replica at once,
    overriding its ``Batching.max_concurrent_batches``: ``{"generate": 4}`` lets new batches join
    an engine that is still generating (the endpoint must be ``concurrent=True`` to run them)."""
    call_timeout_s: float | None = 600.0
    """Longest one message to a replica may take before the caller gets ``RequestTimeout``."""
    setup_timeout_s: float | None = 900.0
    """Longest a replica's start (spawn + ``setup``) may take."""
    max_retries: int = 2
    """Times a request that a dead replica never answered is resent to another replica."""
    max_restarts: int = 5
    """Times a replica whose process died is restarted before it is left failed."""
    restart_backoff_s: float = 0.5
    """Wait before the first restart of a replica; doubles with each failed try (cap 30 s)."""
    max_models: int | None = None
    """Models one replica of a multiplexed service holds at most; None: the actor's
    ``@model_loader(max_models=...)``. Size it to the memory a replica has for models."""
    max_in_flight_per_replica: int | None = None
    """Admission limit: requests a replica may hold (queued in its batchers or running) at
    once. None: no limit. Past it, callers wait in the service queue."""
    max_queued: int = 10_000
    """Callers that may wait for admission at once; one more gets ``Overloaded`` at once."""
    queue_timeout_s: float = 30.0
    """Longest a caller waits for admission (or for a replica to recover) before
    ``Overloaded`` (or ``NoHealthyReplica``)."""
    health_interval_s: float | None = 5.0
    """How often the service looks at its replicas: whether their processes on this host still
    run (``forge.controller.process_watch``: a death Monarch has not reported yet), and a probe
    of each idle or stalled one (what Monarch cannot see, such as a host whose worker died).
    None: neither."""
    health_timeout_s: float = 120.0
    """A replica that answers no probe and finishes no request for this long is failed.
    Keep it above the longest endpoint call: an actor runs one message at a time."""
    host_pool: Any = None
    """A ``forge.controller.hosts.HostPool`` to place replicas on other hosts; None: this host."""
    name: str | None = None
    """Mesh name prefix (default: the class name, lower-case)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the replica processes."""

    @property
    def uses_gpus(self) -> bool:
        return self.with_gpus or self.gpus is not None

    @property
    def ranks(self) -> int:
        """Processes of one replica over all its hosts."""
        return self.procs * self.hosts

    @property
    def gpus_per_replica(self) -> int:
        """Devices one replica uses on each of its hosts."""
        return self.procs * self.gpus_per_proc

    def __post_init__(self) -> None:
        _check_int("procs", self.procs, 1)
        _check_int("hosts", self.hosts, 1)
        _check_int("gpus_per_proc", self.gpus_per_proc, 1)
        if self.gpus is not None:
            if isinstance(self.gpus, (str, int)) or not all(
                isinstance(g, (str, int)) and not isinstance(g, bool) for g in self.gpus
            ):
                raise ValueError(
                    f"options(gpus=...) must be a list of device ids such as ['0', '1'], got {self.gpus!r}"
                )
            object.__setattr__(self, "gpus", tuple(str(g) for g in self.gpus))
        _check_int("num_replicas", self.num_replicas, 1)
        _check_int("max_retries", self.max_retries, 0)
        _check_int("max_restarts", self.max_restarts, 0)
        _check_int("max_queued", self.max_queued, 0)
        for name, batches in self.concurrent_batches.items():
            _check_int(f"concurrent_batches[{name!r}]", batches, 1)
        if self.max_models is not None:
            _check_int("max_models", self.max_models, 1)
        if self.max_in_flight_per_replica is not None:
            _check_int("max_in_flight_per_replica", self.max_in_flight_per_replica, 1)
        _check_timeout("restart_backoff_s", self.restart_backoff_s)
        _check_timeout("queue_timeout_s", self.queue_timeout_s)
        _check_timeout("health_interval_s", self.health_interval_s)
        _check_timeout("health_timeout_s", self.health_timeout_s)
        if self.host_pool is not None and not hasattr(self.host_pool, "pick_hosts"):
            raise ValueError(f"options(host_pool=...) must be a forge HostPool, got {self.host_pool!r}")
        if self.hosts > 1 and self.host_pool is None:
            raise ValueError(
                f"options(hosts={self.hosts}) places a replica on {self.hosts} hosts, which needs "
                "host_pool=HostPool.attach([...]) or HostPool.from_job(job)"
            )
        if self.host_pool is not None:
            self.host_pool.check_count(self.hosts, f"options(hosts={self.hosts})")
        if not isinstance(self.with_gpus, bool):
            raise ValueError(f"options(with_gpus=...) must be True or False, got {self.with_gpus!r}")
        _check_timeout("call_timeout_s", self.call_timeout_s)
        _check_timeout("setup_timeout_s", self.setup_timeout_s)
        if self.router is not None and not isinstance(self.router, Router):
            make_router(self.router)  # validates the name
        if not isinstance(self.endpoint_routers, dict):
            raise ValueError(
                "options(endpoint_routers=...) must be a dict of endpoint name -> router, "
                f"got {self.endpoint_routers!r}"
            )
        for spec in self.endpoint_routers.values():
            if not isinstance(spec, Router):
                make_router(spec)
        if self.name is not None and (
            not isinstance(self.name, str) or not self.name.replace("_", "").replace("-", "").isalnum()
        ):
            raise ValueError(f"options(name=...) must be letters, digits, '-' or '_', got {self.name!r}")
        if not isinstance(self.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise ValueError(f"options(env=...) must be a dict of str -> str, got {self.env!r}")
