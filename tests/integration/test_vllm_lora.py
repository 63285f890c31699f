"""vLLM serving LoRA adapters on the tiny model: every version a new adapter over the same base.

A real vLLM engine (``VllmEngine`` with ``max_lora_rank``) against PEFT in transformers: the
behaviour logprobs under an adapter are PEFT's; each ``update_adapter`` serves the new version
without reloading the base; a model vLLM has no LoRA layers for is refused before the engine
starts; the policy's rank bounds name both values.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from forge.generation import VllmEngine  # noqa: E402
from forge.models import sequence_logprobs  # noqa: E402
from forge.models.lora import LoraSettings, random_adapter, write_adapter_folder  # noqa: E402
from tests.numerics import assert_close_to_scale  # noqa: E402

pytestmark = pytest.mark.timeout(240)

SETTINGS = LoraSettings(
    rank=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
)
PROMPTS = ["371=", "12*4=", "what is 5-2?", "1+2=" * 20]


def _adapter(model_dir: Path, folder: Path, seed: int) -> torch.nn.Module:
    """A PEFT model over the tiny base with random (non-zero) adapter weights, saved at ``folder``."""
    model, tensors = random_adapter(str(model_dir), SETTINGS, seed, scale=0.3)
    write_adapter_folder(folder, tensors, SETTINGS, str(model_dir))
    return model


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir: Path) -> Iterator[VllmEngine]:
    engine = VllmEngine.create(tiny_model_dir, max_model_len=256, seed=0, max_lora_rank=8)
    yield engine
    engine.shutdown()


def _logprobs(engine: VllmEngine, hf: torch.nn.Module, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    completions = [c for g in engine.generate(PROMPTS, n=4, temperature=temperature, max_tokens=8, seed=3) for c in g]
    want = sequence_logprobs(hf, [c.prompt_ids for c in completions], [c.token_ids for c in completions], temperature)
    return torch.cat([c.logprobs for c in completions]), torch.cat(want)


def test_each_version_is_a_new_adapter_whose_logprobs_are_pefts(
    lora_engine: VllmEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Version 0 serves the base; versions 1 and 2 (two adapters, the first one's folder removed
    once the second is loaded) give PEFT's logprobs for each, tagged with their version."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    got, want = _logprobs(lora_engine, base)
    assert_close_to_scale(got, want, rel=1e-3, scale=1.0, what="base logprobs")
    for version, seed in ((1, 1), (2, 2)):
        folder = tmp_path / f"v{version}"
        peft_model = _adapter(tiny_model_dir, folder, seed)
        lora_engine.update_adapter(folder, version)
        shutil.rmtree(folder)  # loaded now: vLLM does not read the folder again
        assert lora_engine.version == version
        got, want = _logprobs(lora_engine, peft_model, temperature=0.7)
        assert_close_to_scale(got, want, rel=1e-3, scale=1.0, what=f"adapter v{version} logprobs")
        _, base_lp = _logprobs(lora_engine, base, temperature=0.7)
        assert (got - base_lp).abs().max() > 1e-2  # the adapter changed the policy
        assert {
            c.policy_version for g in lora_engine.generate(PROMPTS, n=1, temperature=1.0, max_tokens=2) for c in g
        } == {version}
    assert len(lora_engine.llm.llm_engine.list_loras()) == 1  # the replaced adapter was removed


def test_a_model_vllm_cannot_serve_with_adapters_is_refused_naming_its_architecture(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """LoRA on a model class vLLM has no LoRA layers for (GPT-2): a ValueError at start-up, before
    the engine starts, naming the architecture and the way out."""
    from forge.generation.lora import check_serves_lora

    folder = tmp_path / "gpt2-like"
    folder.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"cannot serve LoRA adapters.*GPT2LMHeadModel.*trainer\.lora: null"):
        check_serves_lora(folder)
    check_serves_lora(tiny_model_dir)  # Qwen2 has them


def test_a_rank_above_max_lora_rank_names_both(tiny_model_dir: Path) -> None:
    """trainer.lora.rank above policy.max_lora_rank: a ValueError naming both values, from the
    policy's config (and the app's); a max_lora_rank vLLM does not accept names vLLM's values."""
    from forge.actors import PolicyConfig

    with pytest.raises(ValueError, match=r"trainer\.lora\.rank \(16\) is above policy\.max_lora_rank \(8\)"):
        PolicyConfig(model_path=str(tiny_model_dir), lora=LoraSettings(rank=16), max_lora_rank=8)
    with pytest.raises(ValueError, match=r"policy\.max_lora_rank must be one of vLLM's \(1, 8, 16"):
        PolicyConfig(model_path=str(tiny_model_dir), lora=LoraSettings(rank=4), max_lora_rank=4)
    assert PolicyConfig(model_path=str(tiny_model_dir), lora=LoraSettings(rank=4)).lora.rank == 4


def test_the_serving_rank_is_the_smallest_vllm_accepts_that_holds_the_adapter_unless_set() -> None:
    """vLLM sizes every adapter slot by max_lora_rank: the default is the smallest accepted
    value at or above the trainer's rank; a set one is kept."""
    from forge.generation.lora import serving_rank

    assert [serving_rank(r) for r in (1, 4, 8, 9, 16, 100)] == [1, 8, 8, 16, 16, 128]
    assert serving_rank(4, 32) == 32


async def test_an_adapter_update_in_flight_lets_running_sequences_finish_on_the_adapter_they_started_with(
    lora_engine: VllmEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An update to adapter version 2 lands between two steps of a call sampling on version 1:
    nothing waits, the call's samples are exactly those of version 1 alone (same seed), every
    token version 1's; version 1 stays loaded in vLLM while they run and is removed once they
    finished; the next call samples version 2."""
    import asyncio

    _adapter(tiny_model_dir, tmp_path / "v1", seed=1)
    _adapter(tiny_model_dir, tmp_path / "v2", seed=2)
    lora_engine.update_adapter(tmp_path / "v1", 1)
    settings = {"n": 2, "temperature": 1.0, "max_tokens": 40, "seed": 5}
    alone = [c for g in lora_engine.generate(PROMPTS[:2], **settings) for c in g]
    old_id = lora_engine._adapters.current.lora_int_id
    clock, start = lora_engine.steps.clock, lora_engine.steps.clock.steps

    async def update() -> set[int]:
        while clock.steps - start < 3:
            await asyncio.sleep(0)  # runs between two engine steps
        lora_engine.update_adapter(tmp_path / "v2", 2)
        return set(lora_engine.llm.llm_engine.list_loras())

    groups, loaded_meanwhile = await asyncio.wait_for(
        asyncio.gather(lora_engine.generate_async(PROMPTS[:2], **settings), update()), 120
    )
    during = [c for g in groups for c in g]
    assert max(len(c.token_ids) for c in during) > 3, "the call ended before the update: nothing tested"
    assert [c.token_ids.tolist() for c in during] == [c.token_ids.tolist() for c in alone]
    assert_close_to_scale(
        torch.cat([c.logprobs for c in during]), torch.cat([c.logprobs for c in alone]), 1e-4, what="logprobs"
    )
    assert all(c.versions().unique().tolist() == [1] for c in during)
    assert old_id in loaded_meanwhile
    assert old_id not in lora_engine.llm.llm_engine.list_loras()
    after = [c for g in lora_engine.generate(PROMPTS[:2], **settings) for c in g]
    assert all(c.policy_version == 2 for c in after)
    assert [c.token_ids.tolist() for c in after] != [c.token_ids.tolist() for c in alone]
