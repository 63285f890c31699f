"""What forge unpickles from a checkpoint folder, and how it refuses the rest.

A checkpoint folder may come from someone else (a shared filesystem, a downloaded run), and its
files are pickles, which can call any function while they load. torch made
``torch.load(weights_only=True)`` the default for that reason, but two of DCP's own reads do not
use it: its ``.metadata`` is read with a bare ``pickle.load``, and each non-tensor entry of the
shards (an optimizer's ``lr``, ``betas``) with ``torch.load(weights_only=False)``. So forge reads
a checkpoint only through these:

- ``PlainReader``: DCP's file reader, with ``.metadata`` unpickled by an allowlist of exactly
  the classes DCP's metadata holds (``DCP_METADATA_CLASSES``), and shard files that are plain
  names inside the checkpoint folder.
- ``PlainLoadPlanner`` / ``PlainFullPlanner``: DCP's load planners, with every non-tensor entry
  loaded with ``weights_only=True`` first; DCP's own load then sees only what that allowed.
- ``check_plain``: what forge writes into its own files must load with ``weights_only=True``.

A file that needs anything else is ``UnsafeCheckpoint``, raised before anything in it runs.
``plain_values`` turns numpy values into Python numbers and tensors, for converting a state file
the user trusts (``forge.checkpoint.convert_training_state``).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = [
    "DCP_METADATA_CLASSES",
    "PlainFullPlanner",
    "PlainLoadPlanner",
    "PlainReader",
    "UnsafeCheckpoint",
    "check_plain",
    "plain_load",
    "plain_values",
]


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that only unrestricted unpickling could load, which may run any code in
    it; refused before anything in it ran."""


def check_plain(value: Any, what: str) -> None:
    """Raise ``TypeError`` naming ``what`` unless ``value`` loads back with
    ``torch.load(weights_only=True)``.

    The test is the reader's own (a round trip), so what is saved is exactly what loads.
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError:
        buffer.seek(0)
        names = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(buffer)) or "objects"
        raise TypeError(
            f"{what} holds {names}, which only unrestricted unpickling loads; "
            "give it tensors, numbers, strings, lists, tuples and dicts (e.g. int() of a numpy value)"
        ) from None


DCP_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name (torch.strided)
    "torch": {"Size"},
    "pathlib": {"PosixPath"},  # the checkpoint_id DCP records
    "collections": {"OrderedDict"},
}
"""Exactly what DCP's ``.metadata`` pickle may name (plus torch dtypes): its own plain records.
Whole modules are not allowed: an allowed module's name would reach everything it imports."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` with only ``DCP_METADATA_CLASSES`` (and dtypes) callable."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"{self.path} names {module}.{name}, which DCP's checkpoint metadata never holds; unpickling it "
            "may run any code, so forge refuses the checkpoint"
        )


class PlainReader(dcp.FileSystemReader):
    """DCP's file reader, with its ``.metadata`` read by ``_MetadataUnpickler`` instead of a bare
    ``pickle.load``, and every shard file a plain name inside the checkpoint folder."""

    _read: tuple[Path, Metadata] | None = None
    """The metadata read last, and from where: a load reads it twice (``plain_load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        if self._read is not None and self._read[0] == path:  # plain_load's own read, before DCP's
            metadata = self._read[1]
        else:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f, path).load()
            self._check(metadata, path)
        if getattr(metadata, "storage_meta", None) is None:  # as DCP's own read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # a reset() since makes a new one
        self._read = (path, metadata)
        return metadata

    @staticmethod
    def _check(metadata: Any, path: Path) -> None:
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP's checkpoint metadata")
        for info in metadata.storage_data.values():
            shard = info.relative_path
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise UnsafeCheckpoint(f"{path} points at shard file {shard!r}, outside its checkpoint folder")


class _PlainBytes:
    """A load planner mixin: a non-tensor entry (e.g. an optimizer's ``lr``) must load with
    ``weights_only=True`` before DCP's planner loads it (with ``weights_only=False``); the same
    bytes then name only what the restricted load allowed."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint(
                f"checkpoint entry {read_item.dest_index.fqn!r} can only be loaded by unpickling objects "
                "that may run any code, so forge refuses the checkpoint"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)  # type: ignore[misc]


class PlainLoadPlanner(_PlainBytes, DefaultLoadPlanner):
    """DCP's default load planner (into a given state dict), with ``_PlainBytes``."""


class PlainFullPlanner(_PlainBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata (no model needed), as DCP's
    ``dcp_to_torch_save`` does."""


def plain_load(path: str | os.PathLike, load: Any) -> None:
    """Run ``load(reader)`` with a ``PlainReader`` of ``path``; a refusal surfaces as
    ``UnsafeCheckpoint`` itself, not inside DCP's ``CheckpointException``."""
    from torch.distributed.checkpoint.api import CheckpointException

    reader = PlainReader(str(path))
    reader.read_metadata()  # first here (DCP's own read gets it again): inside a load, DCP
    # reports a failure to read the metadata as text, not as the refusal it was
    try:
        load(reader)
    except CheckpointException as exc:
        refused = [error for error, _ in exc.failures.values() if isinstance(error, UnsafeCheckpoint)]
        if refused:
            raise refused[0] from None
        raise


def plain_values(value: Any, where: str) -> Any:
    """``value`` with numpy scalars as Python numbers and numpy arrays as tensors, recursively."""
    if isinstance(value, dict):
        return {k: plain_values(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_values(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, torch.Tensor) or value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if type(value).__module__ == "numpy":
        import numpy

        if isinstance(value, numpy.generic):
            return value.item()
        if isinstance(value, numpy.ndarray):
            return torch.from_numpy(value.copy())
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which forge cannot convert")
