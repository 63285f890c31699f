"""Supervised fine-tuning: the negative log-likelihood of the answer tokens, prompt tokens masked out.

A pure function of tensors, like the GRPO loss: the trainer actor computes the logprobs of the
answer tokens (``forge.models.padded_token_logprobs`` at temperature 1) and this averages them.
The mean is over every answer token of the batch (not per sequence first), so a long answer
weighs as much as its tokens: the usual SFT objective (TRL's ``SFTTrainer`` with completion-only
loss, torchforge's ``apps/sft``). The trainer weights micro-batches and ranks by their token
counts, so a split batch gives the same loss as one pass.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sft_loss(logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean negative log-likelihood of the masked-in tokens, and detached statistics.

    logprobs: [B, T] logprob of each target token (with grad); mask: [B, T] 1 for answer tokens
    -> (loss [], {"nll": loss detached}). The loss is 0 (with a graph) if no token is masked in.
    """
    if logprobs.shape != mask.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(logprobs.shape)} like logprobs")
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Padding may hold -inf: zero it before the sum, not after (-inf * 0 is NaN).
    total = -torch.where(valid, logprobs, zero).sum()
    loss = total / valid.sum().clamp(min=1)
    return loss, {"nll": loss.detach()}
