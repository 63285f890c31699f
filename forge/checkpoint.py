"""Training checkpoints: everything needed to continue a killed run with the same step numbers.

A checkpoint is a folder ``<root>/step_<N>/`` holding

- a ``torch.distributed.checkpoint`` (DCP) of ``{"model": ..., "optimizer": ...}``: each rank
  writes its own shard (``__<rank>_0.distcp``) and rank 0 the ``.metadata`` that maps every
  tensor's global shape to the shards. State dicts come from
  ``torch.distributed.checkpoint.state_dict`` (parameter names, not ids), so a checkpoint loads
  into any world size: 2 ranks -> 1, 1 -> 2.
- ``trainer_state.pt``: step, policy version, every rank's RNG states, the caller's extra state
  (e.g. the dataset position), and the world size it was written by.

Every rank calls ``save_checkpoint``/``load_checkpoint`` (they run collectives when the model is
sharded). The folder is written under a temporary name and renamed into place by rank 0 when
every shard is written, so a run killed mid-write leaves the previous checkpoint intact and never
a half-written one; ``latest_checkpoint`` only sees complete ones. Only the newest ``keep`` are
kept. With more than one host, ``root`` must be on a filesystem every rank shares.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from forge.distributed import SpmdRank, barrier, broadcast_object, gather_objects

__all__ = [
    "TrainingState",
    "capture_rng",
    "checkpoint_shapes",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_checkpoint",
    "restore_rng",
    "save_checkpoint",
]

_METADATA_FILE = ".metadata"  # DCP's, written last by its coordinator (rank 0)
_STATE_FILE = "trainer_state.pt"
_PREFIX = "step_"
_ONE_RANK = SpmdRank(0, 1, 0, "localhost", torch.device("cpu"), None)


@dataclass
class TrainingState:
    """What a resumed run needs besides the model's and optimizer's tensors."""

    step: int
    policy_version: int
    rng: list[dict[str, Any]] = field(default_factory=list)
    """One entry per rank that wrote the checkpoint (``capture_rng()``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1


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


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # An optimizer that has not stepped yet gets its (zero) state made here, so a fresh one can
    # be loaded into.
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _quiet_dcp(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """DCP warns that it assumes one process when no process group exists; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


def save_checkpoint(
    root: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainingState,
    *,
    keep: int = 2,
    where: SpmdRank | None = None,
) -> Path:
    """Write ``<root>/step_<state.step>/`` atomically from every rank; return its path.

    ``state.rng`` is ignored: each rank's current RNG states are captured here. One writer
    (mesh) per ``root``: the temporary folders of earlier, killed saves are removed first.
    """
    where = where or _ONE_RANK
    if keep < 1:
        raise ValueError(f"save_checkpoint keep must be >= 1, got {keep}")
    root = Path(root)
    final = root / f"{_PREFIX}{state.step:08d}"
    staging = None
    if where.is_main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_*"):  # left by a save that was killed mid-write
            shutil.rmtree(stale, ignore_errors=True)
        staging = tempfile.mkdtemp(prefix=".tmp_", dir=root)
    staging = Path(broadcast_object(staging, where))
    try:
        _quiet_dcp(dcp.save, _dcp_state(model, optimizer), checkpoint_id=staging)
        rngs = gather_objects(capture_rng(), where)
        if where.is_main:
            saved = TrainingState(state.step, state.policy_version, rngs, dict(state.extra), where.world_size)
            torch.save(saved.__dict__, staging / _STATE_FILE)
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            for old in list_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if where.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    barrier(where)  # no rank returns before the checkpoint is in place
    return final


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and _complete(p)]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def _complete(path: Path) -> bool:
    return (path / _METADATA_FILE).is_file() and (path / _STATE_FILE).is_file()


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def _check_complete(path: Path) -> None:
    if not _complete(path):
        raise FileNotFoundError(
            f"{path} is not a complete forge checkpoint (needs DCP's {_METADATA_FILE} and {_STATE_FILE})"
        )


def read_training_state(path: str | os.PathLike) -> TrainingState:
    """The step, version, RNG states and extra state of one checkpoint (no tensors loaded)."""
    path = Path(path)
    _check_complete(path)
    return TrainingState(**torch.load(path / _STATE_FILE, map_location="cpu", weights_only=False))


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Global shape of every model tensor in a checkpoint, by parameter name (from DCP's metadata)."""
    path = Path(path)
    _check_complete(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefix = "model."
    return {
        name[len(prefix) :]: tuple(meta.size)
        for name, meta in metadata.state_dict_metadata.items()
        if name.startswith(prefix) and hasattr(meta, "size")
    }


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    where: SpmdRank | None = None,
) -> TrainingState:
    """Load a checkpoint into ``model`` and ``optimizer`` (resharded to this mesh) on every rank,
    restore this rank's RNG states, and return the training state.

    A rank restores the RNG states its own rank saved; a rank the writer did not have (1 -> 2)
    takes rank 0's. The optimizer's hyperparameters are the checkpoint's: callers that allow
    changing them on resume set them afterwards.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    where = where or _ONE_RANK
    path = Path(path)
    training = read_training_state(path)
    state = _dcp_state(model, optimizer)
    _quiet_dcp(dcp.load, state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if training.rng:
        restore_rng(training.rng[where.rank] if where.rank < len(training.rng) else training.rng[0])
    return training


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any], TrainingState]:
    """A checkpoint's full model state dict, optimizer state dict and training state, in one
    process and without a model (inspection, tests, tools).

    Optimizer state is keyed by parameter name: ``optimizer["state"]["lm_head.weight"]["exp_avg"]``.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    training = read_training_state(path)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "full.pt")
        _quiet_dcp(dcp_to_torch_save, str(path), out)
        full = torch.load(out, map_location="cpu", weights_only=False)
    return full["model"], full["optimizer"], training
