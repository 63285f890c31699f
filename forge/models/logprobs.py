"""Per-token logprobs of responses under a Hugging Face causal LM, in one padded forward pass.

The trainer's loss, the reference model and the tests that check vLLM's behaviour logprobs all
need the same quantity: ``log p(response[t] | prompt, response[:t])`` at a sampling
temperature. Computing it in one place keeps the three consistent. The definition is
``log_softmax(logits / temperature)``, which equals vLLM's ``logprobs_mode="processed_logprobs"``
when top-k and top-p are off (with them on, vLLM renormalises over the kept tokens and the
trainer must apply the same mask to match).

Sequences of different lengths are right-padded into one batch. Position ids are computed from
the attention mask, so each sequence sees positions 0, 1, 2, ... whatever the padding.

With ``pack=True`` the sequences are packed into rows instead (``pack_rows``): first-fit
decreasing into rows of ``row_tokens`` (by default twice the longest sequence), each sequence
with its own positions 0, 1, 2, ..., and attention kept inside each sequence (Hugging Face
builds a block-diagonal causal mask from position ids that restart, when no attention mask is
given). Sequences share rows, so the forward computes almost no padding. The logprobs are laid out as
without packing, and equal them to float rounding.

Memory is bounded by tokens, not by the batch: the model's forward pass keeps only one position
of logits (``logits_to_keep=1``), and the head is applied to the decoder's hidden states of the
wanted positions (``positions``, e.g. the response tokens) ``chunk_tokens`` rows at a time. So the
full ``[B, L, V]`` logits never exist, in float32 or otherwise: at Qwen3's 151,936-token
vocabulary they cost ~0.6 MB per token, 68 GB for 64 sequences of 700 tokens. With gradient each
chunk is checkpointed (``torch.utils.checkpoint``): backward recomputes one chunk's logits at a
time instead of keeping every chunk's for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from forge.checks import check_int

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "PaddedBatch",
    "RowPacking",
    "pack_right_padded",
    "right_pad",
    "first_fit_rows",
    "forward_padding_fraction",
    "forward_tokens",
    "pack_rows",
    "padded_token_logprobs",
    "sequence_logprobs",
]

PACK_ROW_FACTOR = 2
"""A packed row's default length, in longest sequences: rows as long as the longest would leave
every sequence longer than half of it alone in its row (and as much padding as without packing);
twice that fills rows, while each token attends over at most twice as many (masked) keys, which
costs little next to the projections and the MLP at the lengths of RL batches."""

DEFAULT_CHUNK_TOKENS = 512
"""Rows of logits computed at once: 512 x 151,936 x 4 bytes = 311 MB at Qwen3's vocabulary."""


@dataclass
class PaddedBatch:
    """Prompt+response pairs right-padded into one batch; the trainer's loss input.

    ``response_mask`` is aligned with the output of ``padded_token_logprobs`` (one column
    shorter than ``input_ids``): column ``j`` is True when token ``j + 1`` is a response token.
    ``loss_mask`` marks the response tokens a loss trains on: the first ``loss_lens[b]`` of each
    response (all of them unless ``pack_right_padded`` was given ``loss_lens``).
    """

    input_ids: torch.Tensor  # int64 [B, L]
    attention_mask: torch.Tensor  # int64 [B, L], 1 for real tokens
    response_mask: torch.Tensor  # bool [B, L - 1]
    prompt_lens: list[int]
    response_lens: list[int]
    loss_mask: torch.Tensor | None = None  # bool [B, L - 1], a subset of response_mask

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.response_mask


def pack_right_padded(
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    pad_id: int = 0,
    loss_lens: Sequence[int] | None = None,
) -> PaddedBatch:
    """Concatenate each prompt with its response and right-pad them to one length (``right_pad``
    of the pieces joined).

    Raises ``ValueError`` if the lists differ in length or a tensor is not 1-D, and as ``right_pad``.
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
    return right_pad(
        torch.cat([p.long() for p in prompt_ids]),
        [int(p.numel()) for p in prompt_ids],
        torch.cat([r.long() for r in response_ids]),
        [int(r.numel()) for r in response_ids],
        pad_id,
        loss_lens,
    )


def right_pad(
    prompt_ids: torch.Tensor,
    prompt_lens: Sequence[int] | torch.Tensor,
    response_ids: torch.Tensor,
    response_lens: Sequence[int] | torch.Tensor,
    pad_id: int = 0,
    loss_lens: Sequence[int] | torch.Tensor | None = None,
) -> PaddedBatch:
    """Right-padded prompt+response rows straight from flat tensors (prompt after prompt,
    response after response, as a packed batch holds them), with a few tensor operations
    whatever the batch's size.

    ``loss_lens`` (e.g. from ``forge.losses.trainable_lengths``) limits ``loss_mask`` to each
    response's first ``loss_lens[b]`` tokens. Raises ``ValueError`` if the lengths do not fit the
    flat tensors, a prompt is empty (the first response token needs at least one token to be
    predicted from) or a loss length is outside ``[0, response length]``.
    """
    p_lens = torch.as_tensor(prompt_lens, dtype=torch.long)
    r_lens = torch.as_tensor(response_lens, dtype=torch.long)
    if p_lens.numel() != r_lens.numel() or p_lens.numel() == 0:
        raise ValueError(
            f"need one prompt per response and at least one pair, got {p_lens.numel()} and {r_lens.numel()}"
        )
    if int(p_lens.sum()) != prompt_ids.numel() or int(r_lens.sum()) != response_ids.numel():
        raise ValueError(
            f"prompt and response lengths add up to {int(p_lens.sum())} and {int(r_lens.sum())} tokens, "
            f"but the flat tensors hold {prompt_ids.numel()} and {response_ids.numel()}"
        )
    empty = torch.nonzero(p_lens == 0).flatten()
    if empty.numel():
        raise ValueError(f"pair {int(empty[0])}: prompt is empty; it needs at least one token")
    total = p_lens + r_lens
    columns = torch.arange(int(total.max()))[None, :]
    in_prompt = columns < p_lens[:, None]
    real = columns < total[:, None]
    in_response = real & ~in_prompt
    input_ids = torch.full(real.shape, pad_id, dtype=torch.long)
    # Boolean indexing walks row by row: the flat tensors' order, piece after piece.
    input_ids[in_prompt] = prompt_ids.long()
    input_ids[in_response] = response_ids.long()
    # Token at position n_p + t is predicted by column n_p + t - 1.
    response_mask = in_response[:, 1:]
    loss_mask = None
    if loss_lens is not None:
        keep = torch.as_tensor(loss_lens, dtype=torch.long)
        if keep.numel() != r_lens.numel():
            raise ValueError(f"loss_lens has {keep.numel()} entries for {r_lens.numel()} responses")
        bad = torch.nonzero((keep < 0) | (keep > r_lens)).flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"loss_lens[{i}] is {int(keep[i])}, expected 0..{int(r_lens[i])} (the response's length)")
        loss_mask = (in_response & (columns < (p_lens + keep)[:, None]))[:, 1:]
    return PaddedBatch(
        input_ids,
        real.long(),
        response_mask.contiguous(),
        p_lens.tolist(),
        r_lens.tolist(),
        None if loss_mask is None else loss_mask.contiguous(),
    )


@dataclass(frozen=True)
class RowPacking:
    """Sequences of a right-padded batch packed into rows: sequence ``b`` is at
    ``input_ids[row[b], offset[b] : offset[b] + length[b]]`` with positions ``0 .. length[b] - 1``."""

    input_ids: torch.Tensor  # int64 [R, C]
    position_ids: torch.Tensor  # int64 [R, C]
    row: torch.Tensor  # int64 [B]
    offset: torch.Tensor  # int64 [B]
    length: torch.Tensor  # int64 [B]

    @property
    def padding_fraction(self) -> float:
        """Pad tokens / all tokens the forward computes."""
        return 1.0 - float(self.length.sum()) / max(self.input_ids.numel(), 1)


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int = 0, row_tokens: int = 0
) -> RowPacking:
    """Pack a right-padded batch's sequences into as few rows of ``row_tokens`` as first-fit
    decreasing finds (``first_fit_rows``; 0: twice the longest sequence). The end of a row that
    no sequence fills holds ``pad_id`` tokens whose positions restart at 0, so they are a
    segment of their own that no real token attends to. Raises ``ValueError`` for a batch that
    is not right-padded."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, L], got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    device = input_ids.device
    lengths = attention_mask.long().sum(-1)  # [B]
    columns = torch.arange(attention_mask.shape[1], device=device)
    if not bool((attention_mask.long() == (columns < lengths[:, None]).long()).all()):
        raise ValueError("pack_rows needs a right-padded batch (each row's real tokens first, then padding)")
    sizes = [int(n) for n in lengths.tolist()]
    row, offset, rows, capacity = first_fit_rows(sizes, row_tokens)
    ids = torch.full((rows, capacity), pad_id, dtype=torch.long, device=device)
    positions = torch.zeros((rows, capacity), dtype=torch.long, device=device)
    used = [0] * rows
    for b, (r, o, n) in enumerate(zip(row, offset, sizes)):
        ids[r, o : o + n] = input_ids[b, :n]
        positions[r, o : o + n] = torch.arange(n, device=device)
        used[r] = max(used[r], o + n)
    for r, end in enumerate(used):
        positions[r, end:] = torch.arange(capacity - end, device=device)
    row_t, offset_t = (torch.tensor(v, dtype=torch.long, device=device) for v in (row, offset))
    return RowPacking(ids, positions, row_t, offset_t, lengths)


def first_fit_rows(lengths: Sequence[int], row_tokens: int = 0) -> tuple[list[int], list[int], int, int]:
    """First-fit decreasing of sequence ``lengths`` into rows of ``row_tokens`` (at least the
    longest sequence; 0: ``PACK_ROW_FACTOR`` times it): each sequence's row and offset, the
    number of rows and their length."""
    check_int(f"row_tokens (0: {PACK_ROW_FACTOR}x the longest)", row_tokens, 0)
    longest = max(max(lengths, default=1), 1)
    capacity = max(longest, row_tokens or PACK_ROW_FACTOR * longest)
    room: list[int] = []
    row, offset = [0] * len(lengths), [0] * len(lengths)
    for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((i for i, left in enumerate(room) if left >= lengths[b]), len(room))
        if r == len(room):
            room.append(capacity)
        row[b], offset[b] = r, capacity - room[r]
        room[r] -= lengths[b]
    return row, offset, len(room), capacity


def forward_tokens(lengths: Sequence[int], pack: bool = False, row_tokens: int = 0) -> int:
    """Tokens, padding included, that a forward over sequences of ``lengths`` computes:
    right-padded to the longest, or packed into rows (``pack_rows``)."""
    if not lengths:
        return 0
    if pack:
        _, _, rows, capacity = first_fit_rows(lengths, row_tokens)
        return rows * capacity
    return len(lengths) * max(lengths)


def forward_padding_fraction(lengths: Sequence[int], pack: bool = False, row_tokens: int = 0) -> float:
    """Pad tokens / all tokens a forward over sequences of ``lengths`` computes (``forward_tokens``)."""
    return 1.0 - sum(lengths) / max(forward_tokens(lengths, pack, row_tokens), 1)


def padded_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    positions: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    pack: bool = False,
    row_tokens: int = 0,
) -> torch.Tensor:
    """Logprob of every next token in a padded batch, in float32, with gradient.

    Returns ``[B, L - 1]``: column ``j`` is ``log p(input_ids[:, j + 1] | input_ids[:, :j + 1])``
    at ``temperature``. Only the columns in ``positions`` (bool ``[B, L - 1]``, e.g.
    ``PaddedBatch.response_mask``; None: all of them) are computed; the others hold 0. Columns
    whose target is padding hold meaningless values: mask them. Logits are computed
    ``chunk_tokens`` rows at a time (module docstring). Works for left or right padding;
    ``pack=True`` (right padding only) runs the forward on the sequences packed into rows of
    ``row_tokens`` (``pack_rows``) instead of the padded batch, with the same result.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, L], "
            f"got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    check_int("chunk_tokens", chunk_tokens, 1)
    batch, length = input_ids.shape
    if positions is None:
        positions = torch.ones((batch, max(length - 1, 0)), dtype=torch.bool, device=input_ids.device)
    elif positions.shape != (batch, max(length - 1, 0)):
        raise ValueError(f"positions must be [B, L - 1] = {(batch, length - 1)}, got {tuple(positions.shape)}")
    positions = positions.to(device=input_ids.device, dtype=torch.bool)
    if pack:
        packing = pack_rows(input_ids, attention_mask, row_tokens=row_tokens)
        hidden = _final_hidden_states(model, packing.input_ids, None, packing.position_ids)  # [R, C, H]
        seq, col = positions.nonzero(as_tuple=True)  # the order of boolean indexing below
        flat = packing.row[seq] * packing.input_ids.shape[1] + packing.offset[seq] + col
        rows = hidden.reshape(-1, hidden.shape[-1])[flat]  # [N, H]
    else:
        hidden = _final_hidden_states(model, input_ids, attention_mask)  # [B, L, H]
        rows = hidden[:, :-1][positions]  # [N, H]: only the wanted positions reach the head
    head = model.get_output_embeddings()
    targets = input_ids[:, 1:][positions]  # [N]
    pieces = []
    for start in range(0, rows.shape[0], chunk_tokens):
        h, t = rows[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            # Backward recomputes this chunk's logits instead of keeping them.
            pieces.append(checkpoint(_chunk_logprobs, head, h, t, temperature, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(head, h, t, temperature))
    values = torch.cat(pieces) if pieces else hidden.new_zeros((0,), dtype=torch.float32)
    out = torch.zeros(positions.shape, dtype=torch.float32, device=hidden.device)
    return out.masked_scatter(positions, values)  # differentiable in ``values``


def _chunk_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``log_softmax(head(hidden) / T)`` at ``targets``: [c, H], [c] -> [c] float32."""
    logits = head(hidden).float() / temperature  # [c, V]
    # gather - logsumexp == log_softmax(...).gather, without a second [c, V] tensor.
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _final_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder's output (what the head reads), from the model's own forward pass.

    The pass goes through ``model(...)``, not ``model.get_decoder()`` directly, so wrappers'
    hooks on the root module (FSDP2's unshard) run as usual; a hook on the decoder catches its
    output, and ``logits_to_keep=1`` keeps the forward's own logits to one position. Without an
    attention mask, ``position_ids`` that restart mark packed sequences (``pack_rows``).
    """
    captured: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, _args: object, output: object) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    if position_ids is None:  # positions count real tokens only; pads get 0 (their outputs are masked anyway)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    handle = model.get_decoder().register_forward_hook(keep)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **extra)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected the decoder of {type(model).__name__} to run once, it ran {len(captured)} times")
    return captured[0]


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module,
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    temperature: float = 1.0,
    pad_id: int = 0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    pack: bool = False,
    row_tokens: int = 0,
) -> list[torch.Tensor]:
    """Per-token logprobs of each response given its prompt, without gradient.

    One forward pass over the right-padded batch (or, with ``pack``, over the sequences packed
    into rows); logits only for response tokens, in chunks.
    Returns one float32 CPU tensor per response, of that response's length, ready to travel in
    an ``Episode`` (e.g. as ``ref_logprobs``).
    """
    batch = pack_right_padded(prompt_ids, response_ids, pad_id)
    device = next(model.parameters()).device
    token_lp = padded_token_logprobs(
        model,
        batch.input_ids.to(device),
        batch.attention_mask.to(device),
        temperature,
        positions=batch.response_mask.to(device),
        chunk_tokens=chunk_tokens,
        pack=pack,
        row_tokens=row_tokens,
    ).cpu()
    return [
        token_lp[i, n_p - 1 : n_p - 1 + n_r].clone()
        for i, (n_p, n_r) in enumerate(zip(batch.prompt_lens, batch.response_lens))
    ]
