"""Where the file transport's weights live: a folder private to the user, and one to the run.

The trainer hands the policy its weights as files (``forge.generation.weight_files``). Whoever can
write their folder can feed the policy weights of their own; whoever can read it gets the run's
weights. One fixed folder in a world-writable place, as ``/dev/shm/forge-weights`` was, gives both
away on a machine that several users share: the first user's run creates it (and a second user's
run cannot write there), and a user who creates it first, or a symlink by that name, gets the
others' weights and can swap in their own. So:

- **The root** (``weight_sync.dir``; by default ``$XDG_RUNTIME_DIR/forge`` when that is set, else
  ``/dev/shm/forge-<uid>``) must be a real folder, not a symlink, that belongs to this user and
  that no other user can write, inside folders that no other user can rename it out of (owned by
  this user or root, and not writable by others unless sticky, as ``/dev/shm`` and ``/tmp`` are).
  ``private_folder`` creates it 0700 when missing, checks it, and raises ``UnsafeWeightFolder``
  naming the path and what is wrong.
- **Each run writes in a folder of its own** inside the root, ``run-<pid>-<random>``, made 0700
  (``RunFolder.create``) and removed when the run ends. The run holds an ``flock`` on it while it
  lives, so that the next run under the root removes the folder of a run that was killed (the
  weights in ``/dev/shm`` are memory until reboot) and never the folder of a live one.
- **The GRPO app's policy loads only regular files of this user under its run's folder**
  (``check_weight_file``), so two runs of one user never read each other's files, and a path from
  anywhere else fails naming it. ``Policy.update_weights`` called from a user's own script, with
  no folder configured, loads any safetensors path it is given.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "RunFolder",
    "UnsafeWeightFolder",
    "check_weight_file",
    "default_weight_root",
    "private_folder",
    "weight_root",
]

RUN_PREFIX = "run-"


class UnsafeWeightFolder(ValueError):
    """A weight folder that another user could read or write (a symlink, someone else's folder,
    one that others can write), or a weight file from outside the run's folder."""


def default_weight_root() -> Path:
    """``$XDG_RUNTIME_DIR/forge`` when that is set (a per-user folder the login manager makes
    0700), else ``/dev/shm/forge-<uid>``: in memory, and one per user."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "forge"
    return Path("/dev/shm") / f"forge-{os.geteuid()}"


def weight_root(configured: str | os.PathLike | None) -> Path:
    """The root a run's weight folder goes in: ``configured`` (``weight_sync.dir``), else the default."""
    return Path(configured).absolute() if configured else default_weight_root()


def private_folder(path: str | os.PathLike) -> Path:
    """Create ``path`` 0700 if missing (its parents too), check that it is private; return it
    with its parents' symlinks resolved, so that later uses cannot be redirected.

    ``UnsafeWeightFolder`` names the path and the fix when it is a symlink or not a folder,
    belongs to another user, or can be written by other users, or when a folder above it can be
    written by users other than this one and root (without the sticky bit).
    """
    path = Path(path).absolute()
    parent = Path(os.path.realpath(path.parent))
    _check_parents(parent, path)
    parent.mkdir(parents=True, exist_ok=True)
    _check_parents(parent, path)  # the folders just made are this user's, made under checked ones
    folder = parent / path.name
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeWeightFolder(
            f"weight folder {path} is a symlink (to {os.readlink(folder)!r}): whoever controls its target "
            f"reads or replaces the weights; remove the link or set weight_sync.dir to a real folder of yours"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeWeightFolder(f"weight folder {path} is not a folder; set weight_sync.dir to a folder of yours")
    if info.st_uid != os.geteuid():
        raise UnsafeWeightFolder(
            f"weight folder {path} belongs to uid {info.st_uid}, not to you (uid {os.geteuid()}): its owner "
            f"could read your weights or give your policy theirs; set weight_sync.dir to a folder of yours"
        )
    if info.st_mode & 0o022:
        raise UnsafeWeightFolder(
            f"weight folder {path} can be written by other users (mode {stat.S_IMODE(info.st_mode):o}): they "
            f"could replace your run's folder; chmod go-w {path}, or set weight_sync.dir to a private folder"
        )
    return folder


def _check_parents(parent: Path, path: Path) -> None:
    """Refuse a folder above ``path`` that another user owns or may rename entries in."""
    for above in [parent, *parent.parents]:
        try:
            info = os.stat(above)
        except FileNotFoundError:
            continue  # made by this user next
        if info.st_uid not in (0, os.geteuid()) or (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
            raise UnsafeWeightFolder(
                f"weight folder {path} is inside {above} (uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}), "
                f"where another user could swap it for a folder of theirs; set weight_sync.dir to a folder "
                f"inside folders only you (or root) can write"
            )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder`` itself (no lock file to leave behind)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class RunFolder:
    """One run's folder under a private root: 0700, held (``flock``) while the run lives,
    removed by ``close``. Made by the controller before any role starts; the trainer writes its
    weight files in ``path`` and the policy loads only from there."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def create(cls, root: str | os.PathLike) -> RunFolder:
        """Check ``root`` (``private_folder``), remove the folders of runs that are gone, make ours."""
        root = private_folder(root)
        # One creator or cleaner at a time: a folder being made is never taken for a dead run's.
        with _locked(root):
            remove_finished_runs(root)
            path = Path(tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}-", dir=root))
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_EX)
        return cls(path, fd)

    def close(self) -> None:
        """Remove the folder and its weight files; the run's processes must be done with them."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)  # releases the lock
        self._fd = None

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"


def remove_finished_runs(root: Path) -> None:
    """Remove the ``run-*`` folders under ``root`` that no live run holds (the caller holds the
    root's lock)."""
    for folder in root.glob(f"{RUN_PREFIX}*"):
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # not a folder, or gone already
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live run's
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)


def check_weight_file(path: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """``path`` resolved, if it is a regular file of this user's inside ``folder``; otherwise
    ``UnsafeWeightFolder`` naming both. Symlinks count where they lead."""
    real = Path(os.path.realpath(path))
    base = Path(os.path.realpath(folder))
    if real == base or not real.is_relative_to(base):
        raise UnsafeWeightFolder(
            f"weight file {path} is not under this run's weight folder {folder}: the policy loads only the "
            f"files its own trainer wrote there"
        )
    try:
        info = os.stat(real)
    except FileNotFoundError:
        raise FileNotFoundError(f"weight file {path} does not exist (in the run's weight folder {folder})") from None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        what = f"belongs to uid {info.st_uid}" if stat.S_ISREG(info.st_mode) else "is not a regular file"
        raise UnsafeWeightFolder(
            f"weight file {path} {what}; the policy loads only files that you (uid {os.geteuid()}) wrote"
        )
    return real
