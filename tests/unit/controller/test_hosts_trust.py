"""Workers trust nothing by default: ``python -m forge.controller.worker`` listens only on the
address it is given, and refuses a wildcard address unless ``--allow-any-interface`` is passed
(then it warns: in Monarch 0.7 whoever reaches the port can run code on the machine)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from forge.controller.hosts import probe_address, start_local_worker
from forge.controller.worker import check_address, listen_host
from tests.unit.controller.test_hosts_spanning import free_port


def listening(pid: int) -> set[str]:
    """The addresses (ip) that process ``pid`` and its children listen on over TCP."""
    root = psutil.Process(pid)
    out = set()
    for proc in [root, *root.children(recursive=True)]:
        out |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    return out


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "*", ""])
def test_a_wildcard_address_is_refused_naming_the_risk_and_the_flag(host):
    port = free_port()
    run = subprocess.run(
        [sys.executable, "-m", "forge.controller.worker", "--address", f"tcp://{host}:{port}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "listens on every network interface" in run.stderr
    assert "anyone who can reach this port can run code" in run.stderr and "--allow-any-interface" in run.stderr
    assert probe_address(f"tcp://127.0.0.1:{port}", 0.5) is False  # it never listened


def test_allow_any_interface_listens_everywhere_and_warns():
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "forge.controller.worker",
            "--address",
            f"tcp://0.0.0.0:{port}",
            "--allow-any-interface",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not probe_address(f"tcp://127.0.0.1:{port}", 0.5):
            assert proc.poll() is None and time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.1)
        assert listening(proc.pid) == {"0.0.0.0"}
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert "listens on every interface" in err and "anyone who can reach this port can run code" in err


def test_a_worker_listens_only_on_the_address_it_is_given():
    worker = start_local_worker(free_port())
    try:
        assert listening(worker.pid) == {"127.0.0.1"}
    finally:
        worker.kill()
        worker.wait(10)


@pytest.mark.parametrize(
    ("address", "wildcard"),
    [
        ("tcp://0.0.0.0:1", True),
        ("tcp://[::]:1", True),
        ("tcp://[0:0::0]:1", True),
        ("tcp://*:1", True),
        ("tcp://127.0.0.1:29501", False),
        ("tcp://10.0.0.7:29501", False),
        ("tcp://[::1]:29501", False),
        ("tcp://node-3.cluster:29501", False),
    ],
)
def test_check_address_refuses_exactly_the_wildcards(address, wildcard):
    if wildcard:
        with pytest.raises(ValueError, match="every network interface"):
            check_address(address, allow_any_interface=False)
    else:
        check_address(address, allow_any_interface=False)
    check_address(address, allow_any_interface=True)  # allowed: a warning only


@pytest.mark.parametrize("address", ["0.0.0.0:29501", "tcp://host", "tcp://host:port", "ipc:///tmp/x", "tcp://h:1/x"])
def test_an_address_that_is_not_tcp_host_port_is_refused(address):
    with pytest.raises(ValueError, match=r"must look like tcp://host:port"):
        listen_host(address)
