"""The process watch on real processes: a live one runs, a killed one (reaped or a zombie) is gone,
and a pid whose start time differs (reused, or another namespace's) is never taken for the replica's."""

import dataclasses
import signal
import socket
import subprocess
import sys
import time

import psutil

from forge.controller.process_watch import ProcessIdentity, first_gone, this_process, watchable


def _child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _identity(proc: subprocess.Popen) -> ProcessIdentity:
    return ProcessIdentity(socket.gethostname(), proc.pid, psutil.Process(proc.pid).create_time())


def test_a_live_process_runs_and_a_killed_one_is_gone_reaped_or_zombie():
    reaped, zombie = _child(), _child()
    try:
        identities = [_identity(reaped), _identity(zombie)]
        assert watchable(identities) == identities
        assert first_gone(identities) is None
        zombie.send_signal(signal.SIGKILL)  # not waited for: a zombie until reaped
        for _ in range(200):
            if psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.05)
        assert psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE
        assert first_gone(identities) == identities[1]
        reaped.kill()
        reaped.wait(10)
        assert first_gone(identities) == identities[0]
    finally:
        for proc in (reaped, zombie):
            proc.kill()
            proc.wait(10)


def test_a_pid_that_started_at_another_time_is_not_the_replicas_process():
    me = this_process()
    assert first_gone([me]) is None
    reused = dataclasses.replace(me, started_at=me.started_at - 5.0)  # the pid now names another process
    assert first_gone([reused]) == reused
    assert watchable([reused]) == []  # another pid namespace looks the same: never watched
    elsewhere = dataclasses.replace(me, hostname=me.hostname + "-other")
    assert watchable([elsewhere, me]) == [me]
