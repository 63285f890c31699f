"""A single-host GRPO run listens on loopback only: every TCP listening socket of the run's
process tree (controller, vLLM policy, reference, reward, trainer), polled while it runs, is
bound to 127.0.0.1 or ::1, never to a wildcard or a network interface."""

from __future__ import annotations

import ipaddress
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.test_grpo_app import _app, _finish

pytestmark = pytest.mark.timeout(480)  # a loaded machine; about a minute on an idle one


def listeners(root: psutil.Process) -> dict[tuple[str, int], str]:
    """(ip, port) -> the command line of the process listening there, over root's tree."""
    out = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out[(c.laddr.ip, c.laddr.port)] = " ".join(proc.cmdline())[:100]
        except psutil.Error:  # the process ended between the listing and the look
            continue
    return out


def test_a_single_host_run_listens_on_loopback_only(tmp_path: Path) -> None:
    """With a 2-rank trainer, so that torch.distributed's rendezvous store and gloo are in it."""
    proc = _app(tmp_path, "trainer.procs=2")
    root = psutil.Process(proc.pid)
    finished: list[tuple[int, str, str]] = []
    # The app's output pipes are read in a thread: a full pipe would block the app.
    reader = threading.Thread(target=lambda: finished.append(_finish(proc, timeout=420)), daemon=True)
    reader.start()
    seen: dict[tuple[str, int], str] = {}
    while reader.is_alive():
        seen.update(listeners(root))
        time.sleep(0.2)
    assert finished, "the app did not finish (see the reader thread's failure above)"
    code, out, err = finished[0]
    assert code == 0, f"exit code {code}\nstderr:\n{err[-3000:]}"
    assert seen, "no listening socket was seen: the poll missed the run"
    exposed = {addr: cmd for addr, cmd in seen.items() if not ipaddress.ip_address(addr[0]).is_loopback}
    assert not exposed, f"listening beyond loopback: {exposed}"
