"""Chunked logprobs: the same values and gradients as full logits, in memory bounded by tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from forge.models import make_tiny_model, pack_right_padded, padded_token_logprobs
from forge.models.tiny import LAYOUTS, QWEN3_VOCAB_SIZE
from tests.numerics import assert_close_to_scale, max_abs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def big_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's 151,936-token vocabulary on a 64-wide, 1-layer body."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "q3-vocab", num_layers=1, **LAYOUTS["qwen3_1_7b"])


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (n,), generator=gen) for n in (3, 9, 1)]
    responses = [torch.randint(4, vocab, (n,), generator=gen) for n in (7, 2, 5)]
    return pack_right_padded(prompts, responses)


def _full_logits_logprobs(model: torch.nn.Module, batch, temperature: float) -> torch.Tensor:
    """The reference definition: log_softmax over the full [B, L, V] float32 logits."""
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids).logits
    logprobs = (logits[:, :-1].float() / temperature).log_softmax(-1)
    return logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 512])
def test_chunked_logprobs_and_gradients_equal_the_full_logits_ones(big_vocab_dir: Path, chunk_tokens: int) -> None:
    """Any chunk size gives the full-logits logprobs at the response positions, and their gradients."""
    model = AutoModelForCausalLM.from_pretrained(big_vocab_dir, dtype=torch.float32)
    batch = _batch(QWEN3_VOCAB_SIZE)
    mask = batch.response_mask
    expected = _full_logits_logprobs(model, batch, 0.7)
    expected[mask].sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    got = padded_token_logprobs(
        model, batch.input_ids, batch.attention_mask, 0.7, positions=mask, chunk_tokens=chunk_tokens
    )
    got[mask].sum().backward()
    # Tolerances scale with the values compared (tests/numerics.py): a chunk of logits is a
    # matmul of another shape than the full logits', so its sums run in another order; in
    # backward the hidden states' gradient sums over the 151,936-token vocabulary, whose noise
    # reaches every upstream gradient (up to ~1e-5 of the largest gradient with 1-row chunks).
    assert_close_to_scale(got[mask], expected[mask], what="logprobs")
    assert (got[~mask] == 0).all()
    grads = {name: p.grad for name, p in model.named_parameters()}
    want = dict(zip(grads, expected_grads))
    assert_close_to_scale(grads, want, rel=1e-4, scale=max_abs(want), what="gradients")


def test_padded_token_logprobs_reject_a_bad_chunk_size(big_vocab_dir: Path) -> None:
    """chunk_tokens=0 is a ValueError naming it."""
    model = AutoModelForCausalLM.from_pretrained(big_vocab_dir, dtype=torch.float32)
    batch = _batch(64)
    with pytest.raises(ValueError, match="chunk_tokens"):
        padded_token_logprobs(model, batch.input_ids, batch.attention_mask, chunk_tokens=0)


def test_pack_right_padded_limits_the_loss_mask_to_loss_lens() -> None:
    """loss_lens [1, 0] keeps one response token of the first pair and none of the second."""
    batch = pack_right_padded(
        [torch.tensor([1, 2]), torch.tensor([3])], [torch.tensor([4, 5]), torch.tensor([6])], 0, [1, 0]
    )
    assert batch.response_mask.sum() == 3
    assert batch.loss_mask.tolist() == [[False, True, False], [False, False, False]]
    with pytest.raises(ValueError, match="loss_lens"):
        pack_right_padded([torch.tensor([1])], [torch.tensor([4])], 0, [2])


# The memory check runs in a fresh process and reads the kernel's peak-RSS counter (VmHWM), reset
# before each measured pass (/proc/self/clear_refs "5"). The smallest of three passes is kept:
# a pass can only be measured too high (by a page the allocator kept), never too low.
_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, re, sys
    import torch
    from transformers import AutoModelForCausalLM
    from forge.models import pack_right_padded, padded_token_logprobs

    torch.set_num_threads(1)
    path, tokens, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)

    def status(field):
        text = open("/proc/self/status").read()
        return int(re.search(field + r":\\s+(\\d+) kB", text).group(1)) * 1024

    def step(n_tokens):
        prompts = [torch.tensor([5, 6])] * 4
        responses = [torch.randint(4, 151936, (n_tokens // 4,), generator=gen) for _ in range(4)]
        batch = pack_right_padded(prompts, responses)
        lp = padded_token_logprobs(model, batch.input_ids, batch.attention_mask,
                                   positions=batch.response_mask, chunk_tokens=chunk)
        lp[batch.response_mask].sum().backward()

    step(16)  # warm-up: gradient buffers and allocator pools exist before the measurement
    increases = []
    for _ in range(3):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = status("VmRSS")
        step(tokens)
        increases.append(status("VmHWM") - before)
    print(json.dumps({"peak_increase": min(increases)}))
    """
)


def _peak_increase(model_dir: Path, tokens: int, chunk_tokens: int) -> int:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(model_dir), str(tokens), str(chunk_tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_increase"]


def test_peak_memory_of_a_training_pass_is_bounded_by_the_chunk_not_the_batch(big_vocab_dir: Path) -> None:
    """1,024 response tokens at a 151,936-token vocabulary, forward and backward, chunks of 64 rows.

    Full float32 logits alone would be 1,024 x 151,936 x 4 B = 622 MB (and backward keeps a
    gradient of the same size). Chunked, at most a handful of [64, V] float32 tensors live at
    once: the chunk's logits, logsumexp's exp() of them, and in backward the recomputed logits,
    their softmax and their gradient: 5 x 64 x 151,936 x 4 B = 194 MB. Add 128 MiB for the rest
    (the 39 MB embedding's gradient and Adam-free parameter copies, activations of 1,024 tokens
    x 64 wide, allocator slack): the bound is 5 chunks + 128 MiB = 329 MB, about half the full
    logits, which the unchunked computation needs at least twice.
    """
    tokens, chunk = 1024, 64
    row_bytes = QWEN3_VOCAB_SIZE * 4
    full_logits = tokens * row_bytes
    bound = 5 * chunk * row_bytes + (128 << 20)
    assert bound < full_logits  # the bound would catch a computation that materialises the logits
    peak = _peak_increase(big_vocab_dir, tokens, chunk)
    assert peak < bound, f"peak memory grew by {peak / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"


# ----------------------------------------------------------------------------- packing
@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "small", hidden_size=64, num_layers=2, init_std=0.3)


def _ragged_batch():
    """One long pair and six short ones: the short ones share rows once packed."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 60, (n,), generator=gen) for n in (2, 3, 1, 4, 2, 9, 2)]
    responses = [torch.randint(4, 60, (n,), generator=gen) for n in (3, 2, 4, 1, 5, 11, 2)]
    return pack_right_padded(prompts, responses)


def test_pack_rows_puts_short_sequences_in_shared_rows_each_with_its_own_positions() -> None:
    from forge.models import forward_padding_fraction, pack_rows

    batch = _ragged_batch()
    packing = pack_rows(batch.input_ids, batch.attention_mask)
    lengths = batch.attention_mask.sum(-1).tolist()
    assert packing.input_ids.shape == (2, 40) and batch.input_ids.shape == (7, 20)  # rows of twice the longest
    for b, n in enumerate(lengths):
        r, o = int(packing.row[b]), int(packing.offset[b])
        assert torch.equal(packing.input_ids[r, o : o + n], batch.input_ids[b, :n])
        assert packing.position_ids[r, o : o + n].tolist() == list(range(n))
    # No two sequences overlap: the rows hold exactly the real tokens, plus their tail padding.
    assert int(packing.length.sum()) == sum(lengths)
    assert packing.padding_fraction == pytest.approx(1 - sum(lengths) / 80)
    assert packing.padding_fraction == pytest.approx(forward_padding_fraction(lengths, pack=True))
    assert forward_padding_fraction(lengths) == pytest.approx(1 - sum(lengths) / 140)


def test_pack_rows_refuses_a_left_padded_batch() -> None:
    from forge.models import pack_rows

    batch = _ragged_batch()
    with pytest.raises(ValueError, match="right-padded"):
        pack_rows(batch.input_ids.flip(-1), batch.attention_mask.flip(-1))


def test_packed_logprobs_and_gradients_equal_the_padded_ones(small_model_dir: Path) -> None:
    """Attention stays inside each packed sequence: the same logprobs and the same gradients as
    the padded batch (a leak between row-mates would change both by O(1) relative).

    The padded and the packed passes sum over different numbers of rows (padding included), so
    their float32 sums run in different orders: the tolerance is relative to the largest value
    compared (the model's largest gradient for the gradients), not to each element: the tied
    embedding's gradient, up to ~108, differs by up to ~7e-5 between the two, 6e-7 relative."""
    model = AutoModelForCausalLM.from_pretrained(small_model_dir, dtype=torch.float32)
    batch = _ragged_batch()
    results = []
    for pack in (False, True):
        model.zero_grad()
        lp = padded_token_logprobs(
            model, batch.input_ids, batch.attention_mask, 0.7, positions=batch.response_mask, pack=pack
        )
        (lp * batch.response_mask).sum().backward()
        results.append((lp.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (padded, padded_grads), (packed, packed_grads) = results
    assert padded.abs().sum() > 0
    assert_close_to_scale(packed, padded, what="logprobs")
    assert_close_to_scale(packed_grads, padded_grads, scale=max_abs(padded_grads), what="gradients")
