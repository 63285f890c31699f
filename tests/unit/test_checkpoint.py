"""Training checkpoints: atomic, complete, resumable."""

import random

import pytest
import torch

from forge.checkpoint import (
    TrainingState,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)


def tiny_model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied, like an LM head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(torch.tensor([1, 2, 3])).sum()
    loss.backward()
    opt.step()
    return model, opt


def test_round_trip_restores_weights_optimizer_step_and_rng(tmp_path):
    model, opt = tiny_model_and_optimizer()
    random.seed(5)
    torch.manual_seed(5)
    rng = capture_rng()
    state = TrainingState(step=7, policy_version=7, optimizer=opt.state_dict(), rng=rng, extra={"seed": 3})
    path = save_checkpoint(tmp_path, model.state_dict(), state)
    expected_next = (random.random(), torch.rand(3))

    weights, loaded = load_checkpoint(path)
    assert loaded.step == 7 and loaded.policy_version == 7 and loaded.extra == {"seed": 3}
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    fresh, fresh_opt = tiny_model_and_optimizer()
    fresh.load_state_dict(weights)
    fresh_opt.load_state_dict(loaded.optimizer)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    restore_rng(loaded.rng)
    assert (random.random(), torch.rand(3))[0] == expected_next[0]


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    model, opt = tiny_model_and_optimizer()
    for step in (2, 4, 6):
        save_checkpoint(
            tmp_path, model.state_dict(), TrainingState(step, step, opt.state_dict(), capture_rng()), keep=2
        )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000006"]
    assert latest_checkpoint(tmp_path).name == "step_00000006"


def test_half_written_checkpoint_is_ignored(tmp_path):
    model, opt = tiny_model_and_optimizer()
    save_checkpoint(tmp_path, model.state_dict(), TrainingState(3, 3, opt.state_dict(), capture_rng()))
    broken = tmp_path / "step_00000009"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    with pytest.raises(FileNotFoundError, match="not a complete forge checkpoint"):
        load_checkpoint(broken)


def test_a_save_removes_the_temporary_folder_of_a_killed_save(tmp_path):
    """Leftovers of a save killed mid-write do not pile up: the next save removes them."""
    model, opt = tiny_model_and_optimizer()
    (tmp_path / ".tmp_killed").mkdir()
    (tmp_path / ".tmp_killed" / "model.safetensors").write_bytes(b"partial")
    save_checkpoint(tmp_path, model.state_dict(), TrainingState(1, 1, opt.state_dict(), capture_rng()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_no_checkpoint_means_none(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
