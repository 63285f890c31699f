"""Training checkpoints: everything needed to continue a killed run with the same step numbers.

A checkpoint is a folder ``<root>/step_<N>/`` holding

- ``model.safetensors`` — the model's weights (tied tensors stored once),
- ``trainer_state.pt`` — optimizer state, step, policy version, RNG states, extra metadata.

It is written to a temporary folder and renamed into place, so a run killed mid-write leaves
the previous checkpoint intact and never a half-written one; ``latest_checkpoint`` only sees
complete ones. Only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from forge.staging import staged_folder

_MODEL_FILE = "model.safetensors"
_STATE_FILE = "trainer_state.pt"
_PREFIX = "step_"


@dataclass
class TrainingState:
    """What a resumed run needs besides the model's weights."""

    step: int
    policy_version: int
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


def capture_rng() -> dict[str, Any]:
    """The states of Python's, torch's (and CUDA's, if present) random generators."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _unique_tensors(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory (tied embeddings): store each once."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, tensor in state_dict.items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ident in seen:
            aliases[name] = seen[ident]
        else:
            seen[ident] = name
            unique[name] = tensor.detach().contiguous().cpu()
    return unique, aliases


def save_checkpoint(
    root: str | os.PathLike, model_state: dict[str, torch.Tensor], state: TrainingState, *, keep: int = 2
) -> Path:
    """Write ``<root>/step_<state.step>/`` atomically; return its path.

    One writer per ``root``: the temporary folders of earlier, killed saves are removed first.
    """
    if keep < 1:
        raise ValueError(f"save_checkpoint keep must be >= 1, got {keep}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp_*"):  # left by a save that was killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{_PREFIX}{state.step:08d}"
    with staged_folder(final, prefix=".tmp_") as tmp:
        unique, aliases = _unique_tensors(model_state)
        save_file(unique, str(tmp / _MODEL_FILE), metadata={"aliases": repr(aliases)})
        torch.save({**state.__dict__, "aliases": aliases}, tmp / _STATE_FILE)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_PREFIX) and (p / _MODEL_FILE).is_file() and (p / _STATE_FILE).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], TrainingState]:
    """The model state dict (tied names restored) and the training state of one checkpoint.

    Tensors come back on the CPU (a checkpoint written on a GPU loads on a CPU-only machine);
    ``Optimizer.load_state_dict`` moves the optimizer's state to its parameters' device.
    """
    path = Path(path)
    if not (path / _MODEL_FILE).is_file() or not (path / _STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete forge checkpoint (needs {_MODEL_FILE} and {_STATE_FILE})")
    model_state = load_file(str(path / _MODEL_FILE))
    raw = torch.load(path / _STATE_FILE, map_location="cpu", weights_only=False)
    for alias, source in raw.pop("aliases", {}).items():
        model_state[alias] = model_state[source]
    return model_state, TrainingState(**raw)
