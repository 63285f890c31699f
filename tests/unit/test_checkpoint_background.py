"""Checkpoints written in the background (``forge.checkpoint.start_checkpoint``): a snapshot at
the call, complete as soon as the files are, and a process killed mid-write leaves the previous
checkpoint as the newest one."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from forge.checkpoint import (
    TrainingState,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    read_training_state,
    start_checkpoint,
    write_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]


def _model_and_optimizer(width: int = 16) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, width)).sum().backward()
    opt.step()
    return model, opt


def test_a_background_checkpoint_holds_the_state_at_the_call_and_is_in_place_when_written(tmp_path: Path) -> None:
    """Training goes on while the files are written: what the checkpoint holds is the state when
    ``start_checkpoint`` returned; after ``wait`` it is the newest complete checkpoint."""
    model, opt = _model_and_optimizer()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    pending = start_checkpoint(tmp_path, model, opt, TrainingState(7, 7))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next step, while the write may still run
    assert pending.wait() == tmp_path / "step_00000007" and pending.done()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000007"
    fresh, fresh_opt = _model_and_optimizer()
    assert load_checkpoint(tmp_path / "step_00000007", fresh, fresh_opt).step == 7
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in at_save.items())


_KILLED_MID_WRITE = """
import os, signal, sys, time, torch
from forge.checkpoint import TrainingState, write_checkpoint, start_checkpoint
root = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8)))  # 8.4 M params: 100 MB with AdamW
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.ones(2, 1024)).sum().backward()
opt.step()
write_checkpoint(root, model, opt, TrainingState(1, 1))
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)  # step 2's weights differ from step 1's
pending = start_checkpoint(root, model, opt, TrainingState(2, 2))
while not any(f.suffix == ".distcp" for f in pending.staging.iterdir()):
    time.sleep(0.001)  # until the writer thread has a shard file open
os.kill(os.getpid(), signal.SIGKILL)  # mid-write: DCP's .metadata comes after the shards
"""


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint_and_names_the_half_written_one(
    tmp_path: Path, caplog
) -> None:
    """SIGKILL once a background checkpoint's shard file is being written: step 2's folder never
    got its final name (it is still the temporary one, holding a shard and no metadata: the kill
    landed mid-write), step 1 is the newest complete checkpoint and a load restores its weights,
    the half-written folder is named in a warning, and the next save removes it."""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_MID_WRITE), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    (partial,) = [n for n in names if n.startswith(".tmp_")]
    assert names == [partial, "step_00000001"], names  # no step_00000002: the kill came before the move
    with caplog.at_level(logging.WARNING, logger="forge.checkpoint"):
        newest = latest_checkpoint(tmp_path)
    assert newest == tmp_path / "step_00000001"
    assert partial in caplog.text and "stopped before it was complete" in caplog.text
    assert read_training_state(newest).step == 1
    written = {f.name for f in (tmp_path / partial).iterdir()}
    assert any(n.endswith(".distcp") for n in written) and ".metadata" not in written, written
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert load_checkpoint(newest, model, opt).step == 1
    step1, _, _ = read_checkpoint(newest)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in step1.items())
    write_checkpoint(tmp_path, model, opt, TrainingState(3, 3))  # the resumed run's next checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000003"]
