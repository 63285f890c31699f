"""How a trainer step scores preference pairs: a reward model's scalar scores, or DPO's sequence logprobs.

A micro-batch of ``n`` pairs is padded once into ``2n`` rows, the chosen responses then the
rejected ones, each after its prompt (``pair_rows``). A scalar-head model (``head: scalar``)
scores every row at its last real token (``last_token_scores``); a causal LM gives each row's
summed response logprobs at temperature 1 (the data's own distribution, as SFT). The losses are
``forge.losses.bradley_terry_loss`` and ``forge.losses.dpo_loss``; these pure helpers sit apart
from the actor so the reward-model service scores exactly as the trainer does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forge.actors.trainer_batches import batch_logprobs
from forge.losses import bradley_terry_loss, dpo_loss
from forge.models import PaddedBatch, right_pad
from forge.types import PreferenceBatch

if TYPE_CHECKING:
    from forge.actors.trainer_config import TrainerConfig

__all__ = ["head_outputs", "last_token_scores", "pair_loss", "pair_rows", "scalar_head_model"]


def pair_rows(batch: PreferenceBatch, pad_id: int) -> PaddedBatch:
    """The pairs as ``2n`` right-padded rows: row ``i`` is pair ``i``'s prompt and chosen response,
    row ``n + i`` its prompt and rejected response; the responses are the rows' loss tokens."""
    return right_pad(
        torch.cat([batch.prompt_ids, batch.prompt_ids]),
        torch.cat([batch.prompt_lens, batch.prompt_lens]),
        torch.cat([batch.chosen_ids, batch.rejected_ids]),
        torch.cat([batch.chosen_lens, batch.rejected_lens]),
        pad_id,
    )


def scalar_head_model(model_path: str, dtype: torch.dtype, pad_id: int) -> torch.nn.Module:
    """``model_path`` with ``transformers``' sequence-classification head of one output: a reward
    model. The head is new (random) when the checkpoint is a causal LM's; it is saved with the
    model (``architectures`` names the classification class, so the exported folder loads as one)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the new head's "newly initialized" notice is expected here
    try:
        model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    if model.config.pad_token_id is None:  # transformers refuses a batch without one; scores are read below
        model.config.pad_token_id = pad_id
    model.config.architectures = [type(model).__name__]
    return model


def head_outputs(model: torch.nn.Module, batch: PaddedBatch, device: torch.device) -> torch.Tensor:
    """[B, L] a scalar-head model's output at every position, read from the head itself (its
    pooled ``logits`` hold one position per row): a reward model's score at the last token, a
    critic's value at each (``trainer_values``)."""
    per_position: list[torch.Tensor] = []
    hook = model.score.register_forward_hook(lambda _m, _i, out: per_position.append(out))
    try:
        model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
    finally:
        hook.remove()
    return per_position[0][..., 0]


def last_token_scores(model: torch.nn.Module, batch: PaddedBatch, device: torch.device) -> torch.Tensor:
    """[B] each row's score at its last real token.

    ``transformers`` pools the score at the last token that is not ``pad_token_id``, which is wrong
    for a row that ends with the pad id (an EOS used as padding); so the head's output at every
    position is read (``head_outputs``) and taken at each row's true length."""
    scores = head_outputs(model, batch, device)  # [B, L]
    last = batch.attention_mask.sum(-1).to(device) - 1
    return scores[torch.arange(scores.shape[0], device=device), last].float()


def pair_loss(
    model: torch.nn.Module, examples: PreferenceBatch, padded: PaddedBatch, device: torch.device, cfg: TrainerConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's preference loss: Bradley-Terry on a scalar head's scores, or DPO on a
    causal LM's sequence logprobs against the batch's reference logprobs."""
    n = len(examples)
    if cfg.head == "scalar":
        scores = last_token_scores(model, padded, device)
        return bradley_terry_loss(scores[:n], scores[n:])
    if examples.ref_chosen_logprobs is None or examples.ref_rejected_logprobs is None:
        raise ValueError(
            "a DPO step needs each pair's reference logprobs: PreferenceBatch.pack(examples, ref_logprobs)"
        )
    mask = padded.response_mask.to(device)
    logprobs = batch_logprobs(model, padded, mask, device, cfg, temperature=1.0)
    sums = torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype, device=device)).sum(-1)
    return dpo_loss(
        sums[:n],
        sums[n:],
        examples.ref_chosen_logprobs.to(device, sums.dtype),
        examples.ref_rejected_logprobs.to(device, sums.dtype),
        beta=cfg.dpo_beta,
        kind=cfg.dpo_loss,
    )
