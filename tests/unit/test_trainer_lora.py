"""The trainer with a LoRA adapter (``trainer.lora``, through PEFT): only the adapter trains, syncs
and is checkpointed; two FSDP2 ranks take the one-rank step; the export is an adapter folder and
a merged Hugging Face folder; the base with the adapter off is the reference.

Real Monarch proc meshes, real torch.distributed (gloo) between the ranks; one torch thread each.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from forge.models.lora import LoraSettings
from tests.numerics import assert_close_to_scale
from tests.unit.test_trainer_sharded import _batch, _start, _start_in_process, _stop

LR = 1e-2
RANK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forge.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", hidden_size=64, num_layers=3, init_std=0.1)


def _config(model_dir: Path, checkpoint_dir: Path | None = None, **overrides):
    from forge.actors.trainer import TrainerConfig

    base = dict(
        model_path=str(model_dir),
        temperature=0.7,
        lr=LR,
        max_grad_norm=0.5,
        num_threads=1,
        lora=LoraSettings(rank=RANK, alpha=8.0),
        ref_from_base=True,
    )
    base.update(overrides)
    return TrainerConfig(**base, checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir))


@pytest.mark.parametrize(
    ("field", "value"), [("rank", 0), ("rank", -2), ("rank", 2.5), ("alpha", 0), ("alpha", -1.0), ("dropout", 1.0)]
)
def test_lora_settings_refuse_a_rank_or_alpha_that_is_not_positive(field: str, value: object):
    """A rank that is not an integer >= 1, an alpha <= 0 or a dropout outside [0, 1): a
    ValueError naming the key and the value."""
    with pytest.raises(ValueError, match=rf"trainer\.lora\.{field} .*got {value!r}"):
        LoraSettings(**{field: value})


def test_a_target_module_the_model_lacks_names_it_and_the_modules_it_has(model_dir: Path):
    """``target_modules`` with a name the model has no linear layer for: a ValueError naming it
    and the linear layers the model does have (PEFT would accept it beside one that exists)."""
    from transformers import AutoModelForCausalLM

    from forge.models.lora import inject

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"'qkv_proj'.*\['down_proj', 'gate_proj', 'k_proj'"):
        inject(model, LoraSettings(target_modules=["q_proj", "qkv_proj"]), str(model_dir))


def test_ref_from_base_without_lora_is_a_config_error(model_dir: Path):
    """``ref_from_base`` on a full fine-tuning trainer: there is no frozen base to score with."""
    with pytest.raises(ValueError, match="ref_from_base needs lora"):
        _config(model_dir, lora=None)


def test_adapter_folders_are_whole_new_paths_and_only_the_newest_three_stay(tmp_path: Path) -> None:
    """The file transport's adapter folders: each version a new path holding a whole PEFT folder
    (its tensors as written), even for a version number written again; the newest ``KEEP`` stay."""
    from safetensors.torch import load_file

    from forge.actors.trainer_lora import KEEP, AdapterFolders
    from forge.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    folders = AdapterFolders(tmp_path, LoraSettings(rank=2, target_modules=["q_proj"]), "base")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    paths = [folders.write({name: torch.full((2, 4), float(v))}, v) for v in (1, 2, 3, 4, 4)]
    assert len(set(paths)) == 5  # version 4 twice (a restarted trainer): two paths
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(p).name for p in paths[-KEEP:])
    for path, value in zip(paths[-KEEP:], (3, 4, 4)):
        assert (Path(path) / ADAPTER_CONFIG).is_file()
        assert torch.equal(load_file(Path(path) / ADAPTER_WEIGHTS)[name], torch.full((2, 4), float(value)))
    folders.close()
    assert list(tmp_path.iterdir()) == []


async def test_two_rank_lora_trains_checkpoints_and_exports_only_the_adapter(model_dir: Path, tmp_path: Path):
    """procs=2 and procs=1 LoRA trainers take the same step; ``weights`` is the adapter alone (PEFT
    names, a few % of the model); the 2-rank checkpoint holds adapter tensors only and loads into
    one rank; the export's ``adapter`` folder loads with PEFT and its merged folder with
    transformers, both scoring like the trainer's adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from forge.checkpoint import checkpoint_shapes, read_checkpoint
    from forge.distributed import call_spmd
    from forge.models import sequence_logprobs

    batch = _batch(model_dir)
    one = two = fresh = None
    try:
        one, two = await asyncio.gather(
            _start_in_process(_config(model_dir)),
            _start(2, _config(model_dir, tmp_path / "ckpt", micro_batch_size=2)),
        )
        s1, s2 = await asyncio.gather(
            call_spmd(one.train_step, batch, timeout_s=120), call_spmd(two.train_step, batch, timeout_s=120)
        )
        for name in ("loss", "pg_loss", "kl"):
            assert_close_to_scale(s2[name], s1[name], 1e-5, scale=1.0, what=name)
        (w1, v1), (w2, v2) = await asyncio.gather(call_spmd(one.weights), call_spmd(two.weights))
        assert v1 == v2 == 1 and w1.keys() == w2.keys()
        assert all(".lora_A." in k or ".lora_B." in k for k in w1), sorted(w1)[:3]
        assert len(w1) == 2 * 4 * 3  # A and B of q/k/v/o in 3 layers
        assert max(float(w1[k].abs().max()) for k in w1 if "lora_B" in k) > 1e-3  # the step moved B off 0
        assert_close_to_scale(w2, w1, 1e-3, scale=LR, what="adapter")
        full = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
        assert sum(t.numel() for t in w1.values()) < 0.2 * full

        path = await call_spmd(two.save_checkpoint, 1, {"dataset_position": 3})
        assert await call_spmd(two.wait_checkpoint) == path
        shapes = checkpoint_shapes(path)
        assert shapes and all("lora_" in name for name in shapes), sorted(shapes)[:3]
        _, optim, _ = read_checkpoint(path)
        assert set(optim["state"]) == set(shapes)  # the optimizer state of the adapter, nothing else
        fresh = await _start_in_process(_config(model_dir))
        assert await call_spmd(fresh.load_checkpoint, path) == (1, 1, {"dataset_position": 3})
        loaded, _ = await call_spmd(fresh.weights)
        assert all(torch.equal(loaded[k], w2[k]) for k in w2)

        folder = Path(await call_spmd(two.export_model, str(tmp_path / "final_model")))
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (folder / "adapter").iterdir()}
        merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), folder / "adapter")
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        episodes = batch.unpack()
        prompts, responses = [e.prompt_ids for e in episodes], [e.response_ids for e in episodes]
        want = torch.cat(sequence_logprobs(adapted.eval(), prompts, responses, 0.7))
        assert_close_to_scale(torch.cat(sequence_logprobs(merged, prompts, responses, 0.7)), want, what="merged")
        assert (torch.cat(sequence_logprobs(base, prompts, responses, 0.7)) - want).abs().max() > 1e-4
    finally:
        await _stop(one, two, fresh)


async def test_reference_from_the_base_equals_a_frozen_reference_role(model_dir: Path):
    """After a LoRA step, the trainer's reference logprobs (the base, adapter off) equal those of
    a separate frozen ``ReferenceModel`` role to fp32 tolerance, while the adapted model's differ."""
    from monarch.actor import this_proc

    from forge.actors.reference_model import ReferenceConfig, ReferenceModel
    from forge.distributed import call_spmd

    batch = _batch(model_dir, n=6)
    pairs = [(e.prompt_ids, e.response_ids) for e in batch.unpack()]
    config = ReferenceConfig(model_path=str(model_dir), temperature=0.7)
    reference = this_proc().spawn("frozen_reference", ReferenceModel, config)
    trainer = None
    try:
        trainer = await _start(2, _config(model_dir))
        await asyncio.wait_for(reference.setup.call_one(), 120)
        await call_spmd(trainer.train_step, batch, timeout_s=120)
        got = await call_spmd(trainer.reference_logprobs, pairs, timeout_s=120)
        flat, lengths = await asyncio.wait_for(reference.logprobs.call_one(pairs), 120)
        assert [len(t) for t in got] == lengths
        assert_close_to_scale(torch.cat(got), flat, what="reference logprobs")
        stats = await call_spmd(trainer.train_step, batch, timeout_s=120)  # the adapter has moved: a KL above 0
        assert stats["kl"] > 0
    finally:
        await _stop(trainer)
        await reference.stop()


def _grpo(*overrides: str):
    from apps.grpo.config import GRPOConfig
    from forge.config import load_config

    return load_config(GRPOConfig, "configs/grpo_tiny_lora.yaml", list(overrides))


def test_the_lora_app_config_takes_the_reference_from_the_base_unless_told_otherwise():
    """``configs/grpo_tiny_lora.yaml``: ``reference.from_base`` defaults to true with LoRA (no
    reference role is specified), false without it; ``reference.from_base=false`` keeps the role."""
    from apps.grpo.roles import role_specs

    cfg = _grpo()
    assert cfg.ref_from_base and cfg.trainer.lora.rank == 16
    names = [s.name for s in role_specs(cfg, "models/tiny")]
    assert "reference" not in names and "trainer" in names
    assert "reference" in [s.name for s in role_specs(_grpo("reference.from_base=false"), "models/tiny")]
    assert not _grpo("trainer.lora=null").ref_from_base


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("trainer.lora.rank=32", "policy.max_lora_rank=16"),
            r"trainer\.lora\.rank \(32\) is above policy\.max_lora_rank \(16\)",
        ),
        (("trainer.lora.rank=0",), r"trainer\.lora\.rank must be an integer >= 1, got 0"),
        (("trainer.lora.alpha=0",), r"trainer\.lora\.alpha must be a number > 0, got 0"),
        (("trainer.lora=null", "reference.from_base=true"), r"reference\.from_base needs trainer\.lora"),
        (("policy.engine_mode=async",), r"trainer\.lora needs policy\.engine_mode 'batched'"),
    ],
)
def test_bad_lora_settings_in_the_app_config_name_the_values(overrides: tuple[str, ...], message: str):
    """A rank above ``policy.max_lora_rank``, a rank or alpha that is not positive, ``from_base``
    without an adapter, or the async engine with LoRA: an error at load naming the values."""
    with pytest.raises(Exception, match=message):
        _grpo(*overrides)
