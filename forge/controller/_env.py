"""Monarch settings that must be in the environment before ``import monarch``.

Monarch reads these once, at import time, in the controller and in every child process it
spawns (children inherit the parent's environment). forge sets defaults that suit services:
a dead replica is noticed within one supervision poll, which forge makes much shorter than
Monarch's default, and Monarch's internal log file stays quiet. A user who sets a variable
first keeps their value. (How soon a killed replica is noticed: docs/benchmarks.md, section 3.)
"""

from __future__ import annotations

import logging
import os
import sys

DEFAULTS = {
    # Failure detection: a death is noticed within one poll. Much shorter polls made detection flaky.
    "HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY": "1s",
    # A process on a host whose worker died never answers a state query: Monarch reports it
    # failed ("no status received from process") after this long instead of a minute.
    "HYPERACTOR_MESH_GET_PROC_STATE_MAX_IDLE": "10s",
    # Monarch's own log file grows with every script at the default level.
    "MONARCH_FILE_LOG": "error",
}


def apply_monarch_env() -> None:
    """Set forge's defaults for Monarch's environment variables, warning if too late."""
    missing = [k for k in DEFAULTS if k not in os.environ]
    for key in missing:
        os.environ[key] = DEFAULTS[key]
    if missing and "monarch" in sys.modules:
        logging.getLogger("forge").warning(
            "monarch was imported before forge.controller; %s take effect only in child "
            "processes. Import forge.controller first for fast failure detection.",
            ", ".join(missing),
        )


apply_monarch_env()
