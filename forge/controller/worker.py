"""A Monarch host worker: ``python -m forge.controller.worker --address tcp://0.0.0.0:29501``.

Run one per machine; a controller attaches with ``HostPool.attach([...])`` and places replicas
on it. The process serves until its controller shuts it down or it is killed.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="where to listen, e.g. tcp://0.0.0.0:29501")
    args = parser.parse_args(argv)
    if "://" not in args.address:
        parser.error(f"--address must look like tcp://host:port, got {args.address!r}")
    # Replica processes started here must import the controller's actor classes.
    os.environ.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    from monarch.actor import run_worker_loop_forever

    import forge.controller._env  # noqa: F401  (before monarch)

    run_worker_loop_forever(ca="trust_all_connections", address=args.address)


if __name__ == "__main__":
    main()
