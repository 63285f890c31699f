"""The multi-adapter app's config and a replica's adapter catalog, in-process (no vLLM, no actors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apps.multi_lora.config import AdapterRun, MultiLoraConfig
from forge.actors.multi_lora_policy import multi_lora_engine_kwargs
from forge.generation.adapter_catalog import AdapterCatalog, UnknownAdapter
from forge.models.lora import ADAPTER_WEIGHTS, LoraSettings

GRPO = "configs/grpo_tiny_lora.yaml"
SHARED = ["weight_sync.transport=message"]


def _cfg(*runs: AdapterRun, **kwargs) -> MultiLoraConfig:
    return MultiLoraConfig(grpo=GRPO, shared=list(kwargs.pop("shared", SHARED)), runs=list(runs), **kwargs)


def test_shipped_config_gives_two_runs_with_their_own_task_reward_seed_and_folder() -> None:
    """configs/multi_lora_tiny.yaml: two LoRA runs, each its own output folder, reward and data."""
    from forge.config import load_config

    runs = load_config(MultiLoraConfig, "configs/multi_lora_tiny.yaml").run_configs()
    assert [r.name for r in runs] == ["reverse3", "reverse2"]
    a, b = (r.grpo for r in runs)
    assert a.logging.output_dir != b.logging.output_dir and a.seed != b.seed
    assert dict(a.reward.fns) != dict(b.reward.fns) and a.data.options != b.data.options
    assert a.trainer.lora == b.trainer.lora and a.weight_sync.transport == "message"


def test_duplicate_run_names_are_refused_naming_them() -> None:
    """Two runs named alike would share one adapter id."""
    with pytest.raises(ValueError, match=r"names must be unique.*\['a'\]"):
        _cfg(AdapterRun(name="a"), AdapterRun(name="a"))


@pytest.mark.parametrize("name", ["", "a b", "../x", "-x"])
def test_a_bad_run_name_is_refused_naming_it(name: str) -> None:
    """A name is an adapter id and a folder: letters, digits and '_.-' only."""
    with pytest.raises(ValueError, match=r"runs: name .* must be letters"):
        _cfg(AdapterRun(name=name))


def test_no_runs_is_refused() -> None:
    with pytest.raises(ValueError, match="runs is empty"):
        _cfg()


def test_runs_that_differ_in_what_the_policy_decides_are_refused_naming_run_and_key() -> None:
    """The runs share one policy: a run with another policy.max_tokens is an error naming both."""
    cfg = _cfg(AdapterRun(name="a"), AdapterRun(name="b", overrides=["policy.max_tokens=5"]))
    with pytest.raises(ValueError, match=r"run 'b': policy is .*must be the same in every run"):
        cfg.run_configs()


def test_a_run_without_lora_or_with_the_file_transport_is_refused_naming_it() -> None:
    """Each run trains an adapter, sent as tensors to every replica."""
    with pytest.raises(ValueError, match=r"run 'a': trainer.lora is null"):
        _cfg(AdapterRun(name="a", overrides=["trainer.lora=null"])).run_configs()
    with pytest.raises(ValueError, match=r"run 'a': weight_sync.transport is 'file', expected 'message'"):
        _cfg(AdapterRun(name="a"), shared=["weight_sync.transport=file"]).run_configs()


def test_max_loras_defaults_to_one_per_run_and_caps_at_k() -> None:
    runs = [AdapterRun(name=n) for n in "abc"]
    assert _cfg(*runs).adapters_per_replica == 3
    assert _cfg(*runs, max_loras=2).adapters_per_replica == 2
    assert _cfg(*runs, max_loras=9).adapters_per_replica == 3
    with pytest.raises(ValueError, match=r"max_loras must be an int >= 0"):
        _cfg(*runs, max_loras=-1)


def test_engine_kwargs_leave_vllm_one_spare_adapter_for_a_version_swap() -> None:
    assert multi_lora_engine_kwargs(2) == {"max_loras": 2, "max_cpu_loras": 3}
    with pytest.raises(ValueError, match=r"max_loras must be an int >= 1.*got 0"):
        multi_lora_engine_kwargs(0)


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((2, 4), value)}


def test_catalog_keeps_each_adapters_newest_folder_and_refuses_older_or_unknown(tmp_path: Path) -> None:
    """Base until the first version; one folder per adapter on disk (the newest); an older
    version, an unknown id and a path are refused naming them; forget removes the folders."""
    catalog = AdapterCatalog(LoraSettings(rank=2, target_modules=["q_proj"]), str(tmp_path))
    catalog.add("a")
    catalog.add("b")
    assert catalog.newest("a") == (None, 0)
    first = catalog.receive("a", _tensors(1.0), 1)
    second = catalog.receive("a", _tensors(2.0), 2)
    assert catalog.newest("a") == (second, 2) and catalog.newest("b") == (None, 0)
    assert not Path(first).exists() and (Path(second) / ADAPTER_WEIGHTS).is_file()
    with pytest.raises(ValueError, match=r"adapter 'a': version 1 is older than the 2 it serves"):
        catalog.receive("a", _tensors(1.0), 1)
    with pytest.raises(UnknownAdapter, match=r"adapter 'zz' is not served by this policy \(it serves \['a', 'b'\]\)"):
        catalog.newest("zz")
    with pytest.raises(ValueError, match=r"takes each version's adapter tensors.*got the path"):
        catalog.receive("b", "/some/folder", 1)  # type: ignore[arg-type]
    assert catalog.forget("a") and not Path(second).exists() and not catalog.forget("a")
    assert catalog.ids() == ["b"]


def test_a_restored_run_rolls_its_adapter_back_to_the_checkpoints_version(tmp_path: Path) -> None:
    """rollback=True (a resume, a replaced trainer): version 3 is served, then version 2 of the
    checkpoint becomes the newest, its own folder the one to load."""
    catalog = AdapterCatalog(LoraSettings(rank=2, target_modules=["q_proj"]), str(tmp_path))
    catalog.add("a")
    catalog.receive("a", _tensors(3.0), 3)
    restored = catalog.receive("a", _tensors(2.0), 2, rollback=True)
    assert catalog.newest("a") == (restored, 2) and (Path(restored) / ADAPTER_WEIGHTS).is_file()


def test_the_inbox_takes_only_adapter_tensors_and_adapter_folders_of_the_run(tmp_path: Path) -> None:
    """A LoRA policy's inbox: tensors without PEFT's lora_ names (a full state dict) are refused
    naming one; a folder inside the run's weight folder is taken as it is, one outside refused;
    with no run folder, a folder without adapter weights is refused naming it."""
    from forge.generation.adapter_inbox import AdapterInbox
    from forge.generation.weight_folder import UnsafeWeightFolder, private_folder
    from forge.models.lora import write_adapter_folder

    settings = LoraSettings(rank=2, target_modules=["q_proj"])
    run = private_folder(tmp_path / "run")
    inbox = AdapterInbox(settings, "base", weights_dir=str(run))
    with pytest.raises(ValueError, match=r"loads adapter tensors .*'model\.embed_tokens\.weight'"):
        inbox.receive({"model.embed_tokens.weight": torch.zeros(2, 4), **_tensors(1.0)}, 1)
    mine = str(write_adapter_folder(run / "v1", _tensors(1.0), settings, "base"))
    assert inbox.receive(mine, 1) == mine
    theirs = write_adapter_folder(tmp_path / "elsewhere", _tensors(1.0), settings, "base")
    with pytest.raises(UnsafeWeightFolder, match=r"is not under this run's weight folder"):
        inbox.receive(str(theirs), 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=rf"{tmp_path / 'empty'} is not an adapter folder"):
        AdapterInbox(settings, "base", weights_dir=None).receive(str(tmp_path / "empty"), 1)
