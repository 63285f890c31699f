"""Calls to an app's roles: a failure names the role, and says whether the call may be made again.

A role is a service (replicas that restart) or an actor (the trainer, the buffer, the
dataset). ``call_role`` turns whatever a call to one raises into ``RoleFailed`` naming it, so a
run's error says which role failed and how; ``RoleFailed.recoverable`` tells a failure of a
replica that its service is replacing (retry the work) from one of the role's own code (stop).
"""

from __future__ import annotations

import asyncio
from typing import Any

from forge.controller.errors import describe

__all__ = ["POLICY_ENV", "QUIET_ENV", "ROLE_ENV", "RUN_ENV", "SERVICE_ROLES", "RoleFailed", "call_role"]


class RoleFailed(Exception):
    """A call to a role (policy, reference, reward, trainer, buffer, dataset) failed, or the role
    is gone for good; ``error`` is forge's error for the failed call, if there was one."""

    def __init__(self, role: str, error: BaseException | str) -> None:
        detail = error if isinstance(error, str) else describe(error, limit=600, typed=True)
        super().__init__(f"role '{role}' failed: {detail}")
        self.role = role
        self.detail = detail
        self.error = error if isinstance(error, BaseException) else None

    @property
    def recoverable(self) -> bool:
        """Whether a service replica died or was restarting under the call (the service
        restarts it), rather than the role's own code failing: the call may be made again."""
        from forge.controller import NoHealthyReplica, ReplicaFailed, RequestTimeout

        return self.role in SERVICE_ROLES and isinstance(self.error, (ReplicaFailed, NoHealthyReplica, RequestTimeout))


SERVICE_ROLES = ("policy", "reference", "reward", "reward_model", "env", "rollout")
"""The roles started as services: their replicas restart (``faults``) and the run goes on."""

QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "VLLM_LOGGING_LEVEL": "ERROR",  # any role that imports forge.generation imports vLLM
    "PYTHONWARNINGS": (
        "ignore::FutureWarning,ignore::DeprecationWarning,ignore::UserWarning:multiprocessing.resource_tracker"
    ),
}
"""Every role's environment: libraries' progress bars and notices stay off the terminal unless a
role's own ``env`` says otherwise."""

POLICY_ENV = {**QUIET_ENV, "OMP_NUM_THREADS": "1"}
"""A vLLM policy's environment: one OpenMP thread (more were never faster for small models on
shared cores)."""

ROLE_ENV = "FORGE_GRPO_ROLE"
"""Set to the role's name in each role's processes, so that tools (``ps e``, psutil, the
fault tests) can tell them apart."""

RUN_ENV = "FORGE_RUN"
"""Set to the run's name in the role processes of one run of a multi-adapter job, whose runs each
have a trainer: a dead one's processes are told from the other runs' by it."""


async def call_role(role: str, awaitable: Any) -> Any:
    """Await a call to ``role``; any failure becomes ``RoleFailed`` naming the role."""
    try:
        return await awaitable
    except asyncio.CancelledError:
        raise
    except RoleFailed:
        raise
    except Exception as exc:
        from forge.controller.replica import translate_error

        raise RoleFailed(role, translate_error(exc, role)) from exc
