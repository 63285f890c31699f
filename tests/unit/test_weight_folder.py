"""The file transport's folders: private to the user, one per run, and the only place a run's
policy loads weights from. Real folders, real processes (tests run as root here, so a foreign
owner is made with ``os.chown``)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forge.generation.weight_files import WeightFiles
from forge.generation.weight_folder import (
    RunFolder,
    UnsafeWeightFolder,
    check_weight_file,
    default_weight_root,
    private_folder,
)

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_default_root_is_the_users_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """/dev/shm/forge-<uid> by default, $XDG_RUNTIME_DIR/forge when that is set."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert default_weight_root() == Path(f"/dev/shm/forge-{os.geteuid()}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_weight_root() == tmp_path / "forge"


def test_a_missing_root_is_made_0700_with_its_parents(tmp_path: Path) -> None:
    root = private_folder(tmp_path / "a" / "weights")
    assert root == tmp_path / "a" / "weights" and root.is_dir() and _mode(root) == 0o700


def test_a_symlinked_root_is_refused(tmp_path: Path) -> None:
    """Even a link to a folder of one's own: whoever controls the link's target gets the weights."""
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(UnsafeWeightFolder, match=rf"{tmp_path / 'link'} is a symlink .*weight_sync\.dir"):
        private_folder(tmp_path / "link")
    with pytest.raises(UnsafeWeightFolder, match="is a symlink"):
        RunFolder.create(tmp_path / "link")
    assert list((tmp_path / "real").iterdir()) == []


def test_a_root_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a folder of another user needs root (the tests run as root here)")
    foreign = tmp_path / "theirs"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, NOBODY, NOBODY)
    with pytest.raises(UnsafeWeightFolder, match=rf"{foreign} belongs to uid {NOBODY}, not to you \(uid 0\)"):
        RunFolder.create(foreign)
    assert list(foreign.iterdir()) == []


def test_a_root_others_can_write_or_a_parent_they_can_swap_it_in_is_refused(tmp_path: Path) -> None:
    """A group/world-writable root is refused, and so is one inside a world-writable folder
    without the sticky bit; with the sticky bit (as /dev/shm and /tmp have it) it is fine."""
    open_root = tmp_path / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    with pytest.raises(UnsafeWeightFolder, match=r"can be written by other users \(mode 777\).*chmod go-w"):
        private_folder(open_root)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeWeightFolder, match=rf"is inside {shared} \(uid \d+, mode 777\)"):
        private_folder(shared / "weights")
    shared.chmod(0o1777)
    assert _mode(private_folder(shared / "weights")) == 0o700


def test_the_writer_refuses_a_folder_that_is_not_private(tmp_path: Path) -> None:
    """WeightFiles (the trainer's writer) applies the same check before it makes a file."""
    (tmp_path / "link").symlink_to(tmp_path)
    files = WeightFiles(tmp_path / "link")
    with pytest.raises(UnsafeWeightFolder, match="is a symlink"):
        files.write({"w": torch.zeros(2)}, 1)
    assert not list(tmp_path.glob("weights-*"))


_RUN = """
import sys, torch
from forge.generation.weight_files import WeightFiles
from forge.generation.weight_folder import RunFolder
run = RunFolder.create(sys.argv[1])
files = WeightFiles(run.path)
print(run.path, files.write({"w": torch.full((4,), float(sys.argv[2]))}, 1), flush=True)
sys.stdin.read()  # a live run until the test closes stdin (or kills it)
files.close()
run.close()
"""


class _Run:
    """A process that is one run's controller and trainer: it makes its run folder under
    ``root`` and publishes one weight file there, then lives until stopped."""

    def __init__(self, root: Path, value: float) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RUN, str(root), str(value)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        folder, weights = self.proc.stdout.readline().split()
        self.folder, self.weights = Path(folder), Path(weights)

    def stop(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.proc.stdin.close()


def test_two_runs_of_one_user_never_read_each_others_weight_files(tmp_path: Path) -> None:
    """Two runs under one root get separate 0700 folders, and each run's policy check refuses
    the other's file (and any path that leaves its folder) while it accepts its own."""
    root = tmp_path / "root"
    first, second = _Run(root, 1.0), _Run(root, 2.0)
    try:
        assert first.folder != second.folder and first.folder.parent == second.folder.parent == root
        assert _mode(first.folder) == _mode(second.folder) == 0o700
        assert first.weights.parent == first.folder and second.weights.parent == second.folder
        assert check_weight_file(first.weights, first.folder) == first.weights
        with pytest.raises(UnsafeWeightFolder, match=rf"{second.weights} is not under this run's weight folder"):
            check_weight_file(second.weights, first.folder)
        with pytest.raises(UnsafeWeightFolder, match="is not under"):
            check_weight_file(first.folder / ".." / second.folder.name / second.weights.name, first.folder)
        (first.folder / "alias.safetensors").symlink_to(second.weights)
        with pytest.raises(UnsafeWeightFolder, match="is not under"):
            check_weight_file(first.folder / "alias.safetensors", first.folder)
    finally:
        first.stop()
        second.stop()
    assert list(root.glob("run-*")) == []  # each run removed its own folder


def test_a_killed_runs_folder_is_removed_by_the_next_run_and_a_live_runs_kept(tmp_path: Path) -> None:
    root = tmp_path / "root"
    killed, live = _Run(root, 1.0), _Run(root, 2.0)
    try:
        killed.kill()
        assert killed.weights.exists()  # a SIGKILLed run cannot remove its weights
        mine = RunFolder.create(root)
        assert not killed.folder.exists()
        assert live.weights.exists()
        assert sorted(p.name for p in root.glob("run-*")) == sorted([live.folder.name, mine.path.name])
        mine.close()
        assert not mine.path.exists()
    finally:
        live.stop()


async def test_the_policy_refuses_a_weight_file_outside_its_run_folder_or_of_another_user(tmp_path: Path) -> None:
    """A Policy actor given a run folder (as the GRPO app gives it) refuses another folder's file,
    and a file in its own folder that another user owns, before it loads anything; each error
    names the path and the rule."""
    from monarch.actor import this_proc

    from forge.actors.policy import Policy, PolicyConfig

    mine = private_folder(tmp_path / "mine")
    other = private_folder(tmp_path / "other")
    files, own_files = WeightFiles(other), WeightFiles(mine)
    path = files.write({"w": torch.zeros(2)}, 1)
    foreign = own_files.write({"w": torch.zeros(2)}, 1)
    policy = this_proc().spawn("policy_folder", Policy, PolicyConfig(model_path=str(tmp_path), weights_dir=str(mine)))
    try:  # no engine is started: the check comes first
        with pytest.raises(Exception, match=rf"UnsafeWeightFolder.*{path} is not under this run's weight folder"):
            await policy.update_weights.call_one(path, 1)
        if os.geteuid() != 0:
            pytest.skip("making a file of another user needs root (the tests run as root here)")
        os.chown(foreign, NOBODY, NOBODY)  # in the run's folder, but written by someone else
        with pytest.raises(
            Exception,
            match=rf"UnsafeWeightFolder.*{foreign} belongs to uid {NOBODY}; the policy loads only files that you",
        ):
            await policy.update_weights.call_one(foreign, 1)
    finally:
        await policy.stop()
        files.close()
        own_files.close()
