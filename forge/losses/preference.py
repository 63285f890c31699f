"""Losses of preference pairs: a reward model's Bradley-Terry loss and DPO's, pure tensor functions.

A reward model scores each response with one number; the Bradley-Terry model says the chosen
response wins with probability ``sigmoid(r_chosen - r_rejected)``, and the loss is that
probability's negative log (InstructGPT, OpenRLHF's and TRL's ``RewardTrainer``).

DPO (Rafailov et al., 2023) needs no reward model: a response's implicit reward is
``beta * (log pi(y|x) - log pi_ref(y|x))``, the sequence logprobs of the trained and the frozen
reference model, and the loss is Bradley-Terry on those rewards (``sigmoid``) or IPO's squared
distance of their margin from ``1 / (2 beta)`` (Azar et al., 2023), which does not push the
margin to infinity on pairs it already separates.

Both are means over pairs; the trainer weights micro-batches and ranks by their pair counts.
Every statistic returned is a mean over the batch's pairs too: ``accuracy`` is the share of
pairs whose chosen response scores (or, for DPO, is rewarded) above the rejected one.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["DPO_LOSSES", "bradley_terry_loss", "dpo_loss"]

DPO_LOSSES = ("sigmoid", "ipo")


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """``-log sigmoid(chosen - rejected)``, averaged over the pairs, and detached statistics.

    chosen, rejected: [N] the reward model's scores of each pair's two responses (with grad).
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"need one chosen and one rejected score per pair, got {tuple(chosen.shape)}, {tuple(rejected.shape)}"
        )
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    stats = {
        "accuracy": (margin > 0).float().mean(),
        "margin": margin.detach().mean(),
        "chosen_score": chosen.detach().mean(),
        "rejected_score": rejected.detach().mean(),
    }
    return loss, stats


def dpo_loss(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float,
    kind: str = "sigmoid",
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO's loss over the pairs, and detached statistics.

    chosen, rejected: [N] the trained model's sequence logprobs of each pair's responses (with
    grad); ref_chosen, ref_rejected: [N] the reference model's. ``kind``: ``sigmoid`` (DPO) or
    ``ipo``. Statistics: ``accuracy``, ``margin`` (mean reward margin) and the mean implicit
    rewards ``chosen_reward`` and ``rejected_reward``.
    """
    if kind not in DPO_LOSSES:
        raise ValueError(f"DPO loss must be one of {', '.join(DPO_LOSSES)}, got {kind!r}")
    if beta <= 0:
        raise ValueError(f"DPO's beta must be > 0, got {beta}")
    chosen_reward = beta * (chosen - ref_chosen)
    rejected_reward = beta * (rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    if kind == "sigmoid":
        loss = -F.logsigmoid(margin).mean()
    else:  # IPO regresses the log-ratio margin (margin / beta) onto 1 / (2 beta)
        loss = ((margin / beta - 1.0 / (2.0 * beta)) ** 2).mean()
    stats = {
        "accuracy": (margin > 0).float().mean(),
        "margin": margin.detach().mean(),
        "chosen_reward": chosen_reward.detach().mean(),
        "rejected_reward": rejected_reward.detach().mean(),
    }
    return loss, stats
