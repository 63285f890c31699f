"""CPU-seconds per training step of each forge role, read from outside the run.

A forge run is a tree of processes: the controller (the ``python -m apps.grpo.main`` process),
one process per replica rank, and Monarch's own helpers. Every replica process carries its proc
mesh's name in ``FORGE_PROC_MESH`` (``policy0-r0-g0``, ``trainer1``...), which its children
inherit, so a sampler that walks the tree can charge each process's CPU time to a role without
any cooperation from the run. ``RoleCpuSampler`` does that every ``interval_s`` and also notes
how many steps the run has logged, so that the CPU spent between two logged steps can be divided
by the steps between them: start-up and shutdown are left out.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from forge.controller.provisioner import PROC_MESH_ENV

# A service replica's mesh "policy0-r1-g0" -> "policy"; an actor's "trainer-a3" -> "trainer".
_ROLE = re.compile(r"^(?P<role>.+?)(\d*-r\d+-g\d+|-a\d+)?$")


def role_of(proc: psutil.Process, root_pid: int) -> str:
    """The role a process of a forge run serves: its proc mesh's service, ``controller`` for the
    run's own process, ``monarch`` for a helper process without a mesh name (or unreadable)."""
    if proc.pid == root_pid:
        return "controller"
    try:
        mesh = proc.environ().get(PROC_MESH_ENV)
    except (psutil.Error, OSError):
        return "monarch"
    if not mesh:
        return "monarch"
    match = _ROLE.match(mesh)
    return match.group("role") if match else mesh


@dataclass
class Sample:
    t: float
    steps: int
    cpu_s: dict[str, float]


class RoleCpuSampler(threading.Thread):
    """Samples the CPU time of every process under ``root_pid``, grouped by role.

    ``steps()`` returns how many steps the run has logged so far. A process that exits keeps its
    last reading (CPU time only grows), so the totals stay monotonic across a replica restart.
    """

    def __init__(self, root_pid: int, steps: Callable[[], int], interval_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="role-cpu-sampler")
        self.root_pid = root_pid
        self.steps = steps
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._last: dict[int, tuple[str, float]] = {}  # pid -> (role, cpu seconds)
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            self.sample()
            self._stopping.wait(self.interval_s)

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=10)

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            role = self._last[proc.pid][0] if proc.pid in self._last else role_of(proc, self.root_pid)
            self._last[proc.pid] = (role, times.user + times.system)
        totals: dict[str, float] = {}
        for role, cpu in self._last.values():
            totals[role] = totals.get(role, 0.0) + cpu
        self.samples.append(Sample(time.perf_counter(), self.steps(), totals))

    def per_step(self) -> dict[str, float]:
        """CPU-seconds per step of each role, between the first sample that saw a logged step and
        the last sample (taken at the last step or later, before the run's processes exit)."""
        logged = [s for s in self.samples if s.steps >= 1]
        if len(logged) < 2 or logged[-1].steps == logged[0].steps:
            return {}
        first = logged[0]
        last = next(s for s in logged if s.steps == logged[-1].steps)  # before shutdown's CPU
        steps = last.steps - first.steps
        roles = sorted(set(first.cpu_s) | set(last.cpu_s))
        return {r: (last.cpu_s.get(r, 0.0) - first.cpu_s.get(r, 0.0)) / steps for r in roles}
