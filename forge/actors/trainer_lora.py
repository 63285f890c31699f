"""The trainer's LoRA parts: the adapter's weights, its published folders, its export, and the base.

With ``TrainerConfig.lora`` set the trainer's model is a PEFT model (``forge.models.lora.inject``,
before FSDP2 shards it) whose base is frozen, and these helpers replace the full-weight paths:

- ``adapter_weights``: the adapter alone, gathered on rank 0 under PEFT's file names, so the
  weight sync moves the adapter's bytes and nothing else;
- ``AdapterFolders``: the file transport for adapters, one PEFT folder per version (written
  under a temporary name and renamed, so a policy never sees half of one), the newest
  ``KEEP`` kept, so a policy replica that lags a version or two still finds the one it was told;
- ``export_lora``: the final adapter folder and the base with it merged in;
- ``base_logprobs``: the base model's logprobs, the adapter switched off (PEFT's
  ``disable_adapter``): GRPO's reference without a reference model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from forge.actors.trainer_batches import batch_logprobs, pair_logprobs
from forge.distributed import SpmdRank, full_state_dict
from forge.models import PaddedBatch
from forge.models.lora import LoraSettings, adapter_tensors, export_merged, write_adapter_folder
from forge.staging import staged_folder

if TYPE_CHECKING:
    from forge.actors.trainer_config import TrainerConfig

__all__ = [
    "KEEP",
    "AdapterFolders",
    "adapter_weights",
    "base_logprobs",
    "base_model_off",
    "export_lora",
    "pair_base_logprobs",
]

KEEP = 3
"""Adapter folders the file transport keeps (as ``WeightFiles`` keeps three weight files)."""
_PREFIX = "adapter-v"


def adapter_weights(
    model: torch.nn.Module, rank: SpmdRank, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The adapter's tensors on rank 0 (PEFT's names, CPU, ``dtype`` if given); ``{}`` elsewhere.
    A collective: every rank calls it. Only trainable tensors are gathered."""
    state = full_state_dict(model, rank, trainable_only=True)
    if not rank.is_main:
        return {}
    tensors = adapter_tensors(model, state)
    return {k: (v.to(dtype) if dtype is not None else v).cpu() for k, v in tensors.items()}


class AdapterFolders:
    """Versioned adapter folders under one folder: ``adapter-v<version>-<random>/`` each."""

    def __init__(self, folder: str | Path, settings: LoraSettings, base_model: str) -> None:
        self.folder = Path(folder)
        self.settings = settings
        self.base_model = base_model
        self._written: list[Path] = []

    def write(self, tensors: dict[str, torch.Tensor], version: int) -> str:
        """Write one version's adapter folder; return its path. Older ones past ``KEEP`` go."""
        self.folder.mkdir(parents=True, exist_ok=True)
        # A random part: a trainer restarted from a checkpoint writes a version number again,
        # with other weights; its folder must be a new path (the policy keys adapters by load).
        final = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{version}-", dir=self.folder))
        staging = final.with_name(f".tmp-{final.name}")
        try:
            write_adapter_folder(staging, tensors, self.settings, self.base_model)
            os.replace(staging, final)  # replaces the empty folder: readers see all of it or none
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)
            raise
        self._written.append(final)
        while len(self._written) > KEEP:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return str(final)

    def close(self) -> None:
        """Remove every folder this writer made."""
        for path in self._written:
            shutil.rmtree(path, ignore_errors=True)
        self._written.clear()


def export_lora(model: torch.nn.Module, rank: SpmdRank, settings: LoraSettings, base_model: str, folder: Path) -> None:
    """Rank 0 writes ``folder`` as the merged Hugging Face model and ``folder/adapter`` as the
    PEFT adapter folder, all at once (``staged_folder``); every rank calls it (the adapter is
    gathered)."""
    tensors = adapter_weights(model, rank)
    if rank.is_main:
        with staged_folder(folder, prefix=".tmp_export_") as tmp:
            export_merged(base_model, settings, tensors, merged=tmp, adapter=tmp / "adapter")


@contextmanager
def base_model_off(model: torch.nn.Module) -> Iterator[None]:
    """The adapter switched off and no gradient: inside, ``model`` computes the frozen base's outputs."""
    with model.disable_adapter(), torch.no_grad():
        yield


def base_logprobs(
    model: torch.nn.Module, batch: PaddedBatch, mask: torch.Tensor, device: torch.device, cfg: TrainerConfig
) -> torch.Tensor:
    """The frozen base's logprobs of a trainer batch at the sampler's temperature, ``[B, L-1]``
    like the loss's (``batch_logprobs`` with the adapter off)."""
    with base_model_off(model):
        return batch_logprobs(model, batch, mask, device, cfg)


def pair_base_logprobs(
    model: torch.nn.Module, pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, cfg: TrainerConfig
) -> list[torch.Tensor]:
    """The frozen base's per-token logprobs of each ``(prompt_ids, response_ids)``: one ``[T]`` each."""
    with base_model_off(model):  # no dropout in the adapter's path (it is off) or anywhere else: eval mode
        return pair_logprobs(model, pairs, device, cfg)
