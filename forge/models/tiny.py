"""A tiny random-init causal LM with a character-level tokenizer, for tests and CPU demos.

Why it exists: the RL loop (vLLM generation, weight sync, GRPO loss) has to run end to end on
a laptop CPU and in CI, where no model hub can be reached. A 0.3 M-parameter Qwen2 (or Qwen3)
written to disk in the standard Hugging Face layout loads unchanged in ``transformers`` and in
vLLM, so the same code paths serve the tiny model and a real one.

Choices that matter:

- **Character-level vocabulary of 64 tokens.** The toy task is ``3+7=`` -> ``333777``; every
  digit and operator is one token, so the policy learns the task in a few hundred steps instead
  of first learning a BPE segmentation. 64 is also vLLM's vocabulary padding unit.
- **head_dim 64.** vLLM's CPU attention kernels support only some head sizes; 64 is the smallest.
- **Tied embeddings**, as in small Qwen checkpoints. ``save_pretrained`` then writes no
  ``lm_head.weight``; weight sync must add it back (see ``forge.generation.weight_sync``).
- **Idempotent and atomic.** The model is written to a temporary sibling folder and renamed, so
  concurrent test workers never see half a model; a complete model with the same settings is
  reused.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from forge.staging import staged_folder

__all__ = [
    "ARCHS",
    "BOS_TOKEN",
    "CHARS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "UNK_TOKEN",
    "build_char_tokenizer",
    "make_tiny_model",
]

Arch = Literal["qwen2", "qwen3"]
ARCHS: tuple[str, ...] = ("qwen2", "qwen3")

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
# Order fixes the ids: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then the characters.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARS: tuple[str, ...] = tuple(
    "0123456789"  # digits: the toy arithmetic task
    " +-*=/"  # operators and space
    "abcdefghijklmnopqrstuvwxyz"  # text is lower-cased by the tokenizer's normalizer
    ".,:;?!()[]<>_#'\"%\n"
)
HEAD_DIM = 64  # the smallest head size vLLM's CPU attention supports
MAX_POSITIONS = 2048
# Written last: its presence (with matching settings) is what makes a model "complete".
_MARKER = "forge_tiny_model.json"
_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer: one token per character, lower-cased.

    Unknown characters map to ``<unk>``. No BOS is prepended (as for Qwen), so a prompt's
    token ids are exactly its characters; ``<eos>`` ends every completion.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    if len(vocab) != len(SPECIAL_TOKENS) + len(CHARS):
        raise ValueError("CHARS must not repeat a character or a special token")
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.Lowercase()
    # Every character (newline included) is its own pre-token, so WordLevel sees single chars.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the pieces with no separator; the default decoder would insert spaces.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=MAX_POSITIONS,
    )


def make_tiny_model(
    path: str | os.PathLike,
    *,
    arch: Arch = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    seed: int = 0,
    init_std: float = 0.02,
    overwrite: bool = False,
) -> Path:
    """Write a random-init tiny causal LM and its tokenizer to ``path``; return the path.

    Reuses a complete model already at ``path`` if it was made with the same settings, so test
    fixtures and scripts can call this unconditionally. ``init_std`` is the weights' normal
    init scale: the default 0.02 is the usual one for training; tests that compare greedy
    outputs across implementations use a larger one (e.g. 0.3) so that the top two logits are
    not near-ties that float rounding could swap.

    Raises ``ValueError`` for an unknown ``arch``, a ``hidden_size`` that is not a multiple of
    64, or an existing different model at ``path`` without ``overwrite=True``.
    """
    path = Path(path)
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if hidden_size <= 0 or hidden_size % HEAD_DIM:
        raise ValueError(
            f"hidden_size must be a positive multiple of {HEAD_DIM} (vLLM CPU head size), got {hidden_size}"
        )
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not init_std > 0:
        raise ValueError(f"init_std must be > 0, got {init_std}")
    spec = {
        "arch": arch,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "seed": seed,
        "init_std": init_std,
        "vocab": list(SPECIAL_TOKENS + CHARS),
    }

    existing = _read_marker(path)
    if existing == spec and not overwrite:
        return path
    if path.exists() and not overwrite:
        what = "a tiny model with other settings" if existing else "an incomplete or foreign model"
        raise ValueError(f"{path} already holds {what}; pass overwrite=True to replace it")

    with staged_folder(path, prefix=f".{path.name}.") as staging:
        _write_model(staging, spec)
    return path


def _read_marker(path: Path) -> dict | None:
    """The settings of a complete tiny model at ``path``, or None if there is none."""
    marker = path / _MARKER
    if not marker.is_file() or not all((path / f).is_file() for f in _FILES):
        return None
    try:
        return json.loads(marker.read_text())
    except json.JSONDecodeError:
        return None


def _write_model(folder: Path, spec: dict) -> None:
    """Build the config, weights and tokenizer described by ``spec`` into ``folder``."""
    tokenizer = build_char_tokenizer()
    hidden = spec["hidden_size"]
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=hidden // HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=spec["init_std"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if spec["arch"] == "qwen3":
        config = Qwen3Config(head_dim=HEAD_DIM, **common)
    else:
        config = Qwen2Config(**common)

    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _quiet_progress_bars():
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / _MARKER).write_text(json.dumps(spec, indent=1))


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' one-shard "Writing model shards" bar, which floods test logs."""
    hf_logging = transformers.utils.logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
