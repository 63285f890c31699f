"""Payloads shared by the RL roles.

Token ids and logprobs are tensors so that they cross process boundaries as tensors
(``torch.save`` under Monarch), never as Python lists of floats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Prompt:
    """One task instance: the text the policy sees and what a reward function checks."""

    prompt_id: str
    text: str
    answer: str
    meta: dict = field(default_factory=dict)


@dataclass
class Completion:
    """One sampled response to a prompt, with what the trainer needs to correct off-policy data."""

    prompt_ids: torch.Tensor  # int64 [P]
    token_ids: torch.Tensor  # int64 [T], the sampled response tokens
    logprobs: torch.Tensor  # float32 [T], behaviour logprob of each sampled token
    text: str
    policy_version: int
    finish_reason: str = "stop"


@dataclass
class Group:
    """``group_size`` completions of the same prompt: GRPO normalises rewards within it."""

    prompt: Prompt
    completions: list[Completion]

    @property
    def policy_version(self) -> int:
        return min(c.policy_version for c in self.completions)


@dataclass
class Episode:
    """One completion, scored and ready for a training step."""

    group_id: str
    prompt_ids: torch.Tensor  # int64 [P]
    response_ids: torch.Tensor  # int64 [T]
    behaviour_logprobs: torch.Tensor  # float32 [T]
    ref_logprobs: torch.Tensor  # float32 [T]
    reward: float
    advantage: float
    policy_version: int
