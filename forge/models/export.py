"""A trained model as a Hugging Face folder that ``from_pretrained`` and vLLM load as it is."""

from __future__ import annotations

from pathlib import Path

import torch

TIED_HEAD = "lm_head.weight"
"""The output head's name; with ``tie_word_embeddings`` it is the embedding and stored once."""


def write_hf_folder(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, folder: Path) -> None:
    """``config.json``, ``model.safetensors`` (a tied head stored once) and the tokenizer of
    ``source`` into ``folder``: what ``from_pretrained`` and vLLM read."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {k: v.contiguous() for k, v in state.items() if not (tied and k == TIED_HEAD)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
