"""Folders written all at once: readers see the old folder or the complete new one, never half.

A killed writer (a trainer SIGKILLed mid-checkpoint, a tiny model interrupted while being made)
must not leave a folder that looks finished. Each writes into a fresh folder beside the target
and moves it into place only when every file is written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_space", "says_disk_full", "staged_folder"]


@contextlib.contextmanager
def staged_folder(final: Path, prefix: str, *, remove_stale: bool = False) -> Iterator[Path]:
    """Yield an empty folder beside ``final`` (named ``<prefix>...``) to write into.

    When the block ends without an error it replaces ``final`` (an old ``final`` is removed
    first); when the block raises it is removed and ``final`` is left as it was.

    ``remove_stale`` first removes the ``<prefix>*`` folders that writers killed mid-write left
    beside ``final``; only for a parent folder that one writer owns (checkpoints), since it
    would also remove a concurrent writer's folder.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    if remove_stale:
        for stale in final.parent.glob(f"{prefix}*"):
            shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    try:
        yield staging
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def free_space(folder: str | os.PathLike) -> tuple[Path, int]:
    """The nearest existing folder at or above ``folder`` (which need not exist yet) and the bytes
    free on its filesystem: what a writer about to fill ``folder`` has room for."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free


def says_disk_full(error: BaseException) -> bool:
    """Whether ``error`` reports a full filesystem: an ``OSError(ENOSPC)``, or a library's own
    error type carrying the OS's words (safetensors and DCP wrap the write's error)."""
    return getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error)
