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
- **Real-model layouts on request** (``LAYOUTS``), because real checkpoints differ in ways
  that broke forge and a tiny default model never showed: a tied checkpoint that still stores
  ``lm_head.weight`` (Qwen3-1.7B), untied embeddings, a 151,936-token vocabulary (Qwen3's,
  where full logits cost ~0.6 MB per token in float32) on a tiny body, and a chat template
  with ``<|im_start|>``/``<|im_end|>`` whose ``<|im_end|>`` is *not* the EOS (a base model's
  layout: only ``policy.stop_token_ids`` stops it there). In a Qwen3-sized vocabulary the chat
  tokens have Qwen3's ids (151644, 151645), so one config's stop ids fit both. Extra vocabulary
  ids decode to ``<|extra_N|>`` and are never produced by encoding.
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
    "CHAT_TEMPLATE",
    "CHAT_TOKENS",
    "EOS_TOKEN",
    "LAYOUTS",
    "QWEN3_CHAT_IDS",
    "QWEN3_VOCAB_SIZE",
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
# Chat-format tokens, appended after the characters (the toy ids above stay the same).
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TOKENS: tuple[str, ...] = (IM_START, IM_END)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_VOCAB_SIZE = 151_936  # Qwen3's embedding rows (its tokenizer has fewer tokens)
QWEN3_CHAT_IDS = (151_644, 151_645)  # <|im_start|>, <|im_end|> in Qwen3's vocabulary
# Named layouts: the keyword arguments of ``make_tiny_model`` that reproduce a real checkpoint's.
LAYOUTS: dict[str, dict] = {
    "tied": {},
    "tied_stored_head": {"store_tied_head": True},
    "untied": {"tie_embeddings": False},
    "big_vocab": {"vocab_size": QWEN3_VOCAB_SIZE},
    "chat": {"arch": "qwen3", "chat_template": True},
    # Everything Qwen3-1.7B's checkpoint has that the default tiny model lacks, at once.
    "qwen3_1_7b": {
        "arch": "qwen3",
        "store_tied_head": True,
        "vocab_size": QWEN3_VOCAB_SIZE,
        "chat_template": True,
    },
}
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


def build_char_tokenizer(*, chat_template: bool = False, vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer: one token per character, lower-cased.

    Unknown characters map to ``<unk>``. No BOS is prepended (as for Qwen), so a prompt's
    token ids are exactly its characters; ``<eos>`` ends every completion. With
    ``chat_template``, ``<|im_start|>`` and ``<|im_end|>`` are special tokens (one id each,
    also inside a prompt string) and ``apply_chat_template`` writes the Qwen chat format.
    ``vocab_size`` pads the vocabulary with ``<|extra_N|>`` tokens up to that many ids.
    """
    chat = CHAT_TOKENS if chat_template else ()
    base = SPECIAL_TOKENS + CHARS
    size = vocab_size or len(base) + len(chat)
    if size < len(base) + len(chat):
        raise ValueError(f"vocab_size must be >= {len(base) + len(chat)} (the tokenizer's own tokens), got {size}")
    tokens = list(base)
    if chat and size > max(QWEN3_CHAT_IDS):
        # Qwen3's own ids, so a config's stop_token_ids mean the same token here and in Qwen3.
        tokens += [f"<|extra_{i}|>" for i in range(size - len(base))]
        for token, token_id in zip(CHAT_TOKENS, QWEN3_CHAT_IDS):
            tokens[token_id] = token
    else:
        tokens += list(chat) + [f"<|extra_{i}|>" for i in range(size - len(base) - len(chat))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("CHARS must not repeat a character or a special token")
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.normalizer = normalizers.Lowercase()
    # Every character (newline included) is its own pre-token, so WordLevel sees single chars.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the pieces with no separator; the default decoder would insert spaces.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS + chat))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=MAX_POSITIONS,
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(
    path: str | os.PathLike,
    *,
    arch: Arch = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    seed: int = 0,
    init_std: float = 0.02,
    tie_embeddings: bool = True,
    store_tied_head: bool = False,
    vocab_size: int | None = None,
    chat_template: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write a random-init tiny causal LM and its tokenizer to ``path``; return the path.

    The layout arguments reproduce real checkpoints (``LAYOUTS`` names the combinations):
    ``tie_embeddings=False`` gives ``lm_head`` its own weights; ``store_tied_head`` writes
    ``lm_head.weight`` into the safetensors file although it is tied (as Qwen3-1.7B does);
    ``vocab_size`` sets the embedding rows (e.g. ``QWEN3_VOCAB_SIZE``); ``chat_template`` adds
    the ``<|im_start|>``/``<|im_end|>`` tokens and template.

    Reuses a complete model already at ``path`` if it was made with the same settings, so test
    fixtures and scripts can call this unconditionally. ``init_std`` is the weights' normal
    init scale: the default 0.02 is the usual one for training; tests that compare greedy
    outputs across implementations use a larger one (e.g. 0.3) so that the top two logits are
    not near-ties that float rounding could swap.

    Raises ``ValueError`` for an unknown ``arch``, a ``hidden_size`` that is not a multiple of
    64, ``store_tied_head`` without tied embeddings, a ``vocab_size`` smaller than the
    tokenizer, or an existing different model at ``path`` without ``overwrite=True``.
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
    if chat_template and arch == "qwen2":
        # transformers >= 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer, whose own
        # byte-level pre-tokenizer drops "\n" from this vocabulary; qwen3 keeps tokenizer.json's.
        raise ValueError("chat_template needs arch='qwen3': transformers re-tokenises qwen2 checkpoints")
    if store_tied_head and not tie_embeddings:
        raise ValueError("store_tied_head needs tie_embeddings=True (an untied head is always stored)")
    tokenizer = build_char_tokenizer(chat_template=chat_template, vocab_size=vocab_size)  # checks vocab_size
    spec = {
        "arch": arch,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "seed": seed,
        "init_std": init_std,
        "vocab": list(SPECIAL_TOKENS + CHARS),
    }
    # Only non-default layout settings enter the marker, so models made before these existed
    # are still recognised as the same model.
    layout = {
        "tie_embeddings": tie_embeddings,
        "store_tied_head": store_tied_head,
        "vocab_size": len(tokenizer) if vocab_size is not None else None,
        "chat_template": chat_template,
    }
    defaults = {"tie_embeddings": True, "store_tied_head": False, "vocab_size": None, "chat_template": False}
    spec.update({k: v for k, v in layout.items() if v != defaults[k]})

    existing = _read_marker(path)
    if existing == spec and not overwrite:
        return path
    if path.exists() and not overwrite:
        what = "a tiny model with other settings" if existing else "an incomplete or foreign model"
        raise ValueError(f"{path} already holds {what}; pass overwrite=True to replace it")

    with staged_folder(path, prefix=f".{path.name}.") as staging:
        _write_model(staging, spec, tokenizer)
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


def _write_model(folder: Path, spec: dict, tokenizer: PreTrainedTokenizerFast) -> None:
    """Build the config, weights and tokenizer described by ``spec`` into ``folder``."""
    hidden = spec["hidden_size"]
    tied = spec.get("tie_embeddings", True)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=hidden // HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=spec["init_std"],
        tie_word_embeddings=tied,
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
    if spec.get("store_tied_head"):
        _store_tied_head(folder / "model.safetensors")
    tokenizer.save_pretrained(folder)
    (folder / _MARKER).write_text(json.dumps(spec, indent=1))


def _store_tied_head(file: Path) -> None:
    """Add ``lm_head.weight`` (a copy of the embedding) to a tied checkpoint, as Qwen3-1.7B has it.

    ``save_pretrained`` leaves a tied head out; some real tied checkpoints store it anyway, and
    every loader (transformers, vLLM, forge's weight sync) must accept that.
    """
    from safetensors.torch import load_file, save_file

    weights = load_file(str(file))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(file), metadata={"format": "pt"})


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
