"""Training checkpoints (torch.distributed.checkpoint in one process): atomic, complete, resumable."""

import random

import pytest
import torch

from forge.checkpoint import (
    TrainingState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    read_training_state,
    save_checkpoint,
)


def tiny_model_and_optimizer(seed: int = 0, steps: int = 1):
    """A tied embedding/head pair and AdamW after ``steps`` steps; ``steps=0`` leaves the
    optimizer without state, as a freshly started trainer's."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied, like an LM head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(torch.tensor([1, 2, 3])).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_round_trip_restores_weights_optimizer_state_step_and_rng(tmp_path):
    """A model and optimizer made from another seed, never stepped, get the saved weights and
    every optimizer tensor back; the RNGs continue with the very draws that followed the save."""
    model, opt = tiny_model_and_optimizer(seed=0, steps=3)
    random.seed(5)
    torch.manual_seed(5)
    path = save_checkpoint(tmp_path, model, opt, TrainingState(step=7, policy_version=6, extra={"seed": 3}))
    expected_python, expected_torch = random.random(), torch.rand(3)

    fresh, fresh_opt = tiny_model_and_optimizer(seed=1, steps=0)
    assert not torch.equal(fresh[0].weight, model[0].weight)
    loaded = load_checkpoint(path, fresh, fresh_opt)
    assert (loaded.step, loaded.policy_version, loaded.extra, loaded.world_size) == (7, 6, {"seed": 3}, 1)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh[1].weight is fresh[0].weight  # still tied
    want, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert want.keys() == got.keys() and want
    for pid, state in want.items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[pid][key], state[key]), (pid, key)
    assert random.random() == expected_python
    assert torch.equal(torch.rand(3), expected_torch)


def test_read_checkpoint_gives_full_tensors_and_optimizer_state_by_parameter_name(tmp_path):
    model, opt = tiny_model_and_optimizer(steps=2)
    path = save_checkpoint(tmp_path, model, opt, TrainingState(step=2, policy_version=2))
    weights, optimizer, state = read_checkpoint(path)
    assert state.step == 2 and len(state.rng) == 1
    assert torch.equal(weights["0.weight"], model[0].weight) and torch.equal(weights["1.bias"], model[1].bias)
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(optimizer["state"]["0.weight"]["exp_avg"], exp_avg)


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    model, opt = tiny_model_and_optimizer()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, model, opt, TrainingState(step, step), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000006"]
    assert latest_checkpoint(tmp_path).name == "step_00000006"


def test_half_written_checkpoint_is_ignored(tmp_path):
    """A folder with shards but without DCP's metadata or the training state is not a checkpoint."""
    model, opt = tiny_model_and_optimizer()
    save_checkpoint(tmp_path, model, opt, TrainingState(3, 3))
    broken = tmp_path / "step_00000009"
    broken.mkdir()
    (broken / "__0_0.distcp").write_bytes(b"partial")
    (broken / "trainer_state.pt").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    with pytest.raises(FileNotFoundError, match="not a complete forge checkpoint"):
        read_training_state(broken)
    with pytest.raises(FileNotFoundError, match="not a complete forge checkpoint"):
        load_checkpoint(broken, model, opt)


def test_a_save_removes_the_temporary_folder_of_a_killed_save(tmp_path):
    """Leftovers of a save killed mid-write do not pile up: the next save removes them."""
    model, opt = tiny_model_and_optimizer()
    (tmp_path / ".tmp_killed").mkdir()
    (tmp_path / ".tmp_killed" / "__0_0.distcp").write_bytes(b"partial")
    save_checkpoint(tmp_path, model, opt, TrainingState(1, 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_no_checkpoint_means_none(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
