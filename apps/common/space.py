"""Start-up checks that a run's folders have room for what it will write there.

A full disk found at step 400 costs the run; found at start-up it costs a second. The GRPO and
SFT apps both keep weights for the policy (the file transport) and checkpoints, so both call
these before any role starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_checkpoint_space(trainer: Any, checkpoint_dir: str, model_dir: str | Path) -> None:
    """With ``trainer.checkpoint_every``, fail now unless the checkpoint folder has room for
    ``trainer.keep_checkpoints`` checkpoints plus the one being written (``forge.checkpoint.check_space``)."""
    if not trainer.checkpoint_every:
        return
    import math

    import torch

    from forge.checkpoint import check_space, checkpoint_bytes
    from forge.generation.weight_sync import checkpoint_spec

    numel = sum(math.prod(shape) for shape in checkpoint_spec(model_dir).values())
    element = torch.empty((), dtype=getattr(torch, trainer.dtype)).element_size()
    check_space(checkpoint_dir, checkpoint_bytes(numel, element), trainer.keep_checkpoints)


def check_weight_sync_space(weight_sync: Any, trainer: Any, model_dir: str | Path) -> None:
    """With the file transport, fail now unless the weight folder has room for what the trainer
    will keep there: three copies of the model's weights in ``trainer.publish_dtype`` (a 64 MB
    container ``/dev/shm`` against ~11 GB for Qwen3-1.7B in bf16). A no-op for ``message``."""
    if weight_sync.transport != "file":
        return
    import torch
    from transformers import AutoConfig

    from forge.generation.weight_sync import check_file_transport_space, checkpoint_spec, file_transport_bytes

    config = AutoConfig.from_pretrained(model_dir)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    dtype = getattr(torch, trainer.publish_dtype or trainer.dtype)
    needed = file_transport_bytes(checkpoint_spec(model_dir), dtype, tied=tied)
    check_file_transport_space(weight_sync.root(), needed)
