"""How a trainer step counts its batch: trained sequences and tokens, forward tokens, chunks, masks.

The trainer normalises every micro-batch's loss by the whole step's counts (``Trainer._step``);
these pure helpers compute those counts and lay out per-episode masks, apart from the actor.
"""

from __future__ import annotations

from typing import Any

import torch

from forge.models import PaddedBatch, forward_tokens
from forge.types import Episode

__all__ = ["chunks", "counts", "forward_token_counts", "token_loss_mask"]


def token_loss_mask(episodes: list[Episode], response_mask: torch.Tensor) -> torch.Tensor:
    """The episodes' own per-token loss masks (``Episode.loss_mask``; all-true where None) laid
    out like ``response_mask`` [B, L-1]."""
    pieces = []
    for i, e in enumerate(episodes):
        n = int(e.response_ids.numel())
        if e.loss_mask is None:
            pieces.append(torch.ones(n, dtype=torch.bool))
        elif e.loss_mask.shape != (n,):
            raise ValueError(
                f"episode {i} ({e.group_id}): loss_mask has shape {tuple(e.loss_mask.shape)}, expected ({n},)"
            )
        else:
            pieces.append(e.loss_mask.bool())
    laid_out = torch.zeros_like(response_mask)
    laid_out[response_mask] = torch.cat(pieces)
    return laid_out


def _trained_sequences(batch: PaddedBatch) -> int:
    """Sequences with at least one trained token: what the loss's mean over sequences counts."""
    return int((batch.loss_mask.sum(1) > 0).sum())


def counts(batches: list[PaddedBatch]) -> dict[str, float]:
    """Trained sequences, trained tokens and all rows (trained or not) of ``batches``: the counts a
    loss can be normalised by (``forge.losses.grpo.LOSS_NORMALISERS``; SFT's is ``tokens``)."""
    return {
        "sequences": float(sum(_trained_sequences(b) for b in batches)),
        "tokens": float(sum(int(b.loss_mask.sum()) for b in batches)),
        "rows": float(sum(int(b.loss_mask.shape[0]) for b in batches)),
    }


def forward_token_counts(batches: list[PaddedBatch], pack: bool, row_tokens: int) -> dict[str, float]:
    """Real tokens and all tokens (with padding) the forward passes over ``batches`` compute."""
    real = computed = 0.0
    for batch in batches:
        lengths = [int(n) for n in batch.attention_mask.sum(-1).tolist()]
        real += sum(lengths)
        computed += forward_tokens(lengths, pack, row_tokens)
    return {"forward_real_tokens": real, "forward_tokens": computed}


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[start : start + size] for start in range(0, len(items), size)]
