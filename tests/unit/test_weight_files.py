"""The file transport's fixed-layout weight files: reuse, locking against readers, version stamps."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from forge.generation.weight_files import StaleWeightFile, WeightFiles, read_weights, remove_orphaned_weight_files


def _state(value: float) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.full((16, 8), value),
        "model.norm.weight": torch.full((8,), value + 0.5),
        "model.layers.0.mlp.up_proj.weight": torch.full((12, 8), value, dtype=torch.bfloat16),
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def weight_files(tmp_path: Path) -> Iterator[Callable[..., WeightFiles]]:
    """``WeightFiles`` in ``tmp_path``, closed (files removed) after the test."""
    made: list[WeightFiles] = []

    def make(**options: Any) -> WeightFiles:
        made.append(WeightFiles(tmp_path, **options))
        return made[-1]

    yield make
    for files in made:
        files.close()


def test_each_version_is_read_back_exactly_and_the_files_are_plain_safetensors(
    weight_files: Callable[..., WeightFiles], tmp_path: Path
) -> None:
    files = weight_files(slots=3)
    paths = []
    for version in range(1, 5):
        path = files.write(_state(float(version)), version)
        paths.append(path)
        with read_weights(path, version) as weights:
            assert _equal(weights, _state(float(version)))
        assert _equal(load_file(path), _state(float(version)))  # any safetensors reader opens it
    # Three files, reused in turn: version 4 went where version 1 was.
    assert len(set(paths)) == 3 and paths[3] == paths[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(p).name for p in files.paths)
    files.close()
    assert list(tmp_path.iterdir()) == []


def test_a_file_reused_for_a_newer_version_refuses_a_late_reader(weight_files: Callable[..., WeightFiles]) -> None:
    files = weight_files(slots=3)
    first = files.write(_state(1.0), 1)
    for version in (2, 3, 4):
        files.write(_state(float(version)), version)
    with pytest.raises(StaleWeightFile, match="holds version 4, not version 1"):
        with read_weights(first, 1):
            pass


def test_a_file_without_a_finished_write_has_no_version(weight_files: Callable[..., WeightFiles]) -> None:
    """Until a version is copied in (or while it is, or after its writer died), a file has none."""
    files = weight_files(slots=3)
    written = files.write(_state(1.0), 1)
    unwritten = next(p for p in files.paths if p != written)
    with pytest.raises(StaleWeightFile, match="no version"):
        with read_weights(unwritten, 0):
            pass


def test_a_write_that_fails_partway_leaves_its_file_with_no_version(weight_files: Callable[..., WeightFiles]) -> None:
    """A copy that stops after the first tensor (as a killed writer's does) leaves the file it
    reused stamped with no version: a late reader of the version it held gets ``StaleWeightFile``,
    never that version's name on half-new bytes."""
    files = weight_files(slots=2)
    first = files.write(_state(1.0), 1)
    files.write(_state(2.0), 2)
    broken = {**_state(3.0), "model.norm.weight": torch.full((8,), 3.5).to_sparse()}  # copy_ refuses it
    with pytest.raises(RuntimeError, match="sparse"):
        files.write(broken, 3)  # into the file of version 1: the least recently written
    with pytest.raises(StaleWeightFile, match=r"holds no version \(it was being written\), not version 1"):
        with read_weights(first, 1):
            pass


def test_the_writer_never_rewrites_a_file_being_read(weight_files: Callable[..., WeightFiles]) -> None:
    """A reader's mapped tensors keep their version while the trainer publishes three more."""
    files = weight_files(slots=3)
    held = files.write(_state(1.0), 1)
    with read_weights(held, 1) as weights:
        later = [files.write(_state(float(v)), v) for v in (2, 3, 4)]
        assert held not in later
        assert _equal(weights, _state(1.0))


def test_the_writer_times_out_naming_the_folder_when_every_older_file_is_being_read(
    weight_files: Callable[..., WeightFiles], tmp_path: Path
) -> None:
    files = weight_files(slots=2, lock_timeout_s=0.2)
    old = files.write(_state(1.0), 1)
    files.write(_state(2.0), 2)
    with read_weights(old, 1):
        with pytest.raises(TimeoutError, match=f"{tmp_path}.*still being read"):
            files.write(_state(3.0), 3)


def test_a_state_dict_of_another_layout_replaces_the_files(
    weight_files: Callable[..., WeightFiles], tmp_path: Path
) -> None:
    files = weight_files(slots=2)
    files.write(_state(1.0), 1)
    wider = {"model.norm.weight": torch.ones(10)}
    path = files.write(wider, 2)
    with read_weights(path, 2) as weights:
        assert _equal(weights, wider)
    assert len(list(tmp_path.iterdir())) == 2


def test_bad_arguments_name_the_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="slots must be an int >= 2.*got 1"):
        WeightFiles(tmp_path, slots=1)
    files = WeightFiles(tmp_path)
    with pytest.raises(ValueError, match="version must be an int >= 0, got -1"):
        files.write(_state(1.0), -1)
    with pytest.raises(ValueError, match="must be a CPU tensor"):
        files.write({"w": torch.ones(2, device="meta")}, 1)


def test_orphans_of_a_dead_writer_are_removed_and_a_live_writers_kept(tmp_path: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"weights-{int(dead.stdout)}-0.safetensors"
    live = tmp_path / f"weights-{os.getpid()}-0.safetensors"
    orphan.write_bytes(b"x")
    live.write_bytes(b"x")
    remove_orphaned_weight_files(tmp_path)
    assert not orphan.exists() and live.exists()


def test_any_other_safetensors_file_loads_as_it_is(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    state = {"w": torch.arange(6.0).view(2, 3), "steps": torch.tensor([3], dtype=torch.int64)}
    save_file(state, str(path))
    with read_weights(path, 7) as weights:  # no stamp: no version to check
        assert _equal(weights, state)


def test_a_reader_keeps_its_mapping_and_sees_each_new_version_in_it(weight_files: Callable[..., WeightFiles]) -> None:
    """The policy maps each file once; later versions written into it are what it reads."""
    files = weight_files(slots=2)
    seen = {}
    for version in range(1, 6):
        path = files.write(_state(float(version)), version)
        with read_weights(path, version) as weights:
            assert _equal(weights, _state(float(version)))
            seen.setdefault(path, set()).add(weights["model.norm.weight"].data_ptr())
    assert len(seen) == 2 and all(len(pointers) == 1 for pointers in seen.values())


def test_a_reader_in_another_process_keeps_the_writer_off_its_file(weight_files: Callable[..., WeightFiles]) -> None:
    """The lock holds across processes, as between the trainer's and a policy replica's."""
    import subprocess
    import sys

    files = weight_files(slots=2, lock_timeout_s=0.3)
    held = files.write(_state(1.0), 1)
    files.write(_state(2.0), 2)
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from forge.generation.weight_files import read_weights\n"
            f"with read_weights({held!r}, 1) as w:\n"
            "    print(float(w['model.norm.weight'][0]), flush=True)\n"
            "    sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout.readline().strip() == "1.5"
        # The only file the writer may use (not the newest) is held by the other process.
        with pytest.raises(TimeoutError, match="still being read"):
            files.write(_state(3.0), 3)
    finally:
        reader.stdin.close()
        assert reader.wait(timeout=30) == 0
    assert files.write(_state(3.0), 3) == held  # free again once the reader is done
