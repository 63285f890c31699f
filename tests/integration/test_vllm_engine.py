"""VllmEngine against transformers on the tiny model: logprobs, weight sync, bad input.

One engine serves the whole module (start-up is ~10 s on CPU); tests that change its weights
put the seed-0 weights back afterwards (the ``engine`` fixture).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from forge.generation import VllmEngine  # noqa: E402
from forge.models import sequence_logprobs  # noqa: E402
from forge.types import Completion  # noqa: E402

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 16
# The last prompt spans more than one 128-token KV block, so it exercises the prefix cache.
PROMPTS = ["3+7=", "12*4=", "what is 5-2?", "a", "1+2=" * 60]


@pytest.fixture(scope="module")
def _engine(tiny_model_dir: Path) -> Iterator[VllmEngine]:
    engine = VllmEngine.create(tiny_model_dir, max_model_len=512, seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(_engine: VllmEngine, tiny_model_dir: Path) -> Iterator[VllmEngine]:
    """The module's engine, back on the seed-0 weights (version 0) after each test."""
    yield _engine
    if _engine.version != 0:
        _engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")), 0)


def _hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> torch.nn.Module:
    return _hf_model(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model_alt(tiny_model_dir_alt: Path) -> torch.nn.Module:
    return _hf_model(tiny_model_dir_alt)


def _flat(groups: list[list[Completion]]) -> list[Completion]:
    return [c for group in groups for c in group]


def _greedy(engine: VllmEngine) -> list[list[int]]:
    groups = engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=MAX_TOKENS)
    return [group[0].token_ids.tolist() for group in groups]


@torch.no_grad()
def _hf_greedy(model: torch.nn.Module, tokenizer, prompts: list[str]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time (no padding)."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt).input_ids])
        seq = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )
        out.append(seq[0, ids.shape[1] :].tolist())
    return out


def test_generate_returns_n_completions_per_prompt_with_consistent_fields(
    engine: VllmEngine, tiny_model_dir: Path
) -> None:
    """Each prompt gets n completions whose ids, logprobs, text and version agree."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    groups = engine.generate(PROMPTS, n=3, temperature=1.0, max_tokens=MAX_TOKENS, seed=0)
    assert [len(g) for g in groups] == [3] * len(PROMPTS)
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            assert c.prompt_ids.tolist() == tokenizer(prompt).input_ids
            assert c.token_ids.dtype == torch.int64 and c.logprobs.dtype == torch.float32
            assert c.token_ids.shape == c.logprobs.shape and 1 <= len(c.token_ids) <= MAX_TOKENS
            assert (c.logprobs <= 0).all()
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert c.policy_version == 0
            assert c.finish_reason in ("stop", "length")


def test_token_id_prompts_match_string_prompts(engine: VllmEngine, tiny_model_dir: Path) -> None:
    """A prompt given as token ids samples exactly what the same prompt as text samples."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    as_ids = [tokenizer(p).input_ids for p in PROMPTS]
    by_text = engine.generate(PROMPTS, n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=3)
    by_ids = engine.generate(as_ids, n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=3)
    for a, b in zip(_flat(by_text), _flat(by_ids)):
        assert torch.equal(a.token_ids, b.token_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_transformers(
    engine: VllmEngine, hf_model: torch.nn.Module, temperature: float
) -> None:
    """vLLM's logprob of each sampled token equals log_softmax(logits / T) from transformers."""
    completions = _flat(
        engine.generate(PROMPTS, n=4, temperature=temperature, max_tokens=MAX_TOKENS, seed=1)
    )
    expected = sequence_logprobs(
        hf_model,
        [c.prompt_ids for c in completions],
        [c.token_ids for c in completions],
        temperature=temperature,
    )
    diff = max((c.logprobs - e).abs().max().item() for c, e in zip(completions, expected))
    assert diff <= 1e-3


def test_update_weights_switches_greedy_output_to_new_model(
    engine: VllmEngine, hf_model_alt: torch.nn.Module, tiny_model_dir_alt: Path
) -> None:
    """After update_weights, greedy output is the new model's, token for token, at the new version."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir_alt)
    before = _greedy(engine)  # also fills the prefix cache with blocks of the old weights
    engine.update_weights(hf_model_alt.state_dict(), version=1)  # holds the tied lm_head
    after = engine.generate(PROMPTS, n=1, temperature=0.0, max_tokens=MAX_TOKENS)

    assert engine.version == 1
    assert all(group[0].policy_version == 1 for group in after)
    assert [group[0].token_ids.tolist() for group in after] == _hf_greedy(
        hf_model_alt, tokenizer, PROMPTS
    )
    assert before != [group[0].token_ids.tolist() for group in after]


def test_restoring_weights_restores_greedy_output(
    engine: VllmEngine,
    hf_model: torch.nn.Module,
    tiny_model_dir: Path,
    tiny_model_dir_alt: Path,
) -> None:
    """Loading other weights and then the original ones (no lm_head key) gives the original output."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine.update_weights(load_file(str(tiny_model_dir_alt / "model.safetensors")), version=1)
    _greedy(engine)
    engine.update_weights(load_file(str(tiny_model_dir / "model.safetensors")), version=2)
    assert engine.version == 2
    assert _greedy(engine) == _hf_greedy(hf_model, tokenizer, PROMPTS)


def _missing(sd: dict) -> str:
    del sd["model.norm.weight"]
    return "model.norm.weight"


def _wrong_shape(sd: dict) -> str:
    key = "model.layers.0.mlp.up_proj.weight"
    sd[key] = sd[key].t().contiguous()
    return key


def _not_a_tensor(sd: dict) -> str:
    key = "model.layers.1.self_attn.q_proj.bias"
    sd[key] = sd[key].tolist()
    return key


def _unexpected(sd: dict) -> str:
    sd["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    return "model.layers.9.mlp.up_proj.weight"


@pytest.mark.parametrize("corrupt", [_missing, _wrong_shape, _not_a_tensor, _unexpected])
def test_invalid_state_dict_is_rejected_and_engine_keeps_working(
    engine: VllmEngine, tiny_model_dir_alt: Path, corrupt
) -> None:
    """A bad state dict raises ValueError naming the key; weights and version stay as they were."""
    before = _greedy(engine)
    state_dict = load_file(str(tiny_model_dir_alt / "model.safetensors"))
    bad_key = corrupt(state_dict)
    with pytest.raises(ValueError, match=re.escape(repr(bad_key))):
        engine.update_weights(state_dict, version=7)
    assert engine.version == 0
    assert _greedy(engine) == before


def test_generate_rejects_bad_arguments(engine: VllmEngine) -> None:
    """Out-of-range sampling arguments and malformed prompts fail before reaching vLLM."""
    with pytest.raises(ValueError, match="n must be"):
        engine.generate(["1+1="], n=0, temperature=1.0, max_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(["1+1="], n=1, temperature=1.0, max_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate(["1+1=", 3.5], n=1, temperature=1.0, max_tokens=4)
