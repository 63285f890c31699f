"""Per-token logprobs of responses under a Hugging Face causal LM, in one padded forward pass.

The trainer's loss, the reference model and the tests that check vLLM's behaviour logprobs all
need the same quantity: ``log p(response[t] | prompt, response[:t])`` at a sampling
temperature. Computing it in one place keeps the three consistent. The definition is
``log_softmax(logits / temperature)``, which equals vLLM's ``logprobs_mode="processed_logprobs"``
when top-k and top-p are off (with them on, vLLM renormalises over the kept tokens and the
trainer must apply the same mask to match).

Sequences of different lengths are right-padded into one batch. Position ids are computed from
the attention mask, so each sequence sees positions 0, 1, 2, ... whatever the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PaddedBatch", "pack_right_padded", "padded_token_logprobs", "sequence_logprobs"]


@dataclass
class PaddedBatch:
    """Prompt+response pairs right-padded into one batch; the trainer's loss input.

    ``response_mask`` is aligned with the output of ``padded_token_logprobs`` (one column
    shorter than ``input_ids``): column ``j`` is True when token ``j + 1`` is a response token.
    """

    input_ids: torch.Tensor  # int64 [B, L]
    attention_mask: torch.Tensor  # int64 [B, L], 1 for real tokens
    response_mask: torch.Tensor  # bool [B, L - 1]
    prompt_lens: list[int]
    response_lens: list[int]


def pack_right_padded(
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    pad_id: int = 0,
) -> PaddedBatch:
    """Concatenate each prompt with its response and right-pad them to one length.

    Raises ``ValueError`` if the lists differ in length, a tensor is not 1-D, or a prompt is
    empty (the first response token needs at least one token to be predicted from).
    """
    if len(prompt_ids) != len(response_ids):
        raise ValueError(
            f"prompt_ids and response_ids must have the same length, got {len(prompt_ids)} and {len(response_ids)}"
        )
    if not prompt_ids:
        raise ValueError("need at least one prompt/response pair, got none")
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        if p.dim() != 1 or r.dim() != 1:
            raise ValueError(
                f"pair {i}: prompt and response must be 1-D token id tensors, "
                f"got shapes {tuple(p.shape)} and {tuple(r.shape)}"
            )
        if p.numel() == 0:
            raise ValueError(f"pair {i}: prompt is empty; it needs at least one token")

    prompt_lens = [int(p.numel()) for p in prompt_ids]
    response_lens = [int(r.numel()) for r in response_ids]
    length = max(p + r for p, r in zip(prompt_lens, response_lens))
    batch = len(prompt_ids)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    response_mask = torch.zeros((batch, max(length - 1, 0)), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        n_p, n_r = prompt_lens[i], response_lens[i]
        input_ids[i, :n_p] = p.to(torch.long)
        input_ids[i, n_p : n_p + n_r] = r.to(torch.long)
        attention_mask[i, : n_p + n_r] = 1
        # Token at position n_p + t is predicted by column n_p + t - 1.
        response_mask[i, n_p - 1 : n_p - 1 + n_r] = True
    return PaddedBatch(input_ids, attention_mask, response_mask, prompt_lens, response_lens)


def padded_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of every next token in a padded batch, in float32, with gradient.

    Returns ``[B, L - 1]``: column ``j`` is ``log p(input_ids[:, j + 1] | input_ids[:, :j + 1])``
    at ``temperature``. Columns whose target is padding hold meaningless values; mask them
    (``PaddedBatch.response_mask``). Works for left or right padding.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, L], "
            f"got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    # Positions count real tokens only; pads get 0 (their outputs are masked anyway).
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float() / temperature  # [B, L-1, V]
    targets = input_ids[:, 1:].unsqueeze(-1)  # [B, L-1, 1]
    # gather - logsumexp == log_softmax(...).gather, without a second [B, L-1, V] tensor.
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    temperature: float = 1.0,
    pad_id: int = 0,
) -> list[torch.Tensor]:
    """Per-token logprobs of each response given its prompt, without gradient.

    One forward pass over the right-padded batch. Returns one float32 CPU tensor per response,
    of that response's length, ready to travel in an ``Episode`` (e.g. as ``ref_logprobs``).
    """
    batch = pack_right_padded(prompt_ids, response_ids, pad_id)
    device = next(model.parameters()).device
    token_lp = padded_token_logprobs(
        model, batch.input_ids.to(device), batch.attention_mask.to(device), temperature
    ).cpu()
    return [
        token_lp[i, n_p - 1 : n_p - 1 + n_r].clone()
        for i, (n_p, n_r) in enumerate(zip(batch.prompt_lens, batch.response_lens))
    ]
