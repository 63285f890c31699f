"""The file transport's weight files: safetensors files of a fixed layout, rewritten in place.

On one host the trainer hands the policy its weights as a safetensors file in ``/dev/shm``, and
the policy loads it without a copy (``safetensors.torch.load_file`` maps the file). Writing a
fresh file per version cost the trainer about as much as vLLM's whole reload, most of it the
page faults of new memory; copying into pages that already exist is several times cheaper
(figures: ``docs/benchmarks.md`` section 8). So the trainer keeps a few files of the model's
layout (``WeightFiles``) and copies each version into one of them.

A file that is rewritten in place needs two guards, both here:

- **No reader sees a half-written file.** The writer holds an exclusive ``flock`` while it
  copies, and a reader (``read_weights``) a shared one for as long as it uses the mapped
  tensors, so the writer never touches a file that a policy is loading: it takes another one,
  and waits (with a timeout) only if every file is being read.
- **No reader loads another version than it was told.** Each file's safetensors metadata
  carries a fixed-width version stamp. The writer blanks it before copying and sets it after,
  so a file that a killed writer left half-written has no version, and a reader that comes
  late, after its file was reused for a newer version, gets ``StaleWeightFile`` instead of
  those weights.

The files stay valid safetensors files, so any safetensors reader can open them. Their folder
must be private to the user (``forge.generation.weight_folder.private_folder``, checked before the
first file is made): whoever can write it could give the policy other weights.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import shutil
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from forge.generation.weight_folder import private_folder
from forge.staging import says_disk_full

__all__ = ["StaleWeightFile", "WeightFiles", "read_weights", "remove_orphaned_weight_files"]

VERSION_KEY = "forge_version"
STAMP_WIDTH = 20
BLANK_STAMP = "-" * STAMP_WIDTH
"""The stamp of a file being written (or left half-written): no version."""
LOCK_POLL_S = 0.002


class StaleWeightFile(RuntimeError):
    """A weight file holds another version than the one its reader was told to load."""


def _stamp(version: int) -> str:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be an int >= 0, got {version!r}")
    return f"{version:0{STAMP_WIDTH}d}"


def _lock_first(fds: list[int], kind: int, timeout_s: float) -> int | None:
    """``flock`` the first of ``fds`` that is free with ``kind`` (LOCK_SH or LOCK_EX), polling
    until ``timeout_s``; its index, or None if none came free in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        for index, fd in enumerate(fds):
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
                return index
            except BlockingIOError:
                continue
        if time.monotonic() >= deadline:
            return None
        time.sleep(LOCK_POLL_S)


def _read_lock(fd: int, timeout_s: float, path: str) -> None:
    if _lock_first([fd], fcntl.LOCK_SH, timeout_s) is None:
        raise TimeoutError(f"weight file {path} was still being written after {timeout_s:g} s")


def _header(raw: bytes | mmap.mmap) -> tuple[dict, int]:
    """A safetensors file's JSON header and the offset where its data starts."""
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(bytes(raw[8 : 8 + length])), 8 + length


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""safetensors' names of the dtypes weights come in."""


class _Mapped:
    """A weight file mapped into this process, with a tensor view per entry and its stamp's place.

    The writer maps it shared and writable. A reader maps it copy-on-write, as safetensors'
    ``load_file`` does: the pages it reads are the file's own, so it sees each new version
    without mapping the file again (a fresh mapping would fault in every page of the file again on
    each load: ``docs/benchmarks.md`` section 8), and a write by the engine could never reach the
    trainer's file.
    """

    def __init__(self, path: Path, *, writable: bool) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            info = os.fstat(self.fd)
            self.identity = (info.st_ino, info.st_size)
            self.map = mmap.mmap(self.fd, info.st_size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
        except BaseException:
            os.close(self.fd)
            raise
        header, start = _header(self.map)
        marker = f'"{VERSION_KEY}":"'.encode()
        found = self.map.find(marker, 8, start)
        self.stamp_at = None if found < 0 else found + len(marker)
        data = torch.frombuffer(self.map, dtype=torch.uint8)
        self.tensors: dict[str, torch.Tensor] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPES:
                raise ValueError(f"weight file {path}: {name!r} is {entry['dtype']}, not a floating-point dtype")
            begin, end = entry["data_offsets"]
            self.tensors[name] = data[start + begin : start + end].view(_DTYPES[entry["dtype"]]).view(entry["shape"])

    @property
    def stamp(self) -> str | None:
        if self.stamp_at is None:
            return None
        return bytes(self.map[self.stamp_at : self.stamp_at + STAMP_WIDTH]).decode()

    def set_stamp(self, stamp: str) -> None:
        self.map[self.stamp_at : self.stamp_at + STAMP_WIDTH] = stamp.encode()

    def is_current(self) -> bool:
        """Whether ``path`` is still the file this maps (not removed, not replaced)."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (info.st_ino, info.st_size) == self.identity

    def close(self) -> None:
        self.tensors.clear()
        with contextlib.suppress(BufferError):  # a tensor still held elsewhere keeps the map open
            self.map.close()
        os.close(self.fd)


class _Slot(_Mapped):
    """One of the writer's files."""

    def __init__(self, path: Path, state: Mapping[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        # The library writes the file once, so the format is its own; versions are copied into
        # the same bytes.
        save_file(dict(state), str(path), metadata={"format": "pt", VERSION_KEY: BLANK_STAMP})
        super().__init__(path, writable=True)
        if self.stamp is None:
            self.close()
            raise RuntimeError(f"safetensors wrote the version stamp of {path} in a form forge does not know")
        self.layout = _layout(state)
        self.version: int | None = None

    def write(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state`` in (the caller holds the exclusive lock) and stamp it ``version``."""
        self.set_stamp(BLANK_STAMP)
        for name, tensor in state.items():
            self.tensors[name].copy_(tensor)
        self.set_stamp(_stamp(version))
        self.version = version

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def _layout(state: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in state.items()]


class WeightFiles:
    """The trainer's weight files in ``folder``: ``slots`` files of the model's layout, reused.

    ``write`` copies a version into the least recently written file that no reader holds (never
    the newest, which a policy may be about to load) and returns its path. With the default 3
    files a restarting replica can still be loading the version before the one being pushed
    while the next one is written. The layout is the first state dict's; a state dict of another
    layout replaces the files. ``folder`` must be private (``private_folder``: this user's, not
    a symlink, not writable by others). Names are ``weights-<pid>-<slot>.safetensors``, so
    ``remove_orphaned_weight_files`` can tell a dead writer's files.
    """

    def __init__(self, folder: str | Path, *, slots: int = 3, lock_timeout_s: float = 60.0) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
            raise ValueError(f"slots must be an int >= 2 (one being read while the next is written), got {slots!r}")
        self.folder = Path(folder)
        self.slots = slots
        self.lock_timeout_s = lock_timeout_s
        self._files: list[_Slot] = []
        self._order: list[int] = []  # slot indices, least recently written first

    @property
    def paths(self) -> list[str]:
        return [str(s.path) for s in self._files]

    def write(self, state: Mapping[str, torch.Tensor], version: int) -> str:
        """Put ``state`` (name -> contiguous CPU tensor) in a file stamped ``version``; its path."""
        _stamp(version)  # checks it
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor) or v.device.type != "cpu"]
        if bad:
            raise ValueError(f"state[{bad[0]!r}] must be a CPU tensor")
        if self._files and self._files[0].layout != _layout(state):
            self.close()
        if not self._files:
            private_folder(self.folder)  # made 0700 if missing; a folder others control is refused
            self._create_slots(state)
        slot = self._acquire()
        try:
            self._files[slot].write(state, version)
        finally:
            fcntl.flock(self._files[slot].fd, fcntl.LOCK_UN)
        self._order.remove(slot)
        self._order.append(slot)
        return str(self._files[slot].path)

    def _create_slots(self, state: Mapping[str, torch.Tensor]) -> None:
        """Write the ``slots`` files once. A filesystem that fills up meanwhile leaves no file
        behind and raises ``OSError(ENOSPC)`` naming the folder, the bytes needed and those free
        (safetensors reports it as its own error type, with the OS's words inside)."""
        try:
            for k in range(self.slots):
                self._files.append(_Slot(self.folder / f"weights-{os.getpid()}-{k}.safetensors", state))
        except Exception as error:
            partial = self.folder / f"weights-{os.getpid()}-{len(self._files)}.safetensors"
            self.close()
            partial.unlink(missing_ok=True)
            if not says_disk_full(error):
                raise
            one = sum(t.numel() * t.element_size() for t in state.values())
            raise OSError(
                errno.ENOSPC,
                f"no room left in weight folder {self.folder}: its {self.slots} weight files need "
                f"{self.slots * one / 2**20:.1f} MiB ({one / 2**20:.1f} MiB each) and the filesystem has "
                f"{shutil.disk_usage(self.folder).free / 2**20:.1f} MiB free; set weight_sync.dir to a folder with "
                "room, or weight_sync.transport=message",
            ) from error
        self._order = list(range(self.slots))

    def _acquire(self) -> int:
        """Lock the least recently written file no reader holds (never the newest), for writing."""
        candidates = self._order[:-1] if self._files[self._order[-1]].version is not None else self._order
        index = _lock_first([self._files[slot].fd for slot in candidates], fcntl.LOCK_EX, self.lock_timeout_s)
        if index is None:
            raise TimeoutError(
                f"every weight file in {self.folder} but the newest was still being read after "
                f"{self.lock_timeout_s:g} s; a policy replica is stuck loading weights"
            )
        return candidates[index]

    def close(self) -> None:
        """Unmap and remove the files."""
        for slot in self._files:
            slot.remove()
        self._files.clear()
        self._order.clear()


_READER_MAPS: dict[str, _Mapped] = {}
"""This process's mappings of the weight files it loaded, kept for the next versions."""


def _reader_map(path: str) -> _Mapped | None:
    """The cached mapping of a stamped weight file ``path`` (None for any other file)."""
    mapped = _READER_MAPS.get(path)
    if mapped is not None and mapped.is_current():
        return mapped
    for name in [p for p, m in _READER_MAPS.items() if p == path or not m.is_current()]:
        _READER_MAPS.pop(name).close()  # the trainer replaced or removed it
    with open(path, "rb") as f:
        head = f.read(8)
        metadata = _header(head + f.read(struct.unpack("<Q", head)[0]))[0].get("__metadata__") or {}
    if VERSION_KEY not in metadata:
        return None
    mapped = _Mapped(Path(path), writable=False)
    _READER_MAPS[path] = mapped
    return mapped


@contextlib.contextmanager
def read_weights(path: str | Path, version: int | None = None, *, timeout_s: float = 60.0) -> Iterator[dict]:
    """The tensors of the safetensors file ``path``, mapped (no copy), valid inside the block.

    A shared lock keeps the trainer from rewriting the file while the block runs. A file that
    ``WeightFiles`` wrote stays mapped for the versions after, and must carry ``version`` (when
    given): ``StaleWeightFile`` if it carries another one or none (it was being written when its
    writer died). Any other safetensors file loads as it is.
    """
    path = str(path)
    mapped = _reader_map(path)
    if mapped is None:
        from safetensors.torch import load_file

        fd = os.open(path, os.O_RDONLY)
        try:
            _read_lock(fd, timeout_s, path)
            yield load_file(path)
        finally:
            os.close(fd)  # releases the lock
        return
    _read_lock(mapped.fd, timeout_s, path)
    try:
        stamp = mapped.stamp
        if version is not None and stamp != _stamp(version):
            held = "no version (it was being written)" if stamp == BLANK_STAMP else f"version {int(stamp)}"
            raise StaleWeightFile(
                f"weight file {path} holds {held}, not version {version}: the trainer has reused it "
                "for newer weights since; load the newest published version instead"
            )
        yield dict(mapped.tensors)
    finally:
        fcntl.flock(mapped.fd, fcntl.LOCK_UN)


def remove_orphaned_weight_files(folder: str | Path) -> None:
    """Remove ``weights-<pid>-*`` files whose writer process is gone (with the ``.tmp`` files
    that forge's earlier per-version files left).

    A trainer killed with SIGKILL cannot remove what it published; in ``/dev/shm`` that is
    memory held until reboot. The file transport is single-host, so the pid is this host's.
    """
    for path in Path(folder).glob("weights-*.safetensors*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
