"""Room for checkpoints: a start-up check that their folder can hold them, and a clear error for
a write that filled its filesystem (``forge.checkpoint``)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from forge.staging import free_space, says_disk_full

__all__ = ["check_space", "checkpoint_bytes", "no_room"]


def checkpoint_bytes(numel: int, element_size: int) -> int:
    """About the bytes of one checkpoint of a model of ``numel`` parameters: the weights and
    AdamW's two moments, each of ``element_size`` bytes (the RNG and training state are small)."""
    return 3 * numel * element_size


def check_space(root: str | os.PathLike, one_checkpoint: int, keep: int) -> None:
    """Raise ``OSError(ENOSPC)`` unless ``root``'s filesystem has room for ``keep`` checkpoints of
    ``one_checkpoint`` bytes plus the one being written (the oldest goes only once the new one is
    in place). ``root`` need not exist yet: its nearest existing parent is checked."""
    needed = (keep + 1) * one_checkpoint
    probe, free = free_space(root)
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"checkpoints under {root} need {_mib(needed)} ({keep} kept of ~{_mib(one_checkpoint)} each, plus the "
            f"one being written) but {probe} has {_mib(free)} free; give logging.output_dir a filesystem with room, "
            "lower trainer.keep_checkpoints, or checkpoint less (trainer.checkpoint_every)",
        )


def no_room(error: BaseException, staging: Path, needed: int) -> OSError | None:
    """A clear error for a write that ran out of room, else None. DCP wraps the write's error,
    and torch's zip writer may report a full disk only as a short write, so the test is the
    room itself: what was still to write did not fit in what is free."""
    written = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file()) if staging.exists() else 0
    free = shutil.disk_usage(staging.parent).free
    said = says_disk_full(error)
    if not said and free >= needed - written:
        return None
    return OSError(
        errno.ENOSPC,
        f"no room left to write checkpoint {staging.parent}: it needs ~{_mib(needed)}, {_mib(written)} of it were "
        f"written when the filesystem filled up ({_mib(free)} free); the earlier checkpoints are intact",
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
