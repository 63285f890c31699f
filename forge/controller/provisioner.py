"""Where replicas run: one Monarch proc mesh per replica, GPUs split between replicas.

The provisioner also owns two process-wide concerns that every mesh needs:

- Child processes must import the user's actor class. Monarch children inherit the parent's
  environment and working directory but not its ``sys.path`` edits (pytest's rootdir, a
  notebook's cwd, a script's folder), so each mesh gets ``PYTHONPATH`` = the parent's
  ``sys.path``. Users never have to set it.
- By default a failed mesh makes Monarch call ``sys.exit`` in the controller. forge replaces
  that hook with one that logs the failure and tells the owning service, which then treats
  the replica as failed and its in-flight requests as lost (they are retried or reported).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import monarch.actor
from monarch.actor import MeshFailure, ProcMesh, default_bootstrap_cmd

import forge.controller._env  # noqa: F401  (before monarch)
from forge.controller.errors import describe
from forge.controller.quiet import local_host

logger = logging.getLogger("forge.provisioner")


class InsufficientGpus(ValueError):
    """More GPUs were asked for than are visible."""


def visible_gpus() -> list[str]:
    """Device ids this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else all CUDA devices."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # torch missing or broken CUDA: no GPUs
        return []


def split_gpus(num_replicas: int, gpus_per_replica: int, devices: Sequence[str]) -> list[list[str]]:
    """Disjoint device lists, one per replica, taken in order from ``devices``."""
    need = num_replicas * gpus_per_replica
    if need > len(devices):
        raise InsufficientGpus(
            f"{num_replicas} replicas x {gpus_per_replica} GPUs each need {need} GPUs, but only "
            f"{len(devices)} are visible ({list(devices)}); lower num_replicas or procs, or set "
            f"CUDA_VISIBLE_DEVICES"
        )
    return [list(devices[i * gpus_per_replica : (i + 1) * gpus_per_replica]) for i in range(num_replicas)]


def replica_gpus(options: Any, num_replicas: int) -> list[list[str] | None]:
    """Each replica's device ids under ``options`` (an ``ActorOptions``): None without GPUs.

    The devices are ``options.gpus`` if given, else the visible ones; each replica takes
    ``procs x gpus_per_proc`` of them, in order, disjoint from the other replicas'.
    """
    if not options.uses_gpus:
        return [None] * num_replicas
    devices = list(options.gpus) if options.gpus is not None else visible_gpus()
    return split_gpus(num_replicas, options.gpus_per_replica, devices)


def place_replica(
    name: str, options: Any, gpus: Sequence[str] | None, env: dict[str, str], avoid: Sequence[int] = ()
) -> tuple[ProcMesh, list[int]]:
    """Spawn one replica's proc mesh where ``options`` say: this host, or ``options.hosts``
    live hosts of ``options.host_pool`` (preferring hosts not in ``avoid``).

    Returns the mesh and the indices of its hosts in the pool (``[]`` for this host).
    """
    pool, indices, host = options.host_pool, [], None
    if pool is not None:
        indices = pool.pick_hosts(options.hosts, avoid, who=f"replica {name!r}")
        host = pool.hosts(indices)
    return spawn_proc_mesh(name, options.procs, gpus, env, host, options.gpus_per_proc), indices


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment every forge child process gets on top of the parent's."""
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    env.update(extra or {})
    return env


# ------------------------------------------------------------------ fault hook
_fault_listeners: list[Callable[[MeshFailure], bool]] = []
_hook_lock = threading.Lock()
_hook_installed = False


def _forge_fault_hook(failure: MeshFailure) -> None:
    handled = False
    for listener in list(_fault_listeners):
        try:
            handled = listener(failure) or handled
        except Exception:  # a listener's bug must not take the controller down
            logger.exception("forge fault listener failed")
    if not handled:
        name = str(getattr(failure, "mesh_name", "?"))
        # Every proc mesh has a hidden "logger-*" actor mesh that fails with its processes;
        # the owner of the real mesh reports that failure, so this one is only noise.
        level = logging.DEBUG if name.startswith("logger-") else logging.WARNING
        logger.log(level, "Monarch mesh %s failed: %s", name, describe(failure, limit=300))


def install_fault_hook() -> None:
    """Replace Monarch's exit-on-fault hook with forge's (once per process)."""
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            monarch.actor.unhandled_fault_hook = _forge_fault_hook
            _hook_installed = True


def add_fault_listener(listener: Callable[[MeshFailure], bool]) -> None:
    """``listener(failure) -> handled``: called for every mesh failure in this process."""
    install_fault_hook()
    _fault_listeners.append(listener)


def remove_fault_listener(listener: Callable[[MeshFailure], bool]) -> None:
    if listener in _fault_listeners:
        _fault_listeners.remove(listener)


# ------------------------------------------------------------------ spawning
PROC_MESH_ENV = "FORGE_PROC_MESH"
"""Environment variable naming the proc mesh a forge child process belongs to (its children,
such as vLLM's engine core, inherit it)."""


def spawn_proc_mesh(
    name: str,
    procs: int,
    gpus: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    host: Any = None,
    gpus_per_proc: int = 1,
) -> ProcMesh:
    """Start ``procs`` processes on each host of ``host`` for one replica.

    ``host`` is a Monarch host mesh (default: this host); over several hosts the result is
    flattened to one ``procs`` dimension (host 0's ranks first), an ordinary proc mesh to the
    actor. With ``gpus`` (``procs x gpus_per_proc`` device ids, the same on every host), local
    rank r sees ``gpus[r*k:(r+1)*k]`` as ``CUDA_VISIBLE_DEVICES`` (k = ``gpus_per_proc``).
    """
    install_fault_hook()
    # The mesh's name in every process's environment, so that tools outside forge (``ps``, a
    # profiler, benchmarks/vs_trl.py's CPU accounting) can tell which replica a process serves.
    base_env = {**child_env(env), PROC_MESH_ENV: name}
    if gpus is not None and len(gpus) != procs * gpus_per_proc:
        raise InsufficientGpus(
            f"replica {name!r} has {procs} procs x {gpus_per_proc} GPUs each but was given {len(gpus)} GPUs "
            f"({list(gpus)})"
        )

    def command_for(point: Any):
        rank_env = dict(base_env)
        if gpus is not None:
            local = dict(point).get("procs", point.rank)  # the rank within its host
            rank_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[local * gpus_per_proc : (local + 1) * gpus_per_proc])
        return default_bootstrap_cmd().with_env(rank_env)

    host = local_host() if host is None else host  # the first one starts Monarch's agent, its banner filtered
    mesh = host.spawn_procs(per_host={"procs": procs}, name=name, bootstrap_command=command_for)
    if "hosts" not in mesh.extent.labels:
        return mesh
    flat = mesh.flatten("procs")
    # Monarch lets only the mesh that spawned the processes stop them ("not owned" otherwise):
    # the flat view's stop() stops its owner, so every caller can treat it as any proc mesh.
    flat.stop = mesh.stop
    return flat
