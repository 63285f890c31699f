"""The trainer as one SPMD mesh of N ranks (FSDP2 over gloo): the same step as one rank, each rank
holding its share of the state, DCP checkpoints across world sizes, a Hugging Face export.

Real Monarch proc meshes, real torch.distributed (gloo) between them; one torch thread per rank.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from forge.types import Episode, EpisodeBatch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forge.models import make_tiny_model

    # 3 layers: FSDP2 units for each layer plus the root (embedding, norm, tied head).
    return make_tiny_model(tmp_path_factory.mktemp("sharded") / "tiny", hidden_size=64, num_layers=3, init_std=0.1)


def _batch(model_dir: Path, n: int = 8, seed: int = 1) -> EpisodeBatch:
    """``n`` episodes of different lengths, off-policy enough that the ratio and KL are not trivial."""
    from transformers import AutoModelForCausalLM

    from forge.models import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 64, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen) for _ in range(n)]
    responses = [
        torch.randint(4, 64, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen) for _ in range(n)
    ]
    lps = sequence_logprobs(model, prompts, responses, 0.7)
    episodes = [
        Episode(
            f"g{i // 4}",
            p,
            r,
            lp + 0.05 * torch.randn(lp.shape, generator=gen),
            lp.clone(),
            float(i % 2),
            1.0 if i % 3 else -1.0,
            0,
        )
        for i, (p, r, lp) in enumerate(zip(prompts, responses, lps))
    ]
    return EpisodeBatch.pack(episodes)


def _config(model_dir: Path, checkpoint_dir: Path | None = None, **overrides):
    from forge.actors.trainer import TrainerConfig

    base = dict(model_path=str(model_dir), temperature=0.7, lr=1e-2, max_grad_norm=0.5, num_threads=1)
    base.update(overrides)
    return TrainerConfig(**base, checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir))


async def _start(procs: int, config) -> object:
    """A trainer of ``procs`` ranks, each in a process of its own."""
    from forge.actors.trainer import Trainer

    return await Trainer.options(procs=procs, name=f"trainer{procs}").as_actor(config)


_in_process: list[object] = []  # trainers spawned in this process: stopped, not shut down


async def _start_in_process(config) -> object:
    """A one-rank trainer in the test's own process (no process group; no process to start)."""
    from monarch.actor import this_proc

    from forge.actors.trainer import Trainer

    trainer = this_proc().spawn(f"trainer_local{len(_in_process)}", Trainer, config)
    _in_process.append(trainer)
    await trainer.setup.call_one()
    return trainer


async def _stop(*meshes) -> None:
    from forge.controller import ForgeActor

    async def stop(mesh) -> None:
        local = any(mesh is m for m in _in_process)  # its proc mesh is the test's own process
        await (mesh.stop() if local else ForgeActor.shutdown(mesh))

    await asyncio.gather(*(stop(m) for m in meshes if m is not None), return_exceptions=True)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


async def test_two_ranks_take_the_same_step_as_one_and_each_holds_half_the_state(model_dir: Path, tmp_path: Path):
    """procs=2 (micro-batches of 2 on each rank) and procs=1 (one pass) on the same batch: the
    same loss, grad_norm (clipped on the global norm) and updated weights; each of the two ranks
    holds about half of the parameters and optimizer state; a 2-rank checkpoint loads into one
    rank; the exported Hugging Face folder loads with transformers."""
    from transformers import AutoModelForCausalLM

    from forge.distributed import call_spmd

    batch = _batch(model_dir)
    one, two = None, None
    try:
        one, two = await asyncio.gather(
            _start_in_process(_config(model_dir)),
            _start(2, _config(model_dir, tmp_path / "ckpt", micro_batch_size=2)),
        )
        s1, s2 = await asyncio.gather(call_spmd(one.train_step, batch), call_spmd(two.train_step, batch))
        # After a step, so that the optimizer's state (AdamW's two moments) exists.
        full = await one.state_bytes.call_one()
        shards = list((await two.state_bytes.call()).values())
        assert len(shards) == 2 and sum(shards) == pytest.approx(full, rel=0.02)
        assert all(0.4 * full <= s <= 0.6 * full for s in shards), (shards, full)
        assert s1["grad_norm"] > 0.5  # clipping was active
        for name in ("loss", "grad_norm", "kl", "ratio_mean", "pg_loss", "tokens"):
            assert s2[name] == pytest.approx(s1[name], rel=1e-5, abs=1e-7), name
        (w1, v1), (w2, v2) = await asyncio.gather(call_spmd(one.weights), call_spmd(two.weights))
        assert v1 == v2 == 1
        assert _max_diff(w1, w2) <= 1e-5
        before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        assert max(float((before[k] - w1[k]).abs().max()) for k in w1) > 1e-3  # the step moved the weights

        path = await call_spmd(two.save_checkpoint, 1, {"dataset_position": 5})
        assert sorted(p.name for p in Path(path).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        fresh = await _start_in_process(_config(model_dir))
        try:
            assert await call_spmd(fresh.load_checkpoint, path) == (1, 1, {"dataset_position": 5})
            loaded, version = await call_spmd(fresh.weights)
            assert version == 1 and all(torch.equal(loaded[k], w2[k]) for k in w2)
        finally:
            await _stop(fresh)

        folder = await call_spmd(two.export_model, str(tmp_path / "export"))
        exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
        assert all(torch.equal(exported[k], w2[k]) for k in w2)
    finally:
        await _stop(one, two)


async def test_a_two_rank_trainer_resumed_from_its_checkpoint_continues_exactly(model_dir: Path, tmp_path: Path):
    """Step 1, checkpoint, step 2 on two ranks == load the checkpoint into two fresh ranks, step 2,
    bit for bit; the same checkpoint written by one rank and loaded into two gives that rank's
    weights and optimizer state (its next step matches within 1e-5)."""
    from forge.distributed import call_spmd

    first, second = _batch(model_dir, seed=1), _batch(model_dir, seed=2)
    original = resumed = single = None
    try:
        original, resumed, single = await asyncio.gather(
            _start(2, _config(model_dir, tmp_path / "two")),
            _start(2, _config(model_dir, tmp_path / "resumed")),
            _start_in_process(_config(model_dir, tmp_path / "one")),
        )
        await asyncio.gather(call_spmd(original.train_step, first), call_spmd(single.train_step, first))
        path, single_path = await asyncio.gather(
            call_spmd(original.save_checkpoint, 1, {"dataset_position": 8}), call_spmd(single.save_checkpoint, 1)
        )
        await call_spmd(original.train_step, second)
        want, want_version = await call_spmd(original.weights)

        assert await call_spmd(resumed.load_checkpoint, path) == (1, 1, {"dataset_position": 8})
        await call_spmd(resumed.train_step, second)
        got, got_version = await call_spmd(resumed.weights)
        assert got_version == want_version == 2
        assert all(torch.equal(got[k], want[k]) for k in want)

        # 1 -> 2: the one-rank checkpoint resharded over two ranks, then the same next step.
        assert (await call_spmd(resumed.load_checkpoint, single_path))[:2] == (1, 1)
        await asyncio.gather(call_spmd(resumed.train_step, second), call_spmd(single.train_step, second))
        (a, _), (b, _) = await asyncio.gather(call_spmd(resumed.weights), call_spmd(single.weights))
        assert _max_diff(a, b) <= 1e-5
    finally:
        await _stop(original, resumed, single)


async def test_a_two_rank_reference_replica_scores_like_one_rank_and_holds_half_the_model(model_dir: Path):
    """A reference service whose replica is 2 FSDP2 ranks gives the per-token logprobs of a
    one-rank reference (5 pairs: the ranks' shares are unequal) and its rank 0 holds about half
    of the weights."""
    from monarch.actor import this_proc

    from forge.actors.reference_model import ReferenceConfig, ReferenceModel

    config = ReferenceConfig(model_path=str(model_dir), temperature=0.7)
    batch = _batch(model_dir, n=5).unpack()
    pairs = [(e.prompt_ids, e.response_ids) for e in batch]
    one = this_proc().spawn("reference_one", ReferenceModel, config)
    svc = await ReferenceModel.options(procs=2, name="ref2", env={"OMP_NUM_THREADS": "1"}).as_service(config)
    try:
        await one.setup.call_one()
        flat, lengths = await one.logprobs.call_one(pairs)
        want = list(torch.split(flat, lengths))
        got = await svc.logprobs.route_many(pairs)
        assert [len(t) for t in got] == lengths
        assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 1e-5
        full = await one.state_bytes.call_one()
        (rank0,) = await svc.state_bytes.fanout()
        assert 0.4 * full <= rank0 <= 0.6 * full, (rank0, full)
    finally:
        await svc.shutdown()
        await one.stop()


async def test_a_rank_whose_process_group_cannot_start_names_its_rank_and_host():
    """A backend the ranks cannot use (NCCL on a CPU-only machine) fails the start with an error
    naming the backend, the rank and the host, not a hang."""
    import socket

    from forge.actors.trainer import Trainer, TrainerConfig

    with pytest.raises(Exception, match=rf"\(nccl\) init failed on rank \d of 2 on host {socket.gethostname()}"):
        await Trainer.options(procs=2, name="badinit").as_actor(
            TrainerConfig(model_path="unused", dist_backend="nccl", dist_timeout_s=30)
        )


def test_trainer_procs_that_do_not_divide_the_batch_are_a_config_error():
    """trainer.procs must divide prompts_per_step x group_size; the error names the three keys."""
    from apps.grpo.config import GRPOConfig
    from forge.config import load_config

    with pytest.raises(
        ValueError, match=r"trainer\.procs \(3\) must divide prompts_per_step x group_size \(4 x 2 = 8\)"
    ):
        load_config(GRPOConfig, None, ["model.path=x", "trainer.procs=3", "prompts_per_step=4", "group_size=2"])
    cfg = load_config(GRPOConfig, None, ["model.path=x", "trainer.procs=4", "prompts_per_step=4", "group_size=2"])
    assert cfg.trainer.procs == 4
