"""The tiny test model: character tokenizer, build, idempotence, and padding-free logprobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from forge.models import build_char_tokenizer, make_tiny_model, sequence_logprobs
from forge.models.tiny import LAYOUTS, QWEN3_CHAT_IDS, QWEN3_VOCAB_SIZE
from tests.numerics import assert_close_to_scale

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOY_STRINGS = ["3+7=", "333777", "12*4=48", "9-3=6", "what is 5-2? 3.", "a b\nc"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.mark.parametrize("text", TOY_STRINGS)
def test_tokenizer_round_trips_one_token_per_character(text: str) -> None:
    """Every character is exactly one token, and decoding gives the text back."""
    tokenizer = build_char_tokenizer()
    ids = tokenizer(text).input_ids
    assert ids == [tokenizer.convert_tokens_to_ids(ch) for ch in text]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_vocabulary_is_small_and_has_the_special_tokens() -> None:
    """64 tokens; pad/bos/eos/unk are distinct; no BOS is added to prompts."""
    tokenizer = build_char_tokenizer()
    assert len(tokenizer) == 64
    specials = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    assert len(specials | {tokenizer.unk_token_id}) == 4
    assert tokenizer("1").input_ids == [tokenizer.convert_tokens_to_ids("1")]


def test_tokenizer_lowercases_and_maps_unknown_characters_to_unk() -> None:
    """Upper case folds to lower case; a character outside the vocabulary becomes <unk>."""
    tokenizer = build_char_tokenizer()
    assert tokenizer("AbC").input_ids == tokenizer("abc").input_ids
    assert tokenizer("é").input_ids == [tokenizer.unk_token_id]


def test_tokenizer_decode_skips_eos(model_dir: Path) -> None:
    """The saved tokenizer loads with AutoTokenizer and drops <eos> when asked to."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("333777").input_ids + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "333777"


def test_model_loads_with_transformers_and_has_vllm_friendly_shape(model_dir: Path) -> None:
    """A tied-embedding Qwen2 with head_dim 64 whose logits cover the 64-token vocabulary."""
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.hidden_size // config.num_attention_heads == 64
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(torch.tensor([[4, 5, 6]])).logits
    assert logits.shape == (1, 3, 64)
    assert "lm_head.weight" not in load_file(str(model_dir / "model.safetensors"))


def test_make_tiny_model_reuses_a_complete_model(model_dir: Path) -> None:
    """A second call with the same settings returns at once and rewrites nothing."""
    weights = model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert make_tiny_model(model_dir) == model_dir
    assert weights.stat().st_mtime_ns == mtime


def test_make_tiny_model_refuses_to_replace_other_settings_unless_told(tmp_path: Path) -> None:
    """Different settings at an existing path raise ValueError; overwrite=True replaces them."""
    path = make_tiny_model(tmp_path / "m", seed=0)
    with pytest.raises(ValueError, match="overwrite=True"):
        make_tiny_model(path, seed=1)
    first = load_file(str(path / "model.safetensors"))
    make_tiny_model(path, seed=1, overwrite=True)
    second = load_file(str(path / "model.safetensors"))
    assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])


def test_make_tiny_model_is_deterministic_in_its_seed(tmp_path: Path) -> None:
    """The same seed writes the same weights."""
    a = load_file(str(make_tiny_model(tmp_path / "a", seed=3) / "model.safetensors"))
    b = load_file(str(make_tiny_model(tmp_path / "b", seed=3) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_make_tiny_model_builds_qwen3(tmp_path: Path) -> None:
    """arch='qwen3' writes a Qwen3 with an explicit head_dim of 64."""
    config = AutoConfig.from_pretrained(make_tiny_model(tmp_path / "q3", arch="qwen3"))
    assert config.model_type == "qwen3" and config.head_dim == 64


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"arch": "llama"}, "arch must be one of"),
        ({"hidden_size": 96}, "multiple of 64"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_make_tiny_model_rejects_bad_settings(tmp_path: Path, kwargs: dict, message: str) -> None:
    """Unsupported settings raise ValueError naming the setting, and write nothing."""
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_sequence_logprobs_do_not_depend_on_padding(model_dir: Path) -> None:
    """Batched, right-padded logprobs equal each sequence scored alone."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 64, (n,), generator=gen) for n in (3, 9, 1)]
    responses = [torch.randint(4, 64, (n,), generator=gen) for n in (7, 2, 0)]
    batched = sequence_logprobs(model, prompts, responses, temperature=0.7)
    for prompt, response, got in zip(prompts, responses, batched):
        alone = sequence_logprobs(model, [prompt], [response], temperature=0.7)[0]
        assert got.dtype == torch.float32 and got.shape == response.shape
        # Batched and alone are matmuls of other shapes: the tolerance scales with the values.
        assert_close_to_scale(got, alone, what="logprobs")


# ---------------------------------------------------------------------------------------------
# real-model layouts


def _stored_keys(path: Path) -> set[str]:
    return set(load_file(str(path / "model.safetensors")))


def test_tied_stored_head_layout_stores_lm_head_equal_to_the_embedding(tmp_path: Path) -> None:
    """As Qwen3-1.7B: tie_word_embeddings is true and model.safetensors still has lm_head.weight."""
    path = make_tiny_model(tmp_path / "m", **LAYOUTS["tied_stored_head"])
    weights = load_file(str(path / "model.safetensors"))
    assert AutoConfig.from_pretrained(path).tie_word_embeddings
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert "lm_head.weight" not in _stored_keys(make_tiny_model(tmp_path / "plain"))


def test_untied_layout_has_its_own_head(tmp_path: Path) -> None:
    """tie_embeddings=False: a stored lm_head.weight that differs from the embedding."""
    path = make_tiny_model(tmp_path / "m", **LAYOUTS["untied"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    assert "lm_head.weight" in _stored_keys(path)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_big_vocab_layout_has_qwen3s_vocabulary_and_the_same_character_ids(tmp_path: Path) -> None:
    """151,936 embedding rows and tokenizer ids; the characters keep their ids; extra ids decode."""
    path = make_tiny_model(tmp_path / "m", **LAYOUTS["big_vocab"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert AutoConfig.from_pretrained(path).vocab_size == QWEN3_VOCAB_SIZE == len(tokenizer)
    assert tokenizer("3+7=").input_ids == build_char_tokenizer()("3+7=").input_ids
    assert tokenizer.decode([QWEN3_VOCAB_SIZE - 1]) == f"<|extra_{QWEN3_VOCAB_SIZE - 65}|>"


def test_qwen3_layout_has_a_chat_template_whose_end_token_is_not_the_eos(tmp_path: Path) -> None:
    """<|im_start|>/<|im_end|> are single tokens at Qwen3's ids, the template is Qwen's, and
    <|im_end|> is not the EOS (a base model's layout: only a stop token id ends a turn there)."""
    path = make_tiny_model(tmp_path / "m", **LAYOUTS["qwen3_1_7b"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == list(QWEN3_CHAT_IDS)
    assert tokenizer("<|im_end|>").input_ids == [QWEN3_CHAT_IDS[1]]
    assert tokenizer.eos_token_id != QWEN3_CHAT_IDS[1]
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen3" and config.tie_word_embeddings
    assert "lm_head.weight" in _stored_keys(path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tie_embeddings": False, "store_tied_head": True}, "store_tied_head"),
        ({"vocab_size": 10}, "vocab_size must be >= 64"),
        ({"chat_template": True}, "arch='qwen3'"),
    ],
)
def test_make_tiny_model_rejects_impossible_layouts(tmp_path: Path, kwargs: dict, message: str) -> None:
    """A layout that cannot exist is a ValueError naming the setting."""
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path / "bad", **kwargs)
