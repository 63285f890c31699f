"""Full disks: a start-up check names the checkpoint folder, the bytes needed and those free; a
checkpoint write that runs out of room on a real small filesystem fails clearly and leaves the last
good checkpoint as it was; weight files that do not fit fail the same way and leave nothing behind."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from forge.checkpoint import TrainingState, check_space, latest_checkpoint, load_checkpoint, write_checkpoint
from forge.generation.weight_files import WeightFiles


def test_the_start_up_check_names_the_folder_and_the_bytes_needed_and_free(tmp_path: Path) -> None:
    check_space(tmp_path / "not-yet" / "checkpoints", 1 << 20, keep=2)  # a missing folder: its parent is checked
    with pytest.raises(OSError, match=r"checkpoints under .*checkpoints need 3145728.0 MiB .* has .* MiB free") as e:
        check_space(tmp_path / "checkpoints", 1 << 40, keep=2)
    assert e.value.errno == errno.ENOSPC


@contextlib.contextmanager
def _small_filesystem(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``where`` (root only; skips where mounting is not allowed)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if os.geteuid() != 0 or mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip() or 'not root'}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _model(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, width)).sum().backward()
    opt.step()
    return model, opt


def test_a_checkpoint_that_fills_a_real_small_filesystem_fails_clearly_and_keeps_the_last_one(tmp_path: Path) -> None:
    with _small_filesystem(tmp_path / "small", "4m") as root:
        small, small_opt = _model(64)  # ~50 KB a checkpoint
        write_checkpoint(root, small, small_opt, TrainingState(1, 1))
        big, big_opt = _model(1024)  # ~12.6 MB: more than the filesystem holds
        with pytest.raises(OSError, match=r"no room left to write checkpoint .*small.*filled up .* MiB free") as e:
            write_checkpoint(root, big, big_opt, TrainingState(2, 2))
        assert e.value.errno == errno.ENOSPC
        assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # the half-written one removed
        fresh, fresh_opt = _model(64)
        with torch.no_grad():
            fresh.weight.zero_()
        assert load_checkpoint(latest_checkpoint(root), fresh, fresh_opt).step == 1
        assert torch.equal(fresh.weight, small.weight)


def test_weight_files_that_do_not_fit_a_real_small_filesystem_fail_clearly_and_leave_nothing(tmp_path: Path) -> None:
    with _small_filesystem(tmp_path / "small", "4m") as root:
        folder = root / "weights"
        files = WeightFiles(folder)
        state = {"w": torch.ones(512, 1024)}  # 2 MiB a file: the first fits, the second does not
        with pytest.raises(OSError, match=r"no room left in weight folder .*weights: its 3 weight files need 6.0 MiB "):
            files.write(state, 1)
        assert list(folder.iterdir()) == []
        files.write({"w": torch.ones(64, 64)}, 1)  # a model that fits: the writer is still usable
        assert len(list(folder.iterdir())) == 3
        files.close()
