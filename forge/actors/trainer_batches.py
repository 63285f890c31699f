"""How a trainer step counts its batch (trained sequences and tokens, forward tokens) and scores it.

The trainer normalises every micro-batch's loss by the whole step's counts (``Trainer._step``);
these pure helpers compute those counts and the model's logprobs of a padded batch, apart from the actor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forge.models import PaddedBatch, forward_tokens, pack_right_padded, padded_token_logprobs

if TYPE_CHECKING:
    from collections.abc import Collection

    from forge.actors.trainer_config import TrainerConfig
    from forge.types import EpisodeBatch

__all__ = ["batch_logprobs", "counts", "forward_token_counts", "laid_out", "pair_logprobs", "trained_tokens"]


def laid_out(flat: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A flat per-response-token tensor laid out like ``response_mask`` [B, L-1] (zeros elsewhere)."""
    out = torch.zeros(response_mask.shape, dtype=flat.dtype)
    out[response_mask] = flat
    return out


def trained_tokens(batch: EpisodeBatch, stop_token_ids: Collection[int], mask_truncated: bool) -> torch.Tensor:
    """Which response tokens of ``batch`` a step trains on, flat like ``response_ids`` (bool).

    A multi-turn batch's own ``loss_mask`` says it (a stop token ends a turn there, not the
    response); otherwise a response trains up to its first stop token and, with
    ``mask_truncated``, not at all when cut at the length limit (``forge.losses.trainable_lengths``).
    The trainer's loss and the PPO controller's advantages both read the mask from here."""
    from forge.losses import trainable_lengths

    if batch.loss_mask is not None:
        return batch.loss_mask.bool()
    keep = trainable_lengths(
        batch.response_ids,
        batch.response_lens,
        batch.finish_reasons or ["stop"] * len(batch),
        stop_token_ids=stop_token_ids,
        mask_truncated=mask_truncated,
    )
    lens = batch.response_lens.long()
    row = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    position = torch.arange(int(lens.sum())) - (lens.cumsum(0) - lens)[row]
    return position < torch.tensor(keep, dtype=torch.long)[row]


def batch_logprobs(
    model: torch.nn.Module,
    batch: PaddedBatch,
    mask: torch.Tensor,
    device: torch.device,
    cfg: TrainerConfig,
    temperature: float | None = None,
) -> torch.Tensor:
    """``model``'s logprobs of a trainer batch's ``mask`` positions, ``[B, L-1]``, with the trainer's
    chunking and packing, at ``temperature`` (the sampler's, ``cfg.temperature``, by default)."""
    return padded_token_logprobs(
        model,
        batch.input_ids.to(device),
        batch.attention_mask.to(device),
        cfg.temperature if temperature is None else temperature,
        positions=mask,  # logits of response tokens only, in chunks
        chunk_tokens=cfg.logprob_chunk_tokens,
        pack=cfg.pack_sequences,
        row_tokens=cfg.pack_row_tokens,
    )


def pair_logprobs(
    model: torch.nn.Module, pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, cfg: TrainerConfig
) -> list[torch.Tensor]:
    """``model``'s per-token logprobs of each ``(prompt_ids, response_ids)`` at the sampler's
    temperature, in eval mode (no dropout): one ``[T]`` each, on the CPU."""
    batch = pack_right_padded([p for p, _ in pairs], [r for _, r in pairs], cfg.pad_id)
    mask = batch.response_mask.to(device)
    model.eval()
    try:
        with torch.no_grad():
            rows = batch_logprobs(model, batch, mask, device, cfg)
    finally:
        model.train()
    return [row[m].cpu() for row, m in zip(rows, mask)]


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
