"""Training checkpoints: everything needed to continue a killed run with the same step numbers.

A checkpoint is a folder ``<root>/step_<N>/`` holding

- a ``torch.distributed.checkpoint`` (DCP) of ``{"model": ..., "optimizer": ...}``: each rank
  writes its own shard (``__<rank>_0.distcp``) and rank 0 the ``.metadata`` that maps every
  tensor's global shape to the shards. State dicts come from
  ``torch.distributed.checkpoint.state_dict`` (parameter names, not ids), so a checkpoint loads
  into any world size: 2 ranks -> 1, 1 -> 2.
  A model with frozen parameters (a LoRA adapter over a frozen base) is checkpointed by its
  trainable tensors and their optimizer state alone; the base is the model's own checkpoint.
- ``trainer_state.pt``: step, policy version, every rank's RNG states, the caller's extra state
  (e.g. the dataset position), and the world size it was written by.

**Loading a checkpoint runs no code from it**, although both formats are pickles: a checkpoint
folder may come from someone else (a shared filesystem, a downloaded run). ``trainer_state.pt``
loads with ``torch.load(weights_only=True)``: it holds tensors, numbers, strings, lists, tuples
and dicts only, and ``start_checkpoint`` refuses ``extra`` state that would not load that way
(checkpoints of earlier forge versions are in that form already). DCP's files are read through
``forge.unpickling``'s allowlists. A file that needs anything else is ``UnsafeCheckpoint``,
naming the file; nothing in it has run. A training state that a user's own script wrote with
other types in ``extra`` (numpy values) converts once: ``python -m forge.checkpoint convert PATH``.

Every rank calls ``write_checkpoint``/``load_checkpoint`` (they run collectives when the model is
sharded). The folder is written under a temporary name (``forge.staging.staged_folder``, on rank
0) and renamed into place by rank 0 when every shard is written, so a run killed mid-write leaves
the previous checkpoint intact and never a half-written one; ``latest_checkpoint`` only sees
complete ones. Only the newest ``keep`` are kept. With more than one host, ``root`` must be on a
filesystem every rank shares.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from forge.checkpoint_space import check_space, checkpoint_bytes, no_room
from forge.distributed import SpmdRank, barrier, broadcast_object, gather_objects
from forge.staging import staged_folder
from forge.unpickling import (
    PlainFullPlanner,
    PlainLoadPlanner,
    PlainReader,
    UnsafeCheckpoint,
    check_plain,
    plain_load,
    plain_values,
)

__all__ = [
    "TrainingState",
    "UnsafeCheckpoint",
    "capture_rng",
    "check_fits",
    "check_space",
    "checkpoint_bytes",
    "checkpoint_shapes",
    "convert_training_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "model_shapes",
    "read_checkpoint",
    "read_training_state",
    "restore_rng",
    "PendingCheckpoint",
    "write_checkpoint",
    "start_checkpoint",
]

logger = logging.getLogger("forge.checkpoint")

_METADATA_FILE = ".metadata"  # DCP's, written last by its coordinator (rank 0)
_STATE_FILE = "trainer_state.pt"
_PREFIX = "step_"
_STAGING_PREFIX = ".tmp_"
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


def _state_options(model: torch.nn.Module) -> Any:
    """DCP's state-dict options for ``model``: a model with frozen parameters (a LoRA adapter
    over a frozen base) is checkpointed by its trainable tensors alone, and loads them alone:
    the frozen base is the model's own checkpoint, which the trainer loads anyway."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shape of every model tensor a checkpoint of ``model`` holds, by name (trainable
    ones only for a model with frozen parameters): what ``check_fits`` compares."""
    # A sharded parameter is a DTensor whose .shape is the whole tensor's.
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return _trainable_part(model, shapes)


def _trainable_part(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a model state dict) as a checkpoint holds it: all of it, or for a model with
    frozen parameters the trainable entries alone (not a tied head either: ``named_parameters``
    names a tied tensor once, so DCP's ``ignore_frozen_params`` keeps its alias)."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if all(p.requires_grad for p in model.parameters()):
        return state
    return {name: value for name, value in state.items() if name in trainable}


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # An optimizer that has not stepped yet gets its (zero) state made here, so a fresh one can
    # be loaded into.
    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(model))
    return {"model": _trainable_part(model, model_state), "optimizer": optim_state}


def _quiet_dcp(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """DCP warns that it assumes one process when no process group exists; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


# ----------------------------------------------------------------------------- writing
def write_checkpoint(
    root: str | os.PathLike, model: torch.nn.Module, optim: torch.optim.Optimizer, state: TrainingState, **options: Any
) -> Path:
    """``start_checkpoint`` (its ``options``: ``keep``, ``where``, ``process_group``) and wait for
    the write: the checkpoint's path once it is in place. A script's or a test's save; the trainer
    writes in the background."""
    return start_checkpoint(root, model, optim, state, **options).wait()


def start_checkpoint(
    root: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainingState,
    *,
    keep: int = 2,
    where: SpmdRank | None = None,
    process_group: Any = None,
) -> PendingCheckpoint:
    """Copy the model's and optimizer's state to memory and write ``<root>/step_<state.step>/``
    from a background thread; every rank calls it, and later ``wait`` on what it returns.

    Training may go on (and change the weights) as soon as this returns: DCP's stager copied
    every rank's shards first. ``process_group``: the group the background write's collectives
    use (DCP's plan and its metadata gather); it must not be the one training runs its
    collectives on meanwhile (``forge.distributed.side_group``). None: the default group, for a
    caller that waits at once.

    ``state.rng`` is ignored: each rank's current RNG states are captured here. ``state.extra``
    must load with ``torch.load(weights_only=True)`` (tensors, numbers, strings, lists, tuples,
    dicts), or the resume would refuse it: a ``TypeError`` says so before anything is written.
    One writer (mesh) per ``root``, one checkpoint in flight at a time: the temporary folders of
    earlier, killed saves are removed.
    """
    where = where or _ONE_RANK
    if keep < 1:
        raise ValueError(f"start_checkpoint keep must be >= 1, got {keep}")
    extra = dict(state.extra)
    check_plain(
        extra, "start_checkpoint: state.extra"
    )  # on every rank (they all hold it), so no rank is left in a collective
    root = Path(root)
    final = root / f"{_PREFIX}{state.step:08d}"
    staged = contextlib.ExitStack()
    staging = staged.enter_context(_staged_on_main(final, where))
    try:
        rngs = gather_objects(capture_rng(), where)
        saved = TrainingState(state.step, state.policy_version, rngs, extra, where.world_size)
        _quiet_background_dcp()
        state_dict = _dcp_state(model, optimizer)
        upload = dcp.async_save(state_dict, checkpoint_id=staging, process_group=process_group)
    except BaseException:
        staged.__exit__(*sys.exc_info())  # the staging folder is removed; the last checkpoint stays
        raise
    return PendingCheckpoint(final, staging, saved, upload, staged, keep, where, _tensor_bytes(state_dict))


def _tensor_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: what its shard file will hold."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


class PendingCheckpoint:
    """A checkpoint being written in the background (``start_checkpoint``).

    When the write finishes, rank 0 adds the training state, moves the folder into place and
    prunes the oldest, from the writer's thread: the checkpoint is complete as soon as its files
    are, whoever waits. Until then the folder has its temporary name, so a process killed
    meanwhile leaves the previous checkpoint as the newest complete one. ``wait`` (on every
    rank, at the same point: it ends with a barrier) blocks until then.
    """

    def __init__(
        self,
        final: Path,
        staging: Path,
        saved: TrainingState,
        upload: Any,
        staged: contextlib.ExitStack,
        keep: int,
        where: SpmdRank,
        needed: int = 0,
    ) -> None:
        self.final = final
        self.staging = staging
        self._saved = saved
        self._staged = staged
        self._keep = keep
        self._where = where
        self._finished = threading.Event()
        self._needed = needed
        self._error: BaseException | None = None
        upload.add_done_callback(self._finish)

    def done(self) -> bool:
        """Whether the checkpoint is in place, or its write failed (``wait`` returns at once)."""
        return self._finished.is_set()

    def wait(self) -> Path:
        """The checkpoint's final path, once it is in place; a failed write raises here and
        leaves the earlier checkpoints as they were."""
        self._finished.wait()
        if self._error is not None:
            raise self._error
        barrier(self._where)  # no rank returns before the checkpoint is in place
        return self.final

    def _finish(self, upload: Any) -> None:
        """The write's end (in DCP's writer thread, or at once if it had ended): on rank 0, the
        training state, the move into place and the pruning; on a failure, the staging's removal."""
        try:
            error = upload.exception()
            if error is not None:
                raise error
            if self._where.is_main:
                torch.save(self._saved.__dict__, self.staging / _STATE_FILE)
            self._staged.close()  # rank 0: the folder moves into place
            if self._where.is_main:
                for old in list_checkpoints(self.final.parent)[: -self._keep]:
                    shutil.rmtree(old, ignore_errors=True)
        except BaseException as exc:
            self._error = no_room(exc, self.staging, self._needed) or exc
            self._staged.__exit__(type(exc), exc, exc.__traceback__)  # the staging folder is removed
        finally:
            self._finished.set()


def _quiet_background_dcp() -> None:
    """DCP warns from its writer thread that it assumes one process when no process group
    exists, which is intended; ``warnings.catch_warnings`` cannot reach another thread."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@contextlib.contextmanager
def _staged_on_main(final: Path, where: SpmdRank) -> Iterator[Path]:
    """``staged_folder`` for a mesh: rank 0 makes it and tells every rank its name; rank 0 moves
    it into place (or removes it on an error) when its block ends. DCP's save returns on rank 0
    only after every rank's shards are written, so that is when the folder is complete."""
    if not where.is_main:
        yield Path(broadcast_object(None, where))
        return
    with staged_folder(final, _STAGING_PREFIX, remove_stale=True) as staging:
        broadcast_object(str(staging), where)
        yield staging


# ----------------------------------------------------------------------------- finding
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
    """The newest complete checkpoint under ``root``; the folders that writers killed mid-write
    left (never complete) are named in a warning and ignored."""
    found = list_checkpoints(root)
    for partial in sorted(Path(root).glob(f"{_STAGING_PREFIX}*")) if Path(root).is_dir() else []:
        logger.warning("ignoring %s: a checkpoint whose writer stopped before it was complete", partial)
    return found[-1] if found else None


def _check_complete(path: Path) -> None:
    if not _complete(path):
        raise FileNotFoundError(
            f"{path} is not a complete forge checkpoint (needs DCP's {_METADATA_FILE} and {_STATE_FILE})"
        )


# ----------------------------------------------------------------------------- reading, safely
def read_training_state(path: str | os.PathLike) -> TrainingState:
    """The step, version, RNG states and extra state of one checkpoint (no tensors loaded).

    Loaded with ``weights_only=True``; a state file that needs more is ``UnsafeCheckpoint``.
    """
    path = Path(path)
    _check_complete(path)
    file = path / _STATE_FILE
    try:
        raw = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        names = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(str(file))) or "unknown objects"
        raise UnsafeCheckpoint(
            f"{file} can only be loaded by unpickling {names}, which may run any code, so forge refuses it: "
            f"a forge training state holds only tensors, numbers, strings, lists and dicts. If you wrote this "
            f"checkpoint yourself and trust it, convert it once: python -m forge.checkpoint convert {path}"
        ) from None
    try:
        return TrainingState(**raw)
    except TypeError:
        keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(
            f"{file} is not a forge training state: it holds {keys}, not step, policy_version, rng, extra "
            "and world_size"
        ) from None


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Global shape of every model tensor in a checkpoint, by parameter name (from DCP's metadata)."""
    path = Path(path)
    _check_complete(path)
    metadata = PlainReader(str(path)).read_metadata()
    prefix = "model."
    return {
        name[len(prefix) :]: tuple(meta.size)
        for name, meta in metadata.state_dict_metadata.items()
        if name.startswith(prefix) and hasattr(meta, "size")
    }


def check_fits(path: str | os.PathLike, shapes: dict[str, tuple[int, ...]], fix: str) -> None:
    """A ``ValueError`` naming both layouts (see ``forge.models.layout``) and the first difference
    if the checkpoint at ``path`` holds other parameter names or shapes than ``shapes`` (a model's,
    global); ``fix`` says what to do."""
    from forge.models.layout import describe_layout

    saved = checkpoint_shapes(path)
    missing, unexpected = sorted(shapes.keys() - saved.keys()), sorted(saved.keys() - shapes.keys())
    if missing or unexpected:
        difference = f"missing {missing[:3]}, unexpected {unexpected[:3]}"
    else:
        name = next((n for n, shape in shapes.items() if saved[n] != shape), None)
        if name is None:
            return
        difference = f"{name} is {list(saved[name])} in the checkpoint but {list(shapes[name])} in the model"
    raise ValueError(
        f"checkpoint {path} does not fit the model: {difference}. The checkpoint's layout: "
        f"{describe_layout(saved)}; the model's: {describe_layout(shapes)}; {fix}"
    )


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
    changing them on resume set them afterwards. A file that would need unrestricted unpickling
    is ``UnsafeCheckpoint`` (see the module docstring).
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    where = where or _ONE_RANK
    path = Path(path)
    training = read_training_state(path)
    state = _dcp_state(model, optimizer)
    plain_load(path, lambda reader: _quiet_dcp(dcp.load, state, storage_reader=reader, planner=PlainLoadPlanner()))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_state_options(model),
    )
    if training.rng:
        restore_rng(training.rng[where.rank] if where.rank < len(training.rng) else training.rng[0])
    return training


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any], TrainingState]:
    """A checkpoint's full model state dict, optimizer state dict and training state, in one
    process and without a model (inspection, tests, tools).

    Optimizer state is keyed by parameter name: ``optimizer["state"]["lm_head.weight"]["exp_avg"]``.
    """
    # DCP's own private loader, as its dcp_to_torch_save uses it, but with the restricted reader
    # and planner and without that function's detour through a torch.save file.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    training = read_training_state(path)
    full: dict[str, Any] = {}
    plain_load(
        path, lambda reader: _load_state_dict(full, storage_reader=reader, planner=PlainFullPlanner(), no_dist=True)
    )
    return full["model"], full["optimizer"], training


# ----------------------------------------------------------------------------- converting
def convert_training_state(path: str | os.PathLike) -> Path:
    """Rewrite a checkpoint's training-state file in the form ``read_training_state`` loads.

    For a checkpoint you trust: this loads the file with unrestricted unpickling (it may run
    code in it), turns numpy values into Python numbers and tensors, and replaces the file
    atomically. Anything else that ``weights_only=True`` cannot load is a ``TypeError`` naming
    the entry, and the file is left as it was. Returns the file's path.
    """
    path = Path(path)
    _check_complete(path)
    file = path / _STATE_FILE
    raw = torch.load(file, map_location="cpu", weights_only=False)  # trusted by the caller
    if not isinstance(raw, dict):
        raise TypeError(f"{file} holds a {type(raw).__name__}, not a forge training state (a dict)")
    plain = {key: plain_values(value, key) for key, value in raw.items()}
    TrainingState(**plain)  # the fields a resume needs
    check_plain(plain, str(file))
    staged = file.with_name(f"{_STATE_FILE}.converting")
    torch.save(plain, staged)
    os.replace(staged, file)
    return file


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m forge.checkpoint",
        description="Convert a checkpoint you trust whose training state needs unrestricted unpickling.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="rewrite <checkpoint>/trainer_state.pt in the loadable form")
    convert.add_argument("path", help="a checkpoint folder, <output_dir>/checkpoints/step_<N>")
    args = parser.parse_args(argv)
    file = convert_training_state(args.path)
    print(f"converted {file}; it now loads with weights_only=True")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
