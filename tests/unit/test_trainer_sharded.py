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
from tests.numerics import assert_close_to_scale


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


LR = 1e-2


def _config(model_dir: Path, checkpoint_dir: Path | None = None, **overrides):
    from forge.actors.trainer import TrainerConfig

    base = dict(model_path=str(model_dir), temperature=0.7, lr=LR, max_grad_norm=0.5, num_threads=1)
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


# Two trainers that split the same step differently (ranks, micro-batches, packing) sum the same
# terms in other orders, so their results differ by float32 noise that follows the size of the
# terms (tests/numerics.py), not of the result. The statistics' scales: 1 for the means of
# per-token terms of size ~1 that cancel: the policy terms |advantage| x ratio (advantages +-1,
# ratios within a few % of 1, so loss and pg_loss), the ratios, and the k3 KL's exp(r) - r - 1
# (exp(r) ~ 1: its noise is ~1e-7 whatever the KL; kl, kl_loss). grad_norm, a norm: its own
# size (None). Weights are compared to the learning rate, the most one step moves them.
STAT_SCALES = {"loss": 1.0, "pg_loss": 1.0, "ratio_mean": 1.0, "kl": 1.0, "kl_loss": 1.0, "grad_norm": None}


def _assert_same_stats(got: dict, want: dict, names, rel: float = 1e-5) -> None:
    """The step statistics ``names`` agree (``tokens``, a count, exactly)."""
    for name in names:
        if name == "tokens":
            assert got[name] == want[name], name
        else:
            assert_close_to_scale(got[name], want[name], rel, scale=STAT_SCALES[name], what=name)


def _initial_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


# AdamW's first step (no weight decay) moves each weight by exactly lr * g / (|g| + eps), eps 1e-8,
# and later steps by lr * m / (sqrt(v) + eps), m and v averaging g and g^2. Where |g| is within
# ~100 eps (~0.2% of the weights here: gradients that are 0 in exact arithmetic, as some of a
# k_proj bias's, or sums that happen to cancel), the share of lr moved follows g's float noise,
# which differs however the step is split: measured up to 0.023 lr between micro-batch splits and
# 0.011 lr between one rank and two on emulated other CPUs (and 1.3e-3 lr at a second step).
# Those weights, recognised by a first step that moved them less than 0.99 lr, are left out; the
# others agree within 1e-3 lr (measured: up to 2e-5 lr). A wrong split flips the sign of many
# gradients, so of many weights' moves: ~2 lr. The gradient itself is checked tightly through
# grad_norm and the loss.
_DECIDED_MOVE = 0.99


def _noise_moved(first: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per weight tensor, where the first step from ``initial`` to ``first`` moved less than 0.99 lr."""
    noisy = {k: (first[k] - initial[k]).abs() < _DECIDED_MOVE * LR for k in first}
    left_out, total = sum(int(m.sum()) for m in noisy.values()), sum(m.numel() for m in noisy.values())
    assert left_out <= 0.01 * total, f"{left_out} of {total} weights moved less than {_DECIDED_MOVE} lr"
    return noisy


def _assert_same_weights(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], noisy: dict[str, torch.Tensor], rel: float = 1e-3
) -> None:
    """Weights after the same steps agree within ``rel`` x lr, except the ``noisy`` ones (``_noise_moved``)."""
    assert got.keys() == want.keys() == noisy.keys()
    keep = {k: ~m for k, m in noisy.items()}
    assert_close_to_scale(
        {k: got[k][m] for k, m in keep.items()}, {k: want[k][m] for k, m in keep.items()}, rel, scale=LR, what="weights"
    )


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
        _assert_same_stats(s2, s1, ("loss", "grad_norm", "kl", "ratio_mean", "pg_loss", "tokens"))
        (w1, v1), (w2, v2) = await asyncio.gather(call_spmd(one.weights), call_spmd(two.weights))
        assert v1 == v2 == 1
        before = _initial_weights(model_dir)
        _assert_same_weights(w2, w1, _noise_moved(w1, before))
        assert max(float((before[k] - w1[k]).abs().max()) for k in w1) > 1e-3  # the step moved the weights

        path = await call_spmd(two.save_checkpoint, 1, {"dataset_position": 5})
        assert await call_spmd(two.wait_checkpoint) == path  # written in the background (async_checkpoint)
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
        noisy = _noise_moved((await call_spmd(single.weights))[0], _initial_weights(model_dir))
        path, single_path = await asyncio.gather(
            call_spmd(original.save_checkpoint, 1, {"dataset_position": 8}), call_spmd(single.save_checkpoint, 1)
        )
        # The two-rank checkpoint is written in the background while the next step changes the
        # weights: what it holds is the state at the save.
        await call_spmd(original.train_step, second)
        assert await call_spmd(original.wait_checkpoint) == path
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
        _assert_same_weights(a, b, noisy)
    finally:
        await _stop(original, resumed, single)


async def test_a_two_rank_reference_replica_scores_like_one_rank_and_holds_half_the_model(model_dir: Path):
    """A reference service whose replica is 2 FSDP2 ranks, packing its sequences into rows,
    gives the per-token logprobs of a one-rank reference that pads them (5 pairs: the ranks'
    shares are unequal) and its rank 0 holds about half of the weights."""
    import dataclasses

    from monarch.actor import this_proc

    from forge.actors.reference_model import ReferenceConfig, ReferenceModel

    config = ReferenceConfig(model_path=str(model_dir), temperature=0.7)
    batch = _batch(model_dir, n=5).unpack()
    pairs = [(e.prompt_ids, e.response_ids) for e in batch]
    one = this_proc().spawn("reference_one", ReferenceModel, config)
    packed = dataclasses.replace(config, pack_sequences=True)
    svc = await ReferenceModel.options(procs=2, name="ref2", env={"OMP_NUM_THREADS": "1"}).as_service(packed)
    try:
        await one.setup.call_one()
        flat, lengths = await one.logprobs.call_one(pairs)
        want = list(torch.split(flat, lengths))
        got = await svc.logprobs.route_many(pairs)
        assert [len(t) for t in got] == lengths
        assert_close_to_scale(torch.cat(got), torch.cat(want), what="reference logprobs")
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


# ---------------------------------------------------------------------------------------------
# loss_type: the step is the whole batch's loss, however the batch is split

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
_MAX_RESPONSE_TOKENS = 6  # _batch's responses have 1..5 tokens


def _ragged_episodes(model_dir: Path) -> list[Episode]:
    """_batch's 8 episodes of 1..5 response tokens, with a reference that differs from the
    policy (a non-zero KL term) and one episode cut at the length limit, which
    ``mask_truncated`` leaves untrained: a row that dr_grpo counts and grpo does not."""
    import dataclasses

    gen = torch.Generator().manual_seed(7)
    episodes = _batch(model_dir).unpack()
    episodes = [
        dataclasses.replace(e, ref_logprobs=e.ref_logprobs + 0.3 * torch.randn(e.ref_logprobs.shape, generator=gen))
        for e in episodes
    ]
    episodes[5] = dataclasses.replace(episodes[5], finish_reason="length")
    return episodes


def _whole_batch_loss(model_dir: Path, episodes: list[Episode], loss_type: str) -> float:
    """``grpo_loss`` of the whole batch in one call at the initial weights: what every split of
    the step must report (the trainer's defaults: clip_eps 0.2, beta 0.04)."""
    from transformers import AutoModelForCausalLM

    from forge.losses import grpo_loss
    from forge.models import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lps = sequence_logprobs(model, [e.prompt_ids for e in episodes], [e.response_ids for e in episodes], 0.7)
    width = max(len(lp) for lp in lps)

    def padded(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])

    trained = [torch.full((len(e.response_ids),), e.finish_reason != "length") for e in episodes]
    loss, _ = grpo_loss(
        padded(lps),
        padded([e.behaviour_logprobs for e in episodes]),
        padded([e.ref_logprobs for e in episodes]),
        torch.tensor([e.advantage for e in episodes]),
        padded(trained),
        loss_type=loss_type,
        max_response_tokens=_MAX_RESPONSE_TOKENS,
    )
    return float(loss)


def _loss_type_config(model_dir: Path, loss_type: str, **overrides):
    return _config(
        model_dir, loss_type=loss_type, max_response_tokens=_MAX_RESPONSE_TOKENS, mask_truncated=True, **overrides
    )


_STEP_STATS = ("loss", "pg_loss", "kl_loss", "kl", "grad_norm", "tokens")


def _assert_same_step(got: tuple[dict, dict], want: tuple[dict, dict], initial: dict[str, torch.Tensor]) -> None:
    """Two trainers' (step statistics, weights after their first step from ``initial``) agree."""
    _assert_same_stats(got[0], want[0], _STEP_STATS)
    _assert_same_weights(got[1], want[1], _noise_moved(want[1], initial))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
async def test_each_loss_type_takes_the_same_step_for_any_micro_batch_size(model_dir: Path, loss_type: str):
    """One pass, micro-batches of 3 (3 + 3 + 2) and of 1 on a ragged batch with an untrained row:
    the same loss (the pure function's on the whole batch), statistics and updated weights."""
    from forge.distributed import call_spmd

    episodes = _ragged_episodes(model_dir)
    want = _whole_batch_loss(model_dir, episodes, loss_type)
    trainers = []
    try:
        for size in (0, 3, 1):  # one after another: from_pretrained in one process is not safe to overlap
            trainers.append(await _start_in_process(_loss_type_config(model_dir, loss_type, micro_batch_size=size)))
        steps = [await call_spmd(t.train_step, EpisodeBatch.pack(episodes)) for t in trainers]
        weights = [(await call_spmd(t.weights))[0] for t in trainers]
        assert_close_to_scale(steps[0]["loss"], want, scale=STAT_SCALES["loss"], what="loss")
        for got in zip(steps[1:], weights[1:]):
            _assert_same_step(got, (steps[0], weights[0]), _initial_weights(model_dir))
    finally:
        await _stop(*trainers)


async def test_the_loss_types_give_different_steps_on_a_ragged_batch(model_dir: Path):
    """Not one loss in three names: on the same batch the three report three different losses."""
    episodes = _ragged_episodes(model_dir)
    losses = [_whole_batch_loss(model_dir, episodes, t) for t in LOSS_TYPES]
    assert all(abs(a - b) > 1e-4 for i, a in enumerate(losses) for b in losses[i + 1 :]), losses


# ~35 s a case (two processes to start): dapo, whose ranks hold different token counts, by
# default; grpo's two-rank step is also the first test's.
@pytest.mark.parametrize(
    "loss_type", [pytest.param(t, marks=[] if t == "dapo" else [pytest.mark.slow]) for t in LOSS_TYPES]
)
async def test_each_loss_type_takes_the_same_step_on_two_ranks_as_on_one(model_dir: Path, loss_type: str):
    """procs=2 with micro-batches of 3 (3 + 1 on each rank; the ranks hold different token
    counts) and procs=1 in one pass: the same loss, statistics and updated weights."""
    from forge.distributed import call_spmd

    episodes = _ragged_episodes(model_dir)
    one = two = None
    try:
        one, two = await asyncio.gather(
            _start_in_process(_loss_type_config(model_dir, loss_type)),
            _start(2, _loss_type_config(model_dir, loss_type, micro_batch_size=3)),
        )
        batch = EpisodeBatch.pack(episodes)
        s1, s2 = await asyncio.gather(call_spmd(one.train_step, batch), call_spmd(two.train_step, batch))
        (w1, _), (w2, _) = await asyncio.gather(call_spmd(one.weights), call_spmd(two.weights))
        _assert_same_step((s2, w2), (s1, w1), _initial_weights(model_dir))
    finally:
        await _stop(one, two)


def test_trainer_config_refuses_an_unknown_loss_type_and_dr_grpo_without_a_length(model_dir: Path):
    """At construction, before any process starts: the bad value and the three allowed ones."""
    with pytest.raises(ValueError, match=r"loss_type must be one of grpo, dapo, dr_grpo, got 'bogus'"):
        _config(model_dir, loss_type="bogus")
    with pytest.raises(ValueError, match=r"max_response_tokens must be > 0 .*got 0"):
        _config(model_dir, loss_type="dr_grpo")
    assert _config(model_dir, loss_type="dr_grpo", max_response_tokens=8).max_response_tokens == 8


async def test_packed_sequences_take_the_same_step_with_less_padding(model_dir: Path):
    """``pack_sequences``: the same loss, statistics and updated weights as right-padding, and
    the logged padding fraction falls (the 8 episodes share rows of 64 tokens)."""
    from forge.distributed import call_spmd

    episodes = _ragged_episodes(model_dir)
    trainers = []
    try:
        for pack in (False, True):
            config = _loss_type_config(model_dir, "grpo", pack_sequences=pack, pack_row_tokens=64)
            trainers.append(await _start_in_process(config))
        steps = [await call_spmd(t.train_step, EpisodeBatch.pack(episodes)) for t in trainers]
        weights = [(await call_spmd(t.weights))[0] for t in trainers]
        _assert_same_step((steps[1], weights[1]), (steps[0], weights[0]), _initial_weights(model_dir))
        assert steps[1]["padding_fraction"] < steps[0]["padding_fraction"], [s["padding_fraction"] for s in steps]
    finally:
        await _stop(*trainers)
