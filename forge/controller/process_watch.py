"""Whether a replica's processes still exist, asked of the operating system of the controller's host.

Monarch reports a dead process through its supervision poll. On a loaded machine that report can
come late: a SIGKILLed replica once went unreported for more than 30 s (Monarch's state query to
the process timed out first), and every request queued on it waited that long for its retry. A
process on the controller's own host can be seen directly, so the service's health loop asks
whether each of a replica's processes is still there and fails the replica as soon as one is
gone, whichever of the two notices first.

A process is identified by its pid *and* its start time, so that a pid the OS has given to a new
process is not taken for the replica's. Processes the controller cannot see as they are (on
another host, or in another pid namespace, where the same pid names a different process) are
not watched: Monarch and the health probes cover them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import psutil

_START_TIME_TOLERANCE_S = 0.05  # psutil's start times are jiffies since boot: equal within 1/100 s


@dataclass(frozen=True)
class ProcessIdentity:
    """One process as it describes itself: where it runs, its pid, and when it started."""

    hostname: str
    pid: int
    started_at: float


def this_process() -> ProcessIdentity:
    """The calling process's identity (an actor calls it to say which process it runs in)."""
    return ProcessIdentity(socket.gethostname(), os.getpid(), psutil.Process().create_time())


def watchable(processes: list[ProcessIdentity]) -> list[ProcessIdentity]:
    """The processes the controller sees as they are: on its host, under the same pid and start time."""
    here = socket.gethostname()
    return [p for p in processes if p.hostname == here and _running(p) is not None]


def first_gone(processes: list[ProcessIdentity]) -> ProcessIdentity | None:
    """The first of ``processes`` that no longer runs (exited, a zombie, or its pid reused); None if all run."""
    return next((p for p in processes if not _running(p)), None)


def _running(process: ProcessIdentity) -> bool | None:
    """Whether ``process`` runs (False: a zombie or dead); None when its pid now names another
    process (another start time) or none."""
    try:
        found = psutil.Process(process.pid)
        if abs(found.create_time() - process.started_at) > _START_TIME_TOLERANCE_S:
            return None
        return found.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return None
