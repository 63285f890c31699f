"""Hosts beyond this one: Monarch worker processes that replicas can be placed on.

On each machine (or, in tests, as separate processes on loopback) run a worker::

    python -m forge.controller.worker --address tcp://0.0.0.0:29501

and give the controller a pool of them::

    pool = HostPool.attach(["tcp://10.0.0.7:29501", "tcp://10.0.0.8:29501"])
    svc = await Policy.options(num_replicas=4, host_pool=pool).as_service()

Replicas are spread over the pool's hosts in turn. A host whose worker stops answering is
marked dead; a replica that lived on it is restarted on a live host.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from monarch.actor import attach_to_workers

import forge.controller._env  # noqa: F401  (before monarch)

logger = logging.getLogger("forge.hosts")


class HostPool:
    """A set of attached Monarch hosts; hands out one host per replica start."""

    def __init__(self, host_mesh: Any, addresses: Sequence[str]) -> None:
        self.host_mesh = host_mesh
        self.addresses = list(addresses)
        self.dead: set[int] = set()
        self._next = 0

    @classmethod
    def attach(cls, addresses: Sequence[str]) -> HostPool:
        """Connect to running workers (``tcp://host:port`` each). Connection is lazy."""
        if not addresses or not all(isinstance(a, str) and "://" in a for a in addresses):
            raise ValueError(f"HostPool.attach needs worker addresses like 'tcp://host:port', got {addresses!r}")
        mesh = attach_to_workers(ca="trust_all_connections", workers=list(addresses), name="forge_hosts")
        return cls(mesh, addresses)

    def alive(self) -> list[int]:
        return [i for i in range(len(self.addresses)) if i not in self.dead]

    def pick(self, avoid: int | None = None) -> int:
        """The next live host index in turn, preferring one other than ``avoid``."""
        live = self.alive()
        if not live:
            raise RuntimeError(f"no live host left in the pool {self.addresses}")
        choices = [i for i in live if i != avoid] or live
        index = choices[self._next % len(choices)]
        self._next += 1
        return index

    def host(self, index: int) -> Any:
        return self.host_mesh.slice(hosts=index)

    def mark_dead(self, index: int) -> None:
        if index not in self.dead:
            logger.warning("host %s (%s) is not answering; no more replicas go there", index, self.addresses[index])
            self.dead.add(index)

    def __repr__(self) -> str:
        return f"HostPool({self.addresses}, dead={sorted(self.dead)})"


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
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"worker on port {port} did not listen within {timeout_s}s") from None
            time.sleep(0.1)
