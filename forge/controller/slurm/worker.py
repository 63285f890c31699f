"""One node's Monarch worker in a forge Slurm job: ``python -m forge.controller.slurm.worker ADDRESS``.

The job's batch script starts it once per node (``srun``), with ``ADDRESS`` the node's
``tcp://NodeAddr:port`` (optionally ``...@tcp://bind_to:port``) and ``FORGE_NODE_INDEX`` its
index in the job, which picks its service identity from ``MONARCH_SERVICE_PROC_IDS`` (the ids
the controller attaches with). It serves until the controller stops it or the job ends.
Trust model: as ``forge.controller.worker`` (no TLS in Monarch 0.7; listen on a private network).
"""

from __future__ import annotations

import sys

import forge.controller._env  # noqa: F401  (Monarch's settings, before monarch is imported)

NODE_INDEX_ENV = "FORGE_NODE_INDEX"
"""A worker's index in its job (its service identity); each node's ``srun`` step sets it."""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or "://" not in args[0]:
        raise SystemExit(f"usage: python -m forge.controller.slurm.worker tcp://host:port, got {args}")
    from monarch._src.job.service_identity import ranked_service_proc_id_from_env, service_proc_addr
    from monarch.actor import run_worker_loop_forever

    address = service_proc_addr(args[0], ranked_service_proc_id_from_env(rank_env=NODE_INDEX_ENV))
    run_worker_loop_forever(address=address, ca="trust_all_connections")


if __name__ == "__main__":
    main()
