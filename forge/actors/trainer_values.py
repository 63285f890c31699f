"""How a critic (a scalar-head trainer, ``head: scalar``) reads a value at every response token
and is trained on PPO's returns.

The head's output is read at every position, as ``trainer_pairs.last_token_scores`` reads it at
the last one; the value of position ``j`` is the critic's estimate before token ``j + 1`` is
sampled, so the values line up with the logprobs (``PaddedBatch.response_mask``). Pure helpers,
apart from the actor, as ``trainer_pairs``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forge.actors.trainer_batches import laid_out
from forge.losses.ppo import value_loss
from forge.models import PaddedBatch

if TYPE_CHECKING:
    from forge.actors.trainer_config import TrainerConfig
    from forge.types import EpisodeBatch

__all__ = ["critic_loss", "position_values"]


def position_values(model: torch.nn.Module, batch: PaddedBatch, device: torch.device) -> torch.Tensor:
    """[B, L-1] the head's value at each position but the last (the state before each next token)."""
    from forge.actors.trainer_pairs import head_outputs

    return head_outputs(model, batch, device)[:, :-1].float()


def critic_loss(
    model: torch.nn.Module, batch: EpisodeBatch, padded: PaddedBatch, device: torch.device, cfg: TrainerConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's clipped value loss against the batch's ``returns`` (``forge.losses.ppo.value_loss``)."""
    if batch.returns is None or batch.values is None:
        raise ValueError(
            "a critic step needs each token's return and old value: the batch's returns and values "
            "(forge.losses.ppo.gae makes them: dataclasses.replace(batch, returns=..., values=...))"
        )
    values = position_values(model, padded, device)
    response = padded.response_mask
    return value_loss(
        values,
        laid_out(batch.values, response).to(device, values.dtype),
        laid_out(batch.returns, response).to(device, values.dtype),
        padded.loss_mask.to(device),
        clip=cfg.value_clip,
    )
