"""The trainer's SFT step: answer-token NLL, the same on one rank as on two (FSDP2 over gloo),
held-out loss without a step, and the learning-rate schedule.

Real Monarch proc meshes and real torch.distributed, one torch thread per rank.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from forge.types import SFTBatch, SFTExample
from tests.unit.test_trainer_sharded import LR, _assert_same_weights, _initial_weights, _noise_moved


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forge.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("sft") / "tiny", hidden_size=64, num_layers=2, init_std=0.1)


def _examples(n: int = 8, seed: int = 0) -> list[SFTExample]:
    gen = torch.Generator().manual_seed(seed)
    return [
        SFTExample(
            torch.randint(4, 64, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen),
            torch.randint(4, 64, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen),
        )
        for _ in range(n)
    ]


def _config(model_dir: Path, **overrides):
    from forge.actors.trainer import TrainerConfig

    return TrainerConfig(**{"model_path": str(model_dir), "lr": LR, "num_threads": 1, **overrides})


def _expected_nll(model_dir: Path, examples: list[SFTExample]) -> float:
    """The definition: -mean over every answer token of log_softmax(logits) at that token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = torch.cat([e.prompt_ids, e.answer_ids])[None]
            logprobs = model(ids).logits[0, :-1].log_softmax(-1)
            targets = ids[0, 1:]
            answer = slice(len(e.prompt_ids) - 1, None)
            total -= float(logprobs[answer].gather(-1, targets[answer, None]).sum())
            count += len(e.answer_ids)
    return total / count


async def _start(procs: int, config, name: str):
    from forge.actors.trainer import Trainer

    return await Trainer.options(procs=procs, name=name).as_actor(config)


async def test_sft_step_trains_the_answer_tokens_alike_on_one_rank_and_two(model_dir: Path):
    """The step's loss is the answer tokens' mean NLL (prompt tokens out); eval_loss gives the same
    number without moving the weights; two ranks in micro-batches of 1 take the same step as one."""
    from forge.controller import ForgeActor
    from forge.distributed import call_spmd

    examples = _examples()
    batch = SFTBatch.pack(examples)
    want = _expected_nll(model_dir, examples)
    one = two = None
    try:
        one, two = await asyncio.gather(
            _start(1, _config(model_dir), "sft1"), _start(2, _config(model_dir, micro_batch_size=1), "sft2")
        )
        held = await asyncio.wait_for(call_spmd(one.eval_loss, batch), 120)
        assert held["loss"] == pytest.approx(want, rel=1e-5) and held["tokens"] == sum(
            len(e.answer_ids) for e in examples
        )
        s1, s2 = await asyncio.wait_for(
            asyncio.gather(call_spmd(one.sft_step, batch), call_spmd(two.sft_step, batch)), 120
        )
        assert s1["loss"] == pytest.approx(want, rel=1e-5)  # eval_loss left the weights alone
        for name in ("loss", "grad_norm", "tokens"):
            assert s2[name] == pytest.approx(s1[name], rel=1e-5), name
        after = await asyncio.wait_for(call_spmd(one.eval_loss, batch), 120)
        assert after["loss"] < held["loss"]  # the step learned the batch
        (w1, _), (w2, _) = await asyncio.gather(call_spmd(one.weights), call_spmd(two.weights))
        # Weights within 1e-3 lr, except those whose gradient is float noise (tests/unit/test_trainer_sharded.py).
        _assert_same_weights(w2, w1, _noise_moved(w1, _initial_weights(model_dir)))
    finally:
        await asyncio.gather(*(ForgeActor.shutdown(m) for m in (one, two) if m is not None), return_exceptions=True)


def test_the_learning_rate_warms_up_then_follows_its_schedule(tmp_path: Path):
    """Linear warmup to lr, then constant, linear or cosine decay to 0 at total_steps."""
    from forge.actors.trainer import TrainerConfig

    base = {"model_path": str(tmp_path), "lr": 1.0, "warmup_steps": 10, "total_steps": 110}
    constant = TrainerConfig(**{**base, "lr_schedule": "constant"})
    assert [constant.lr_at(s) for s in (1, 5, 10, 50, 110)] == [0.1, 0.5, 1.0, 1.0, 1.0]
    linear = TrainerConfig(**{**base, "lr_schedule": "linear"})
    assert linear.lr_at(60) == pytest.approx(0.5) and linear.lr_at(110) == 0.0
    cosine = TrainerConfig(**{**base, "lr_schedule": "cosine"})
    assert cosine.lr_at(60) == pytest.approx(0.5) and cosine.lr_at(110) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="lr_schedule must be one of constant, linear, cosine"):
        TrainerConfig(model_path=str(tmp_path), lr_schedule="step")
    with pytest.raises(ValueError, match="needs total_steps >= 1"):
        TrainerConfig(model_path=str(tmp_path), lr_schedule="cosine")
