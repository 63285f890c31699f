"""Training checkpoints (torch.distributed.checkpoint in one process): atomic, complete, resumable,
and loaded without running code from them."""

import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from forge.checkpoint import (
    TrainingState,
    UnsafeCheckpoint,
    convert_training_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    read_training_state,
    write_checkpoint,
)

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]


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
    path = write_checkpoint(tmp_path, model, opt, TrainingState(step=7, policy_version=6, extra={"seed": 3}))
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
    path = write_checkpoint(tmp_path, model, opt, TrainingState(step=2, policy_version=2))
    weights, optimizer, state = read_checkpoint(path)
    assert state.step == 2 and len(state.rng) == 1
    assert torch.equal(weights["0.weight"], model[0].weight) and torch.equal(weights["1.bias"], model[1].bias)
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(optimizer["state"]["0.weight"]["exp_avg"], exp_avg)


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    model, opt = tiny_model_and_optimizer()
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, model, opt, TrainingState(step, step), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000006"]
    assert latest_checkpoint(tmp_path).name == "step_00000006"


def test_half_written_checkpoint_is_ignored(tmp_path):
    """A folder with shards but without DCP's metadata or the training state is not a checkpoint."""
    model, opt = tiny_model_and_optimizer()
    write_checkpoint(tmp_path, model, opt, TrainingState(3, 3))
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
    write_checkpoint(tmp_path, model, opt, TrainingState(1, 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]


def test_no_checkpoint_means_none(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None


def test_a_failed_save_leaves_the_previous_checkpoint_and_no_temporary_folder(tmp_path):
    """A save that fails (here DCP's copy of a model of meta tensors, before the write) removes
    its staging folder; the newest complete checkpoint is still the previous one."""
    model, opt = tiny_model_and_optimizer()
    write_checkpoint(tmp_path, model, opt, TrainingState(3, 3))
    meta = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises((CheckpointException, NotImplementedError), match="meta tensor"):
        write_checkpoint(tmp_path, meta, torch.optim.SGD(meta.parameters()), TrainingState(4, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003"]
    assert read_training_state(latest_checkpoint(tmp_path)).step == 3


# ------------------------------------------------------------------ files that would run code
class _RunsCode:
    """Unpickling this writes ``marker``: what a crafted checkpoint file could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _unrestricted_load_runs_it(load: str, marker: Path) -> None:
    """The control: ``load`` (a Python statement) run in another process does write ``marker``
    (whatever fails after), so the file really runs code when loaded the way forge does not."""
    done = subprocess.run([sys.executable, "-c", f"import torch\n{load}"], capture_output=True, text=True)
    assert marker.exists() and marker.read_text() == "ran", done.stderr[-2000:]


def test_a_training_state_whose_unpickling_would_run_code_is_refused_and_nothing_runs(tmp_path):
    model, opt = tiny_model_and_optimizer()
    path = write_checkpoint(tmp_path, model, opt, TrainingState(2, 2))
    marker = tmp_path / "ran"
    state = {"step": 2, "policy_version": 2, "rng": [], "extra": {"dataset_position": _RunsCode(marker)}}
    torch.save(state, path / "trainer_state.pt")
    file = path / "trainer_state.pt"
    with pytest.raises(UnsafeCheckpoint, match=rf"{file}.*builtins\.exec.*python -m forge\.checkpoint convert"):
        load_checkpoint(path, model, opt)
    with pytest.raises(UnsafeCheckpoint, match=str(file)):
        read_checkpoint(path)
    assert not marker.exists()
    _unrestricted_load_runs_it(f"torch.load({str(file)!r}, weights_only=False)", marker)


def test_a_dcp_metadata_whose_unpickling_would_run_code_is_refused_and_nothing_runs(tmp_path):
    """DCP reads its own .metadata with a bare pickle.load; forge's reader allows DCP's classes only."""
    model, opt = tiny_model_and_optimizer()
    path = write_checkpoint(tmp_path, model, opt, TrainingState(2, 2))
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(UnsafeCheckpoint, match=rf"{path / '.metadata'} names builtins\.exec"):
        load_checkpoint(path, model, opt)
    with pytest.raises(UnsafeCheckpoint, match="builtins.exec"):
        read_checkpoint(path)
    assert not marker.exists()
    load = f"import torch.distributed.checkpoint as d; d.FileSystemReader({str(path)!r}).read_metadata()"
    _unrestricted_load_runs_it(load, marker)


def test_a_dcp_metadata_that_points_outside_its_folder_is_refused(tmp_path):
    """A shard path in the metadata (DCP's classes only) that leaves the checkpoint folder is refused."""
    from forge.unpickling import PlainReader

    model, opt = tiny_model_and_optimizer()
    path = write_checkpoint(tmp_path, model, opt, TrainingState(2, 2))
    metadata = PlainReader(str(path)).read_metadata()
    next(iter(metadata.storage_data.values())).relative_path = "../../secret"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match=r"points at shard file '\.\./\.\./secret', outside its checkpoint"):
        load_checkpoint(path, model, opt)


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's own, about saving over a checkpoint in one process
def test_a_checkpoint_entry_whose_unpickling_would_run_code_is_refused_and_nothing_runs(tmp_path):
    """A non-tensor entry of the shards (DCP loads them with weights_only=False) is refused too."""
    model, opt = tiny_model_and_optimizer()
    path = write_checkpoint(tmp_path, model, opt, TrainingState(2, 2))
    marker = tmp_path / "ran"
    from forge.checkpoint import _dcp_state

    crafted = _dcp_state(model, opt)
    crafted["optimizer"]["param_groups"][0]["lr"] = _RunsCode(marker)
    dcp.save(crafted, checkpoint_id=path)  # over the saved shards and metadata
    with pytest.raises(UnsafeCheckpoint, match="'optimizer.param_groups.0.lr'"):
        load_checkpoint(path, model, opt)
    with pytest.raises(UnsafeCheckpoint, match="'optimizer.param_groups.0.lr'"):
        read_checkpoint(path)
    assert not marker.exists()
    load = f"from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; f({str(path)!r}, 'x.pt')"
    _unrestricted_load_runs_it(load.replace("'x.pt'", repr(str(tmp_path / "x.pt"))), marker)


def test_save_refuses_extra_state_that_a_resume_could_not_load(tmp_path):
    """numpy values in extra would need unrestricted unpickling: a TypeError, and nothing written."""
    model, opt = tiny_model_and_optimizer()
    with pytest.raises(TypeError, match=r"state\.extra holds numpy.*int\(\) of a numpy value"):
        write_checkpoint(tmp_path, model, opt, TrainingState(1, 1, extra={"position": np.int64(3)}))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ checkpoints of earlier versions
def test_a_checkpoint_written_by_7083df2_still_resumes(tmp_path):
    """The committed checkpoint that forge 7083df2 wrote (``data/make_checkpoint_7083df2.py``)
    loads as it is: its step numbers, dataset position, weights, optimizer state and RNG."""
    path = shutil.copytree(DATA / "checkpoint_7083df2", tmp_path / "checkpoints") / "step_00000003"
    assert latest_checkpoint(path.parent) == path
    fresh, fresh_opt = tiny_model_and_optimizer(seed=1, steps=0)
    loaded = load_checkpoint(path, fresh, fresh_opt)
    assert (loaded.step, loaded.policy_version, loaded.extra, loaded.world_size) == (3, 3, {"dataset_position": 12}, 1)
    draws = torch.rand(3)
    torch.manual_seed(5)  # what the writer had seeded just before its save
    assert torch.equal(draws, torch.rand(3))
    model, opt = tiny_model_and_optimizer(seed=0, steps=3)  # what the writer had trained
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], tensor)
    for pid, state in opt.state_dict()["state"].items():
        torch.testing.assert_close(fresh_opt.state_dict()["state"][pid]["exp_avg"], state["exp_avg"])
    weights, _, _ = read_checkpoint(path)
    torch.testing.assert_close(weights["1.bias"], model[1].bias)


def test_a_trusted_training_state_with_numpy_values_converts_once_and_then_resumes(tmp_path):
    """A state file that a user's own script wrote with numpy values (refused, naming the file and
    the command) loads after ``python -m forge.checkpoint convert``, with the same values."""
    model, opt = tiny_model_and_optimizer()
    path = write_checkpoint(tmp_path, model, opt, TrainingState(5, 4))
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    state["extra"] = {"position": np.int64(7), "scores": np.array([0.5, 1.5]), "name": "run"}
    torch.save(state, path / "trainer_state.pt")
    with pytest.raises(UnsafeCheckpoint, match=rf"{path / 'trainer_state.pt'}.*numpy.*convert {path}"):
        read_training_state(path)
    command = [sys.executable, "-m", "forge.checkpoint", "convert", str(path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
    assert "converted" in done.stdout
    extra = read_training_state(path).extra
    assert extra["position"] == 7 and type(extra["position"]) is int and extra["name"] == "run"
    assert torch.equal(extra["scores"], torch.tensor([0.5, 1.5], dtype=torch.float64))
    assert load_checkpoint(path, model, opt).step == 5


def test_convert_refuses_what_it_cannot_make_plain_and_leaves_the_file(tmp_path):
    model, opt = tiny_model_and_optimizer()
    path = write_checkpoint(tmp_path, model, opt, TrainingState(5, 4))
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    state["extra"] = {"when": Path("/x")}
    torch.save(state, path / "trainer_state.pt")
    before = (path / "trainer_state.pt").read_bytes()
    with pytest.raises(TypeError, match=r"extra\['when'\] is a pathlib\.PosixPath"):
        convert_training_state(path)
    assert (path / "trainer_state.pt").read_bytes() == before


def test_a_checkpoint_of_another_layout_is_refused_naming_both_layouts(tmp_path):
    """check_fits names the first difference and both sides' layouts (layers, hidden, vocab, size)."""
    from forge.checkpoint import check_fits
    from forge.models.layout import describe_layout

    def decoder(layers: int, hidden: int) -> torch.nn.Module:
        blocks = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(512, hidden)})
        blocks["layers"] = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        return torch.nn.ModuleDict({"model": blocks})

    saved = decoder(layers=2, hidden=64)
    path = write_checkpoint(
        tmp_path, saved, torch.optim.AdamW(saved.parameters()), TrainingState(step=1, policy_version=1)
    )
    own = {name: tuple(t.shape) for name, t in saved.state_dict().items()}
    check_fits(path, own, "no fix needed")  # its own shapes fit
    assert describe_layout(own) == "2 layers, hidden 64, vocab 512, 41088 params"

    wider = {name: tuple(t.shape) for name, t in decoder(layers=4, hidden=128).state_dict().items()}
    with pytest.raises(ValueError, match="use the right model") as info:
        check_fits(path, wider, "use the right model")
    message = str(info.value)
    assert "model.layers.2.weight" in message  # the first difference: layers the checkpoint lacks
    assert "The checkpoint's layout: 2 layers, hidden 64, vocab 512" in message
    assert "the model's: 4 layers, hidden 128, vocab 512, 0.1M params" in message
