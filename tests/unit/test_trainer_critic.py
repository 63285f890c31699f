"""A critic on the trainer actor (``head: scalar``): its per-token values are the exported
classifier's own head output at each position, the same on one rank as on two (FSDP2 over gloo),
and ``value_step`` fits them to the returns it is given.

Real Monarch proc meshes and real torch.distributed, one torch thread per rank.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from forge.losses.ppo import explained_variance
from forge.types import Episode, EpisodeBatch
from tests.numerics import assert_close_to_scale


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forge.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("critic") / "tiny", hidden_size=64, num_layers=2, init_std=0.1)


def _batch(n: int = 4) -> EpisodeBatch:
    gen = torch.Generator().manual_seed(0)
    episodes = []
    for i in range(n):
        prompt = torch.randint(4, 64, (3 + i % 2,), generator=gen)
        response = torch.randint(4, 64, (2 + i,), generator=gen)
        zeros = torch.zeros(len(response))
        episodes.append(Episode(f"g{i}", prompt, response, zeros, zeros, float(i % 2), 0.0, 0))
    return EpisodeBatch.pack(episodes)


def _exported_values(folder: Path, batch: EpisodeBatch) -> torch.Tensor:
    """Each response token's value from the exported classifier, one sequence at a time."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    out: list[torch.Tensor] = []
    seen: list[torch.Tensor] = []
    hook = model.score.register_forward_hook(lambda _m, _i, o: seen.append(o))
    for prompt, response in zip(batch.pieces("prompt_ids"), batch.pieces("response_ids")):
        seen.clear()
        with torch.no_grad():
            model(torch.cat([prompt, response])[None])
        per_position = seen[0][0, :, 0]
        out.append(per_position[len(prompt) - 1 : len(prompt) + len(response) - 1])
    hook.remove()
    return torch.cat(out)


async def test_a_critic_values_every_token_and_fits_the_returns_alike_on_one_rank_and_two(
    model_dir: Path, tmp_path: Path
):
    from dataclasses import replace

    from forge.actors.trainer import Trainer, TrainerConfig
    from forge.controller import ForgeActor
    from forge.distributed import call_spmd

    def config(**overrides) -> TrainerConfig:
        return TrainerConfig(model_path=str(model_dir), lr=1e-2, num_threads=1, head="scalar", **overrides)

    batch = _batch()
    one = two = None
    try:
        one, two = await asyncio.gather(
            Trainer.options(procs=1, name="critic1").as_actor(config()),
            Trainer.options(procs=2, name="critic2").as_actor(config(micro_batch_size=1)),
        )
        values = await asyncio.wait_for(call_spmd(one.token_values, batch), 120)
        assert values.shape == batch.response_ids.shape
        assert_close_to_scale(await asyncio.wait_for(call_spmd(two.token_values, batch), 120), values, 1e-4)
        # Returns the critic must learn: a different constant per episode.
        returns = torch.cat([torch.full((int(n),), 2.0 * (i % 2) - 1.0) for i, n in enumerate(batch.response_lens)])
        mask = torch.ones(1, returns.numel(), dtype=torch.bool)
        before = explained_variance(values[None], returns[None], mask)
        for _ in range(20):
            current = await asyncio.wait_for(call_spmd(one.token_values, batch), 120)
            step = replace(batch, returns=returns, values=current)
            s1, s2 = await asyncio.wait_for(
                asyncio.gather(call_spmd(one.value_step, step), call_spmd(two.value_step, step)), 120
            )
            for name in ("loss", "value_mean", "grad_norm"):
                assert_close_to_scale(s2[name], s1[name], 1e-3, scale=max(1.0, abs(s1[name])), what=name)
        after_values = await asyncio.wait_for(call_spmd(one.token_values, batch), 120)
        after = explained_variance(after_values[None], returns[None], mask)
        assert after > 0.8 and after > before + 0.5, (before, after)
        folder = tmp_path / "critic"
        await asyncio.wait_for(call_spmd(one.export_model, str(folder)), 120)
        assert_close_to_scale(after_values, _exported_values(folder, batch), 1e-4, scale=1.0, what="values")
    finally:
        await asyncio.gather(*(ForgeActor.shutdown(m) for m in (one, two) if m is not None), return_exceptions=True)


async def test_critic_endpoints_refuse_a_language_model_head(model_dir: Path):
    from forge.actors.trainer import Trainer, TrainerConfig
    from forge.controller import ForgeActor
    from forge.distributed import call_spmd

    trainer = None
    try:
        trainer = await Trainer.options(procs=1, name="notcritic").as_actor(
            TrainerConfig(model_path=str(model_dir), num_threads=1)
        )
        with pytest.raises(Exception, match="needs head 'scalar'"):
            await asyncio.wait_for(call_spmd(trainer.token_values, _batch()), 120)
    finally:
        if trainer is not None:
            await ForgeActor.shutdown(trainer)


async def test_per_token_advantages_replace_the_episodes_in_the_policy_step(model_dir: Path):
    """``token_advantages`` set: the step trains on them, not on ``advantages``; all zero, no gradient."""
    from dataclasses import replace

    from forge.actors.trainer import Trainer, TrainerConfig
    from forge.controller import ForgeActor
    from forge.distributed import call_spmd

    batch = _batch()
    batch = replace(batch, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))
    trainer = None
    try:
        trainer = await Trainer.options(procs=1, name="ppopolicy").as_actor(
            TrainerConfig(model_path=str(model_dir), num_threads=1, lr=0.0, beta=0.0)
        )
        plain = await asyncio.wait_for(call_spmd(trainer.train_step, batch), 120)
        zero = replace(batch, token_advantages=torch.zeros(batch.response_ids.shape))
        zeroed = await asyncio.wait_for(call_spmd(trainer.train_step, zero), 120)
        assert plain["grad_norm"] > 1e-3 and zeroed["grad_norm"] == 0.0, (plain, zeroed)
        per_token = torch.repeat_interleave(batch.advantages, batch.response_lens)
        same = await asyncio.wait_for(call_spmd(trainer.train_step, replace(batch, token_advantages=per_token)), 120)
        assert_close_to_scale(same["grad_norm"], plain["grad_norm"], 1e-4, what="grad_norm")
        assert_close_to_scale(same["loss"], plain["loss"], 1e-4, scale=1.0, what="loss")
    finally:
        if trainer is not None:
            await ForgeActor.shutdown(trainer)
