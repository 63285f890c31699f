"""A Monarch host worker: ``python -m forge.controller.worker --address tcp://10.0.0.7:29501``.

Run one per machine; a controller attaches with ``HostPool.attach([...])`` and places replicas
on it. The process serves until its controller shuts it down or it is killed.

Trust model: in Monarch 0.7 a worker accepts every connection (``ca="trust_all_connections"``),
and whoever connects can spawn processes and run code on it. So the worker listens only on
the address it is given, which should be a private interface that only the controller's
machines can reach (a cluster network, a VPN, loopback). A wildcard address (``0.0.0.0``,
``::``, ``*``), which would expose it on every interface, is refused unless
``--allow-any-interface`` is passed, and then it warns.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from urllib.parse import urlsplit

WILDCARD_HOSTS = frozenset({"*", ""})
"""Host names that mean "every interface" (besides unspecified IPs such as ``0.0.0.0``, ``::``)."""

RISK = (
    "in Monarch 0.7 anyone who can reach this port can run code on this machine; "
    "listen on a private interface that only the controller's machines can reach"
)

logger = logging.getLogger("forge.worker")


def listen_host(address: str) -> str:
    """The host part of ``tcp://host:port`` (brackets of an IPv6 literal removed).

    Raises ``ValueError`` naming the address when it is not ``tcp://host:port``.
    """
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:  # a port that is not a number
        port = None
    if parts.scheme != "tcp" or port is None or parts.path or parts.query:
        raise ValueError(f"--address must look like tcp://host:port (e.g. tcp://10.0.0.7:29501), got {address!r}")
    # urlsplit drops IPv6 brackets and lower-cases; "*" is kept as it is.
    return parts.hostname if parts.hostname is not None else parts.netloc.rsplit(":", 1)[0]


def is_wildcard(host: str) -> bool:
    """True for a host that binds every interface: ``0.0.0.0``, ``::``, ``*`` or nothing."""
    if host in WILDCARD_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name, not an IP literal
        return False


def check_address(address: str, allow_any_interface: bool) -> None:
    """Refuse a wildcard listen address unless the user allowed it; warn when allowed."""
    if is_wildcard(listen_host(address)):
        if not allow_any_interface:
            raise ValueError(
                f"--address {address!r} listens on every network interface, and {RISK}. Give the "
                "address of a private interface (e.g. tcp://10.0.0.7:29501), or pass "
                "--allow-any-interface if this machine's network is private"
            )
        logger.warning("worker listens on every interface (%s): %s", address, RISK)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="where to listen, e.g. tcp://10.0.0.7:29501")
    parser.add_argument(
        "--allow-any-interface",
        action="store_true",
        help="allow a wildcard address (0.0.0.0, ::, *); anyone who can reach the port can run code here",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_address(args.address, args.allow_any_interface)
    except ValueError as exc:
        parser.error(str(exc))
    import forge.controller._env  # noqa: F401  (Monarch's settings, before monarch is imported)

    # Replica processes started here must import the controller's actor classes.
    os.environ.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    from monarch.actor import run_worker_loop_forever

    run_worker_loop_forever(ca="trust_all_connections", address=args.address)


if __name__ == "__main__":
    main()
