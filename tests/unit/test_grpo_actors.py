"""The GRPO roles' own logic: routing keys, packing, length buckets, rewards, the trainer step."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from forge.actors.policy import PackedGroups, PolicyConfig, prompt_key
from forge.actors.reference_model import (
    PackedPairs,
    ReferenceModel,
    ResponseGroup,
    group_bucket,
    group_tokens,
    length_bucket,
)
from forge.actors.reward import RewardActor, resolve_reward
from forge.controller import KeyAffinity
from forge.controller.routing import RouteRequest
from forge.types import Completion, Episode, EpisodeBatch, Groups, Prompt
from tests.numerics import assert_close_to_scale


@dataclass
class _Replica:
    replica_id: int
    in_flight: int = 0

    def has_forming(self, endpoint: str, key: object) -> bool:
        return True  # a batch is always forming in generate's one queue: affinity must ignore it


def _prompt(text: str) -> Prompt:
    return Prompt(prompt_id=text, text=text, answer=text[::-1])


# ------------------------------------------------------------------ policy routing and packing
def test_prompts_route_apart_by_their_text_while_sharing_one_batch_queue():
    """The prompt key only routes: key_affinity spreads prompts by their text, and a batch
    forming in generate's one queue (no batch_key) on every replica does not pull them together."""
    assert prompt_key(_prompt("123=")) == "123=" != prompt_key(_prompt("456="))
    replicas = [_Replica(i) for i in range(4)]
    router = KeyAffinity()
    owners = {
        text: router.choose(RouteRequest("generate", prompt_key(_prompt(text))), replicas).replica_id
        for text in (f"{i:03d}=" for i in range(40))
    }
    assert len(set(owners.values())) == 4  # spread over every replica
    again = router.choose(RouteRequest("generate", prompt_key(_prompt("007="))), replicas).replica_id
    assert again == owners["007="]  # the same prompt (a retry) goes back to its owner


def test_prompt_affinity_spills_off_an_overloaded_owner():
    """Affinity yields to the load bound: a hot owner's prompts go to the least-loaded replica."""
    router = KeyAffinity(load_factor=1.0, slack=0)
    replicas = [_Replica(0), _Replica(1)]
    owner = router.choose(RouteRequest("generate", "1="), replicas)
    owner.in_flight = 10
    other = router.choose(RouteRequest("generate", "1="), replicas)
    assert other is not owner


def test_packed_groups_round_trip_and_each_piece_travels_alone():
    """PackedGroups.unpack gives back every completion; each of its tensors, sent on alone (to the
    reference, the buffer), carries its own elements, not the whole batch's flat storage."""
    import io

    from monarch._src.actor import pickle as monarch_pickle

    prompts = [_prompt("12="), _prompt("3456=")]
    outputs = [
        [
            Completion(torch.tensor([4, 5, 6]), torch.arange(200 * (k + 1)), -torch.rand(200 * (k + 1)), f"t{k}", 3)
            for k in range(2)
        ]
        for _ in prompts
    ]
    outputs[1] = [Completion(torch.tensor([7, 8, 9, 10, 11]), c.token_ids, c.logprobs, c.text, 3) for c in outputs[1]]
    groups = PackedGroups.pack(prompts, outputs, version=3).unpack()
    assert [g.prompt.text for g in groups] == ["12=", "3456="]
    assert [g.response_lens for g in groups] == [[200, 400], [200, 400]] and [len(g) for g in groups] == [2, 2]
    for group in groups:  # the group's own slice goes to the reference alone
        sent = io.BytesIO()
        monarch_pickle.torch_dump(group.token_ids, sent)
        assert 600 * 8 < len(sent.getvalue()) < 600 * 8 + 1_000
    for group, expected in zip(groups, outputs):
        for got, want in zip(group.completions, expected):
            assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.logprobs, want.logprobs)
            assert torch.equal(got.prompt_ids, want.prompt_ids) and got.text == want.text and got.policy_version == 3
            sent = io.BytesIO()
            monarch_pickle.torch_dump(got.token_ids, sent)
            own = got.token_ids.numel() * 8  # 1.6 or 3.2 KB of the batch's 9.6 KB
            assert own < len(sent.getvalue()) < own + 1_000, (own, len(sent.getvalue()))


def test_policy_config_accepts_only_known_engine_modes():
    """engine_mode is "batched" (the default) or "async"; anything else names the choices."""
    assert PolicyConfig(model_path="m").engine_mode == "batched"
    assert PolicyConfig(model_path="m", engine_mode="async").engine_mode == "async"
    with pytest.raises(ValueError, match=r"engine_mode must be one of \('batched', 'async'\), got 'sync'"):
        PolicyConfig(model_path="m", engine_mode="sync")


# ------------------------------------------------------------------ reference packing and buckets
def test_short_sequences_share_a_bucket_and_long_ones_pad_little():
    """Lengths up to 32 share bucket 0; above, a bucket's longest is < 1.25x its shortest + 1."""
    pair = lambda n: (torch.zeros(1, dtype=torch.long), torch.zeros(n - 1, dtype=torch.long))  # noqa: E731
    assert {length_bucket(pair(n)) for n in range(2, 33)} == {0}
    by_bucket: dict[int, list[int]] = {}
    for n in range(33, 2000):
        by_bucket.setdefault(length_bucket(pair(n)), []).append(n)
    assert all(max(ns) <= 1.25 * min(ns) + 1 for ns in by_bucket.values())
    assert sorted(by_bucket) == list(range(1, len(by_bucket) + 1))  # monotonic, no gaps


def test_reference_enbatch_and_debatch_round_trip():
    """pack_pairs/split_logprobs keep each caller's tensors apart, in order."""
    pairs = [(torch.tensor([1, 2]), torch.tensor([3])), (torch.tensor([4]), torch.tensor([5, 6, 7]))]
    packed = ReferenceModel.pack_pairs(pairs)
    assert isinstance(packed, PackedPairs)
    prompts, responses = packed.unpack()
    assert [p.tolist() for p in prompts] == [[1, 2], [4]] and [r.tolist() for r in responses] == [[3], [5, 6, 7]]
    flat = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    out = ReferenceModel.split_logprobs((flat, packed.response_lens), 2)
    assert [t.tolist() for t in out] == [[-1.0], [-2.0, -3.0, -4.0]]
    with pytest.raises(ValueError, match="2 results for 3 pairs"):
        ReferenceModel.split_logprobs((flat, packed.response_lens), 3)


def test_reference_group_enbatch_and_debatch_give_each_caller_its_groups_rows_in_order():
    """pack_groups/split_group_logprobs: two groups in one batch, each back with its own logprobs, flat."""
    groups = [
        ResponseGroup(torch.tensor([1, 2]), torch.tensor([3, 4, 5]), [1, 2]),
        ResponseGroup(torch.tensor([6]), torch.tensor([7, 8, 9]), [3]),
    ]
    packed = ReferenceModel.pack_groups(groups)
    assert isinstance(packed, Groups) and packed.sizes == [2, 1]
    prompts, responses = packed.batch.unpack()
    assert [p.tolist() for p in prompts] == [[1, 2], [1, 2], [6]]
    assert [r.tolist() for r in responses] == [[3], [4, 5], [7, 8, 9]]
    flat = torch.arange(6, dtype=torch.float32)
    out = ReferenceModel.split_group_logprobs((flat, packed.batch.response_lens, packed.sizes), 2)
    assert [g.tolist() for g in out] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    with pytest.raises(ValueError, match="returned 2 groups of 3 responses and 3 logprob rows for 3 groups"):
        ReferenceModel.split_group_logprobs((flat, packed.batch.response_lens, packed.sizes), 3)


def test_a_group_is_bucketed_by_its_longest_pair_and_sized_by_its_tokens():
    """A group's batch key is the bucket its longest sequence would have had alone; its size is
    every pair's tokens, prompt included."""
    prompt = torch.zeros(10, dtype=torch.long)
    group = ResponseGroup(prompt, torch.zeros(405, dtype=torch.long), [5, 400])
    long = torch.zeros(400, dtype=torch.long)
    assert group_bucket(group) == length_bucket((prompt, long)) > length_bucket((prompt, long[:5]))
    assert group_tokens(group) == 2 * 10 + 405


def test_reference_scores_a_batch_larger_than_the_token_budget_in_passes_within_it():
    """A batch of groups over the budget is scored in consecutive passes of at most the budget,
    every response's row in order."""
    from forge.actors.reference_model import TOKEN_BUDGET

    passes: list[int] = []

    def score(prompts: list[torch.Tensor], responses: list[torch.Tensor]) -> list[torch.Tensor]:
        passes.append(sum(int(p.numel()) + int(r.numel()) for p, r in zip(prompts, responses)))
        return [torch.full((int(r.numel()),), float(r[0])) for r in responses]

    reference = object.__new__(ReferenceModel)  # the passes only: no model, no actor
    reference._score = score
    prompt = torch.zeros(100, dtype=torch.long)
    responses = [torch.full((900,), i, dtype=torch.long) for i in range(40)]  # 40,000 tokens
    rows = ReferenceModel._score_within_budget(reference, [prompt] * 40, responses)
    assert [float(r[0]) for r in rows] == [float(i) for i in range(40)]
    assert sum(passes) == 40_000 and max(passes) <= TOKEN_BUDGET and len(passes) == 3


async def test_reference_batches_hold_at_most_a_token_budget_not_a_sequence_count():
    """64 pairs of 700 tokens (the Qwen3 run's truncated responses) run as batches of <= 16,384 tokens."""
    from forge.actors.reference_model import TOKEN_BUDGET
    from forge.controller.batching import Batcher
    from forge.controller.endpoint import endpoint_specs

    spec = endpoint_specs(ReferenceModel)["logprobs"].batching
    batches: list[int] = []

    async def execute(items: list, key: object) -> list[int]:
        batches.append(sum(int(p.numel()) + int(r.numel()) for p, r in items))
        return [0] * len(items)

    batcher = Batcher(spec, execute)
    pair = (torch.zeros(188, dtype=torch.long), torch.zeros(512, dtype=torch.long))
    await asyncio.gather(*(batcher.submit(pair, key=length_bucket(pair)) for _ in range(64)))
    await batcher.close()
    assert TOKEN_BUDGET == 16384 and sum(batches) == 64 * 700
    assert max(batches) <= TOKEN_BUDGET and len(batches) >= 3


# ------------------------------------------------------------------ rewards
def half(prompt: Prompt, text: str) -> float:
    return 0.5


def fails_on_x(prompt: Prompt, text: str) -> float:
    if text == "x":
        raise RuntimeError("boom")
    return 1.0


def text_length(prompt: Prompt, text: str) -> float:
    return float(len(text))


def test_reward_functions_resolve_by_registry_name_or_import_path():
    """'toy' comes from forge.data's registry; 'module:function' imports the function."""
    assert resolve_reward("toy")(Prompt("p", "123=", "321"), "321") == pytest.approx(1.0)
    assert resolve_reward(f"{__name__}:half") is half
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_reward(f"{__name__}:missing")
    with pytest.raises(KeyError, match="unknown reward"):
        resolve_reward("no_such_reward")


async def test_reward_actor_weights_functions_and_isolates_failures():
    """Scores are the weighted sum of the functions; a failing pair fails alone, by name."""
    from monarch.actor import this_proc

    actor = this_proc().spawn("reward_test", RewardActor, {f"{__name__}:half": 2.0, f"{__name__}:fails_on_x": 1.0})
    try:
        await actor.setup.call_one()
        p = _prompt("1=")
        scores = await actor.score.call_one([(p, "a"), (p, "x"), (p, "b")])
        assert scores[0] == scores[2] == pytest.approx(2.0)
        assert isinstance(scores[1], ValueError) and "fails_on_x" in str(scores[1])
    finally:
        await actor.stop()


async def test_reward_actor_scores_whole_groups_and_isolates_failures_within_them():
    """score_groups: one list per group, each response's reward in order; a failing pair's entry
    is its error, the rest of its group and the other groups are scored."""
    from monarch.actor import this_proc

    fns = {f"{__name__}:half": 2.0, f"{__name__}:fails_on_x": 1.0, f"{__name__}:text_length": 1.0}
    actor = this_proc().spawn("reward_groups", RewardActor, fns)
    try:
        await actor.setup.call_one()
        p, q = _prompt("1="), _prompt("2=")
        scores = await actor.score_groups.call_one([(p, ["ccc", "x", "a"]), (q, ["bb"])])
        assert [len(g) for g in scores] == [3, 1]
        assert [scores[0][0], scores[0][2], scores[1][0]] == pytest.approx([5.0, 3.0, 4.0])  # 1 + 1 + len(text)
        assert isinstance(scores[0][1], ValueError) and "fails_on_x" in str(scores[0][1])
    finally:
        await actor.stop()


# ------------------------------------------------------------------ trainer
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from forge.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("trainer") / "tiny", hidden_size=64, init_std=0.1)


def _on_policy_batch(model_dir: Path, temperature: float) -> EpisodeBatch:
    """Episodes whose behaviour logprobs are the initial model's own (ratio exactly 1)."""
    from transformers import AutoModelForCausalLM

    from forge.models import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    prompts = [torch.randint(4, 64, (n,)) for n in (3, 5, 4, 4)]
    responses = [torch.randint(4, 64, (n,)) for n in (2, 4, 1, 3)]
    lps = sequence_logprobs(model, prompts, responses, temperature)
    episodes = [
        Episode(f"g{i // 2}", p, r, lp, lp.clone(), float(i % 2), 1.0 if i % 2 else -1.0, 0)
        for i, (p, r, lp) in enumerate(zip(prompts, responses, lps))
    ]
    return EpisodeBatch.pack(episodes)


async def test_trainer_step_is_on_policy_bumps_version_and_publishes_tensors(model_dir: Path):
    """On-policy data gives ratio 1 and no clipping; each step bumps the version; weights are tensors."""
    from monarch.actor import this_proc

    from forge.actors.trainer import Trainer, TrainerConfig

    trainer = this_proc().spawn(
        "trainer_test", Trainer, TrainerConfig(model_path=str(model_dir), temperature=0.7, lr=1e-2)
    )
    try:
        await trainer.setup.call_one()
        before, version = await trainer.weights.call_one()
        assert version == 0 and "lm_head.weight" not in before  # tied head is left out
        assert all(isinstance(t, torch.Tensor) for t in before.values())
        stats = await trainer.train_step.call_one(_on_policy_batch(model_dir, temperature=0.7))
        # The behaviour logprobs came from a no-grad pass over the same batch: equal to float noise.
        assert_close_to_scale(stats["ratio_mean"], 1.0, what="ratio_mean")
        assert stats["clip_fraction"] == 0.0
        assert_close_to_scale(stats["kl"], 0.0, rel=1e-6, scale=1.0, what="kl")  # ~ noise^2 / 2
        assert stats["policy_version"] == 1.0
        after, version = await trainer.weights.call_one()
        assert version == 1
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        await trainer.stop()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
async def test_trainer_step_takes_the_ratio_from_behaviour_the_kl_from_reference_and_each_episodes_advantage(
    model_dir: Path, loss_type: str
):
    """A step on on-policy episodes whose reference logprobs sit below their behaviour ones (by a
    per-token amount) and whose rewards and advantages differ, in two micro-batches of unequal
    tokens: ratio 1 (behaviour), the KL is the k3 of the reference gaps (a token mean), the policy
    loss is -mean(A_b) (grpo) or -sum(A_b T_b) / sum(T_b) (dapo), and the first step's lr is warmup's."""
    from forge.losses.grpo import k3_kl

    episodes = _on_policy_batch(model_dir, temperature=1.0).unpack()  # response lengths 2, 4, 1, 3
    for i, e in enumerate(episodes):
        e.ref_logprobs = e.behaviour_logprobs - 0.1 * torch.arange(1, e.response_ids.numel() + 1) - 0.2 * i
        e.reward, e.advantage = 5.0 + i, (-1.5, 0.5, 2.0, 1.0)[i]
    stats = await _one_step(
        model_dir, f"trainer_{loss_type}", episodes, loss_type=loss_type, beta=0.5, micro_batch_size=2, warmup_steps=2
    )
    per_token_kl = [k3_kl(e.behaviour_logprobs, e.ref_logprobs) for e in episodes]
    kl = float(torch.cat(per_token_kl).mean())  # ~0.16
    lengths = [e.response_ids.numel() for e in episodes]
    if loss_type == "dapo":
        pg = -sum(e.advantage * n for e, n in zip(episodes, lengths)) / sum(lengths)  # -0.4
        kl_loss = kl
    else:
        pg = -sum(e.advantage for e in episodes) / len(episodes)  # -0.5
        kl_loss = sum(float(t.mean()) for t in per_token_kl) / len(episodes)
    assert_close_to_scale(stats["ratio_mean"], 1.0, rel=1e-4, what="ratio_mean")
    assert_close_to_scale(stats["kl"], kl, rel=1e-4, what="kl")
    assert_close_to_scale(stats["kl_loss"], kl_loss, rel=1e-4, what="kl_loss")
    assert_close_to_scale(stats["pg_loss"], pg, rel=1e-4, what="pg_loss")
    assert_close_to_scale(stats["loss"], pg + 0.5 * kl_loss, rel=1e-4, scale=1.0, what="loss")
    assert stats["tokens"] == sum(lengths) and stats["lr"] == pytest.approx(0.5e-2)


def test_a_step_counts_its_trained_sequences_tokens_and_rows_from_each_episodes_own_mask():
    """The trainer pads a packed batch once and lays each episode's own mask where its response
    sits (all true without one); counts() gives the sequences with a trained token, the trained
    tokens and all rows."""
    from types import SimpleNamespace

    from forge.actors.trainer import Trainer, TrainerConfig
    from forge.actors.trainer_batches import counts

    def episode(prompt: list[int], response: list[int], mask: list[bool] | None) -> Episode:
        lp = torch.full((len(response),), -1.0)
        own = torch.tensor(mask) if mask is not None else None
        return Episode("g", torch.tensor(prompt), torch.tensor(response), lp, lp, 0.0, 0.0, 0, loss_mask=own)

    episodes = [
        episode([1, 2], [3, 4, 5], [True, False, True]),
        episode([1], [6, 7], None),
        episode([1, 2, 3], [8], [False]),
    ]
    trainer = SimpleNamespace(config=TrainerConfig(model_path="unused", stop_token_ids=[3, 6]))
    batch = Trainer._pack(trainer, EpisodeBatch.pack(episodes))  # a batch with masks: no stop-token cut
    assert batch.loss_mask.int().tolist() == [[0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert counts([batch]) == {"sequences": 2.0, "tokens": 4.0, "rows": 3.0}


async def test_trainer_resumed_from_a_checkpoint_continues_exactly(model_dir: Path, tmp_path: Path):
    """A fresh trainer loading step 1's checkpoint has the same weights, optimizer state,
    version and RNG state, so its step 2 equals the original trainer's bit for bit."""
    from monarch.actor import this_proc

    from forge.actors.trainer import Trainer, TrainerConfig
    from forge.checkpoint import read_checkpoint

    def config(name: str) -> TrainerConfig:
        return TrainerConfig(model_path=str(model_dir), temperature=0.7, lr=1e-2, checkpoint_dir=str(tmp_path / name))

    first_batch = _on_policy_batch(model_dir, temperature=0.7)
    second_batch = _on_policy_batch(model_dir, temperature=0.7)
    original = this_proc().spawn("trainer_original", Trainer, config("original"))
    resumed = this_proc().spawn("trainer_resumed", Trainer, config("resumed"))
    try:
        await original.setup.call_one()
        await original.train_step.call_one(first_batch)
        torch.rand(5)  # the RNG state saved is then not the seed's
        path = await original.save_checkpoint.call_one(1, {"dataset_position": 12})
        assert await original.wait_checkpoint.call_one() == path  # written in the background
        expected_draw = torch.rand(4)  # actors spawned on this_proc share this process's RNG
        await original.train_step.call_one(second_batch)
        want, want_version = await original.weights.call_one()

        await resumed.setup.call_one()  # reseeds torch: the RNG state is not step 1's any more
        step, version, extra = await resumed.load_checkpoint.call_one(path)
        assert (step, version, extra) == (1, 1, {"dataset_position": 12})
        assert torch.equal(torch.rand(4), expected_draw)
        resaved = await resumed.save_checkpoint.call_one(1)
        await resumed.wait_checkpoint.call_one()
        (w0, o0, _), (w1, o1, _) = read_checkpoint(path), read_checkpoint(resaved)
        assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
        assert o0["state"].keys() == o1["state"].keys() and o0["state"]
        for name, p0 in o0["state"].items():
            assert all(torch.equal(p0[k], o1["state"][name][k]) for k in ("step", "exp_avg", "exp_avg_sq")), name
        await resumed.train_step.call_one(second_batch)
        got, got_version = await resumed.weights.call_one()
        assert got_version == want_version == 2
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        await original.stop()
        await resumed.stop()


async def test_trainer_refuses_a_checkpoint_of_another_model_shape(model_dir: Path, tmp_path: Path):
    """Loading a checkpoint whose tensors have other shapes is an error naming tensor, shapes and both layouts."""
    from monarch.actor import this_proc

    from forge.actors.trainer import Trainer, TrainerConfig
    from forge.models import make_tiny_model

    wider = make_tiny_model(tmp_path / "wider", hidden_size=128)
    small_cfg = TrainerConfig(model_path=str(model_dir), checkpoint_dir=str(tmp_path / "ckpt"))
    small = this_proc().spawn("trainer_small", Trainer, small_cfg)
    wide = this_proc().spawn("trainer_wide", Trainer, TrainerConfig(model_path=str(wider)))
    try:
        await small.setup.call_one()
        await wide.setup.call_one()
        path = await small.save_checkpoint.call_one(3)
        await small.wait_checkpoint.call_one()
        shapes = r"model\.embed_tokens\.weight is \[\d+, 64\] in the checkpoint but \[\d+, 128\] in the model"
        layouts = r"The checkpoint's layout: \d+ layers, hidden 64, .*; the model's: \d+ layers, hidden 128, "
        with pytest.raises(Exception, match=f"does not fit the model: {shapes}\\. {layouts}"):
            await wide.load_checkpoint.call_one(path)
    finally:
        await small.stop()
        await wide.stop()


async def test_trainer_first_publish_removes_weight_files_of_killed_trainers(model_dir: Path, tmp_path: Path):
    """Files a killed trainer published (its pid is gone) are removed; a live process's stay."""
    import subprocess
    import sys

    from monarch.actor import this_proc

    from forge.actors.trainer import Trainer, TrainerConfig

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"weights-{int(dead.stdout)}-4-v4.safetensors"
    live = tmp_path / f"weights-{os.getppid()}-1-v1.safetensors"
    orphan.write_bytes(b"x")
    live.write_bytes(b"x")
    trainer = this_proc().spawn("trainer_publish", Trainer, TrainerConfig(model_path=str(model_dir)))
    try:
        await trainer.setup.call_one()
        path, version = await trainer.publish_weights.call_one(str(tmp_path))
        assert version == 0 and Path(path).exists()
        assert not orphan.exists() and live.exists()
    finally:
        await trainer.stop()


async def _one_step(model_dir: Path, name: str, episodes: list[Episode], **settings) -> dict[str, float]:
    """A fresh trainer's statistics for one step on ``episodes``."""
    from monarch.actor import this_proc

    from forge.actors.trainer import Trainer, TrainerConfig

    trainer = this_proc().spawn(name, Trainer, TrainerConfig(model_path=str(model_dir), lr=1e-2, **settings))
    try:
        await trainer.setup.call_one()
        return await trainer.train_step.call_one(EpisodeBatch.pack(episodes))
    finally:
        await trainer.stop()


# The two batches differ in padding, so the trainers' sums run in other orders: the loss's
# tolerance follows its per-token terms, |advantage| (1) x ratio (about 1), not the loss.
_LOSS_SCALE = 1.0


def _episode(response: list[int], advantage: float, finish_reason: str = "stop") -> Episode:
    """Behaviour logprobs of -4 everywhere: each token's ratio, so the loss, depends on the token."""
    r = torch.tensor(response)
    lp = torch.full((len(response),), -4.0)
    return Episode("g", torch.tensor([5, 6, 7]), r, lp, lp.clone(), 0.0, advantage, 0, finish_reason=finish_reason)


async def test_trainer_trains_nothing_past_the_first_stop_token(model_dir: Path):
    """[9, STOP, junk, junk] with stop_token_ids=[STOP] has the loss and token count of [9, STOP] alone."""
    stop = 11
    cut = await _one_step(model_dir, "trainer_stop_cut", [_episode([9, stop], 1.0), _episode([12, 13], -1.0)])
    long = [_episode([9, stop, 30, 31], 1.0), _episode([12, 13], -1.0)]
    masked = await _one_step(model_dir, "trainer_stop_masked", long, stop_token_ids=[stop])
    unmasked = await _one_step(model_dir, "trainer_stop_unmasked", long)
    assert masked["tokens"] == cut["tokens"] == 4.0 and unmasked["tokens"] == 6.0
    assert_close_to_scale(masked["loss"], cut["loss"], scale=_LOSS_SCALE, what="loss")
    assert unmasked["loss"] != pytest.approx(cut["loss"], abs=1e-4)


async def test_trainer_with_mask_truncated_leaves_cut_completions_out(model_dir: Path):
    """A 'length' episode next to a finished one: with mask_truncated the step is the finished one's alone."""
    batch = [_episode([9, 10], 1.0), _episode([12], -1.0, "length")]
    masked = await _one_step(model_dir, "trainer_trunc_masked", batch, mask_truncated=True)
    unmasked = await _one_step(model_dir, "trainer_trunc_unmasked", batch)
    only = await _one_step(model_dir, "trainer_trunc_only", batch[:1])
    assert masked["tokens"] == only["tokens"] == 2.0 and unmasked["tokens"] == 3.0
    assert_close_to_scale(masked["loss"], only["loss"], scale=_LOSS_SCALE, what="loss")
    assert unmasked["loss"] != pytest.approx(only["loss"], abs=1e-4)


def test_a_plain_group_packs_as_the_policy_would_and_an_empty_one_packs_empty():
    """PackedGroup.of: a Group from a policy of the user's own packs into the same flat fields
    (and gives its completions back); one with no completions packs empty, so the rollouts'
    count check, not the packing, names the policy."""
    from forge.types import Group, PackedGroup

    prompt = _prompt("12=")
    completions = [
        Completion(torch.tensor([4, 5]), torch.arange(k + 1), -torch.rand(k + 1), f"t{k}", 2) for k in range(3)
    ]
    packed = PackedGroup.of(Group(prompt, completions))
    assert len(packed) == 3 and packed.response_lens == [1, 2, 3] and packed.policy_version == 2
    assert packed.token_ids.tolist() == [0, 0, 1, 0, 1, 2] and packed.texts == ["t0", "t1", "t2"]
    assert [c.token_ids.tolist() for c in packed.completions] == [[0], [0, 1], [0, 1, 2]]
    assert PackedGroup.of(packed) is packed
    empty = PackedGroup.of(Group(prompt, []))
    assert len(empty) == 0 and empty.token_ids.numel() == 0 and empty.completions == []


def test_bad_weight_update_settings_fail_naming_the_value_and_what_is_expected() -> None:
    """A mode that does not exist, in-flight updates on an engine or with a trainer that cannot
    take them, and keep_kv_on_update on the async engine: each a ValueError saying why."""
    from apps.grpo.config import GRPOConfig
    from forge.actors.policy import PolicyConfig, PolicySettings
    from forge.config import load_config
    from forge.models.lora import LoraSettings

    with pytest.raises(ValueError, match=r"weight_updates must be one of \('drain', 'in_flight'\), got 'rolling'"):
        PolicyConfig(model_path="m", weight_updates="rolling")
    with pytest.raises(
        ValueError, match="in-flight weight updates need engine_mode 'batched', got engine_mode 'async'"
    ):
        PolicyConfig(model_path="m", weight_updates="in_flight", engine_mode="async")
    # A LoRA policy takes adapter updates in flight (each sequence on the adapter it started with).
    assert PolicyConfig(model_path="m", weight_updates="in_flight", lora=LoraSettings(rank=8)).lora is not None
    with pytest.raises(ValueError, match="keep_kv_on_update needs engine_mode 'batched'"):
        PolicySettings(keep_kv_on_update=True, engine_mode="async")
    with pytest.raises(
        ValueError, match=r"weight_sync.mode must be one of \('drain', 'in_flight', 'rolling'\), got 'x'"
    ):
        load_config(GRPOConfig, "configs/grpo_tiny.yaml", ["weight_sync.mode=x"])
    for replicas, updating in ((2, 0), (2, 2), (1, 1)):
        with pytest.raises(ValueError, match=f"fewer than policy.num_replicas \\({replicas}\\).*got {updating}"):
            load_config(
                GRPOConfig,
                "configs/grpo_tiny.yaml",
                ["weight_sync.mode=rolling", f"weight_sync.max_updating={updating}", f"policy.num_replicas={replicas}"],
            )
    with pytest.raises(ValueError, match="policy.concurrent_batches must be an int >= 1, got 0"):
        load_config(GRPOConfig, "configs/grpo_tiny.yaml", ["policy.concurrent_batches=0"])


def test_concurrent_batches_override_an_endpoints_batching_and_name_a_batched_endpoint() -> None:
    from forge.actors.policy import Policy
    from forge.controller.endpoint import endpoint_specs, with_concurrent_batches
    from forge.controller.options import ActorOptions

    specs = endpoint_specs(Policy)
    assert specs["generate"].batching.max_concurrent_batches == 1
    changed = with_concurrent_batches(specs, {"generate": 4}, "Policy")
    assert changed["generate"].batching.max_concurrent_batches == 4
    assert (
        changed["sample"].batching.max_concurrent_batches == 1
        and specs["generate"].batching.max_concurrent_batches == 1
    )
    with pytest.raises(ValueError, match="names 'version', which is not a batched endpoint of Policy"):
        with_concurrent_batches(specs, {"version": 2}, "Policy")
    with pytest.raises(ValueError, match=r"concurrent_batches\['generate'\]"):
        ActorOptions(concurrent_batches={"generate": 0})
