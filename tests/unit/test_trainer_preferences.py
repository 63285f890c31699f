"""The trainer's preference step: a scalar-head reward model's Bradley-Terry loss and DPO's loss,
each checked against its definition computed apart from the trainer, the same on one rank as on
two (FSDP2 over gloo), and learning the pairs it is trained on.

Real Monarch proc meshes and real torch.distributed, one torch thread per rank.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from forge.types import PreferenceBatch, PreferenceExample
from tests.numerics import assert_close_to_scale

LR = 1e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forge.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("prefs") / "tiny", hidden_size=64, num_layers=2, init_std=0.1)


def _examples(n: int = 8, seed: int = 0) -> list[PreferenceExample]:
    """Pairs of random tokens (ids >= 4: never the pad id 0, so any pooling finds the last token)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> torch.Tensor:
        return torch.randint(4, 64, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen)

    return [PreferenceExample(ids(2, 7), ids(1, 5), ids(1, 5)) for _ in range(n)]


def _config(model_dir: Path, **overrides):
    from forge.actors.trainer import TrainerConfig

    return TrainerConfig(**{"model_path": str(model_dir), "lr": LR, "num_threads": 1, **overrides})


async def _start(procs: int, config, name: str):
    from forge.actors.trainer import Trainer

    return await Trainer.options(procs=procs, name=name).as_actor(config)


def _rm_scores(folder: Path, examples: list[PreferenceExample]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exported reward model's scores of each pair's responses, one sequence at a time (no
    padding at all), through ``transformers``' own pooled head."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        chosen = [float(model(torch.cat([e.prompt_ids, e.chosen_ids])[None]).logits[0, 0]) for e in examples]
        rejected = [float(model(torch.cat([e.prompt_ids, e.rejected_ids])[None]).logits[0, 0]) for e in examples]
    return torch.tensor(chosen), torch.tensor(rejected)


def _sequence_logprobs(folder: Path, prompt: torch.Tensor, response: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.cat([prompt, response])[None]
    with torch.no_grad():
        logprobs = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    return float(logprobs[len(prompt) - 1 :].sum())


async def test_a_reward_model_learns_its_pairs_alike_on_one_rank_and_two(model_dir: Path, tmp_path: Path):
    """``head: scalar``: the step's loss is -log sigmoid(chosen - rejected) of the exported model's
    own scores (its classification head, read at each sequence's last token, however the batch
    is padded); two ranks in micro-batches of 1 take the same steps; the pairs are learned."""
    from forge.controller import ForgeActor
    from forge.distributed import call_spmd

    examples = _examples()
    batch = PreferenceBatch.pack(examples)
    one = two = None
    try:
        one, two = await asyncio.gather(
            _start(1, _config(model_dir, head="scalar"), "rm1"),
            _start(2, _config(model_dir, head="scalar", micro_batch_size=1), "rm2"),
        )
        before = await asyncio.wait_for(call_spmd(one.preference_eval, batch), 120)
        for _ in range(15):
            s1, s2 = await asyncio.wait_for(
                asyncio.gather(call_spmd(one.preference_step, batch), call_spmd(two.preference_step, batch)), 120
            )
            for name in ("loss", "accuracy", "margin", "grad_norm"):
                assert_close_to_scale(s2[name], s1[name], 1e-4, scale=max(1.0, abs(s1[name])), what=name)
        after = await asyncio.wait_for(call_spmd(one.preference_eval, batch), 120)
        assert after["loss"] < before["loss"] - 0.2, (before, after)
        assert after["accuracy"] == 1.0 and before["accuracy"] <= 0.75, (before, after)
        folder = tmp_path / "rm"
        await asyncio.wait_for(call_spmd(one.export_model, str(folder)), 120)
        chosen, rejected = _rm_scores(folder, examples)
        want = float(-F.logsigmoid(chosen - rejected).mean())
        assert_close_to_scale(after["loss"], want, 1e-4, scale=max(1.0, want), what="Bradley-Terry loss")
        assert after["accuracy"] == float((chosen > rejected).float().mean())
    finally:
        await asyncio.gather(*(ForgeActor.shutdown(m) for m in (one, two) if m is not None), return_exceptions=True)


async def test_dpo_moves_the_policy_toward_the_chosen_responses(model_dir: Path, tmp_path: Path):
    """With the initial model as the reference, DPO's first loss is log 2 (every margin 0); after
    steps the loss is the sigmoid loss of the exported model's sequence logprobs against the
    reference's, computed apart from the trainer, and every training pair is preferred."""
    from forge.controller import ForgeActor
    from forge.distributed import call_spmd

    examples = _examples(seed=1)
    refs = [
        (
            _sequence_logprobs(model_dir, e.prompt_ids, e.chosen_ids),
            _sequence_logprobs(model_dir, e.prompt_ids, e.rejected_ids),
        )
        for e in examples
    ]
    batch = PreferenceBatch.pack(examples, refs)
    trainer = None
    try:
        trainer = await _start(1, _config(model_dir, dpo_beta=0.5, micro_batch_size=3), "dpo1")
        first = await asyncio.wait_for(call_spmd(trainer.preference_step, batch), 120)
        assert_close_to_scale(first["loss"], float(torch.log(torch.tensor(2.0))), 1e-4, scale=1.0, what="first loss")
        for _ in range(10):
            await asyncio.wait_for(call_spmd(trainer.preference_step, batch), 120)
        after = await asyncio.wait_for(call_spmd(trainer.preference_eval, batch), 120)
        folder = tmp_path / "dpo"
        await asyncio.wait_for(call_spmd(trainer.export_model, str(folder)), 120)
        chosen = torch.tensor([_sequence_logprobs(folder, e.prompt_ids, e.chosen_ids) for e in examples])
        rejected = torch.tensor([_sequence_logprobs(folder, e.prompt_ids, e.rejected_ids) for e in examples])
        ref_c, ref_r = torch.tensor(refs).T
        margin = 0.5 * ((chosen - ref_c) - (rejected - ref_r))
        want = float(-F.logsigmoid(margin).mean())
        assert_close_to_scale(after["loss"], want, 1e-4, scale=1.0, what="DPO loss")
        assert after["loss"] < first["loss"] - 0.2 and after["accuracy"] == 1.0, (first, after)
        with pytest.raises(Exception, match="needs each pair's reference logprobs"):
            await asyncio.wait_for(call_spmd(trainer.preference_step, PreferenceBatch.pack(examples)), 120)
    finally:
        if trainer is not None:
            await ForgeActor.shutdown(trainer)


def test_preference_settings_are_checked(tmp_path: Path):
    from forge.actors.trainer import TrainerConfig

    with pytest.raises(ValueError, match="head must be one of lm, scalar"):
        TrainerConfig(model_path=str(tmp_path), head="value")
    with pytest.raises(ValueError, match="dpo_loss must be one of sigmoid, ipo"):
        TrainerConfig(model_path=str(tmp_path), dpo_loss="hinge")
    with pytest.raises(ValueError, match="dpo_beta must be > 0"):
        TrainerConfig(model_path=str(tmp_path), dpo_beta=0.0)
    with pytest.raises(ValueError, match="set lora null and pack_sequences false"):
        TrainerConfig(model_path=str(tmp_path), head="scalar", pack_sequences=True)
