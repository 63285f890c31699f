"""Environments and multi-turn rollouts: the environment API, its service, token-exact
trajectories and session-affine routing (each module says why it is built the way it is)."""

from forge.envs.base import (
    Action,
    EnvError,
    Environment,
    Observation,
    StepResult,
    UnknownSession,
    check_observation,
    check_step,
    load_environment,
)
from forge.envs.routing import EnvSessionRouter, SessionAffinity, SessionKey
from forge.envs.service import EnvActor, EnvConfig, EnvReply, ResetRequest, StepRequest
from forge.envs.tools import ToolCall, ToolEnvironment, parse_tool_call
from forge.envs.trajectory import Trajectory

__all__ = [
    "Action",
    "EnvActor",
    "EnvConfig",
    "EnvError",
    "EnvReply",
    "EnvSessionRouter",
    "Environment",
    "Observation",
    "ResetRequest",
    "SessionAffinity",
    "SessionKey",
    "StepRequest",
    "StepResult",
    "ToolCall",
    "ToolEnvironment",
    "Trajectory",
    "UnknownSession",
    "check_observation",
    "check_step",
    "load_environment",
    "parse_tool_call",
]
