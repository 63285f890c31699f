"""Models: the tiny test/demo model and the logprob computation shared by trainer and tests."""

from forge.models.logprobs import (
    PaddedBatch,
    RowPacking,
    forward_padding_fraction,
    forward_tokens,
    pack_right_padded,
    pack_rows,
    padded_token_logprobs,
    right_pad,
    sequence_logprobs,
)
from forge.models.tiny import build_char_tokenizer, make_tiny_model

__all__ = [
    "PaddedBatch",
    "build_char_tokenizer",
    "forward_padding_fraction",
    "forward_tokens",
    "make_tiny_model",
    "RowPacking",
    "pack_right_padded",
    "pack_rows",
    "padded_token_logprobs",
    "right_pad",
    "sequence_logprobs",
]
