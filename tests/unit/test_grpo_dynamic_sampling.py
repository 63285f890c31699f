"""Dynamic sampling in the GRPO app's rollouts: groups whose rewards are all equal are dropped
before the buffer, within a per-step bound, and every group stays accounted for.

The decision (``DynamicSampling``) is tested on real ``EpisodeBatch`` groups. The rollout loop
runs for real against the real replay buffer and dataset actors (in this process, as the app
runs them) with the training loop's own ``Rollouts.take_batch``; only generation is scripted (a
group maker that makes a group from the prompt, no vLLM), so whether a group is
uniform is known from its prompt.
"""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
import torch

from apps.common.launch import Roles
from apps.grpo.config import GRPOConfig
from apps.grpo.rollouts import DynamicSampling, RolloutCounts, Rollouts, rewards_uniform
from forge.config import load_config
from forge.losses import group_advantages
from forge.types import Episode, EpisodeBatch, Prompt

pytestmark = pytest.mark.timeout(120)


def _group(rewards: list[float], group_id: str = "g") -> EpisodeBatch:
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float32)).tolist()
    lp = torch.full((2,), -1.0)
    return EpisodeBatch.pack(
        [
            Episode(group_id, torch.tensor([1, 2]), torch.tensor([3, 4]), lp, lp.clone(), r, a, 0)
            for r, a in zip(rewards, advantages)
        ]
    )


UNIFORM, SPREAD = [0.3, 0.3, 0.3, 0.3], [0.0, 1.0, 0.0, 0.5]


# ----------------------------------------------------------------------------- the decision
def test_a_group_is_uniform_exactly_when_its_advantages_are_all_zero():
    for rewards, uniform in ((UNIFORM, True), (SPREAD, False), ([0.7], True), ([0.0, 0.0, 1e-6], False)):
        group = _group(rewards)
        assert rewards_uniform(group) is uniform
        assert bool((group.advantages == 0).all()) is uniform


def test_off_it_keeps_every_group_but_still_reports_the_zero_std_fraction():
    sampling = DynamicSampling(enabled=False, max_dropped_per_step=100)
    assert all(sampling.keep(_group(r)) for r in (UNIFORM, SPREAD, UNIFORM, UNIFORM))
    assert sampling.end_step() == {"zero_std_fraction": 0.75, "dropped_uniform_groups": 0.0}


def test_on_it_drops_uniform_groups_up_to_the_bound_then_keeps_them_and_warns_once(caplog):
    sampling = DynamicSampling(enabled=True, max_dropped_per_step=2)
    with caplog.at_level(logging.WARNING, logger="forge.grpo"):
        kept = [sampling.keep(_group(r)) for r in (UNIFORM, SPREAD, UNIFORM, UNIFORM, UNIFORM, SPREAD)]
    assert kept == [False, True, False, True, True, True]
    warnings = [r.getMessage() for r in caplog.records if "dynamic sampling" in r.getMessage()]
    assert len(warnings) == 1 and "rollout.max_dropped_per_step" in warnings[0]
    assert sampling.end_step() == {"zero_std_fraction": 4 / 6, "dropped_uniform_groups": 2.0}
    # The next step has its own budget, and its own warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="forge.grpo"):
        assert [sampling.keep(_group(UNIFORM)) for _ in range(3)] == [False, False, True]
    assert sum("dynamic sampling" in r.getMessage() for r in caplog.records) == 1
    assert sampling.end_step()["dropped_uniform_groups"] == 2.0


def test_a_step_in_which_no_group_finished_has_no_zero_std_fraction():
    metrics = DynamicSampling(enabled=True, max_dropped_per_step=1).end_step()
    assert math.isnan(metrics["zero_std_fraction"]) and metrics["dropped_uniform_groups"] == 0.0


@pytest.mark.parametrize("bound", [-1, 1.5, True])
def test_a_bad_bound_is_refused_naming_it(bound):
    with pytest.raises(ValueError, match=f"max_dropped_per_step must be .*got {bound!r}"):
        DynamicSampling(enabled=True, max_dropped_per_step=bound)


def test_counts_balance_with_dropped_groups():
    counts = RolloutCounts(started=10, stored=5, refused=1, dropped_uniform=3, in_flight=1)
    assert counts.lost == 0


async def test_group_counts_name_what_the_rollouts_and_the_buffer_lost():
    """groups/lost: started and neither stored, refused, dropped nor in flight; groups/unaccounted:
    added to the buffer and neither trained, evicted nor held. A vanished group shows in each."""
    from forge.actors.replay_buffer import BufferStats

    rollouts = Rollouts(Roles(), ScriptedGroups(None), concurrency=1, max_buffered=1)
    rollouts.counts = RolloutCounts(started=10, stored=6, refused=1, dropped_uniform=1, in_flight=1)
    rollouts.buffer_stats = BufferStats(added=6, sampled=3, evicted=1, size=1)
    counts = rollouts.group_counts()
    await rollouts.close()
    assert counts["groups/lost"] == 1.0 and counts["groups/unaccounted"] == 1.0
    assert counts["groups/trained"] == 3.0 and counts["groups/duplicates"] == 1.0


# ----------------------------------------------------------------------------- the rollout loop
def _prompt_number(prompt: Prompt) -> int:
    return int(prompt.prompt_id.rsplit("-", 1)[1])  # the toy task's ids: toy-<seed>-<index>


class ScriptedGroups:
    """A group maker whose generation is scripted: prompts whose number is in ``uniform`` get a
    group of equal rewards, the others a spread. While it runs, the rollouts' books balance."""

    def __init__(self, uniform: set[int] | None) -> None:
        self.uniform = uniform  # None: every prompt's group is uniform
        self.rollouts: Rollouts | None = None

    async def make(self, prompt: Prompt, group_id: str) -> EpisodeBatch:
        await asyncio.sleep(0.001)  # let the other workers and the training loop run
        rollouts = self.rollouts
        assert rollouts is not None and rollouts.counts.lost == 0
        assert 0 <= rollouts.outstanding <= rollouts.max_buffered
        uniform = self.uniform is None or _prompt_number(prompt) in self.uniform
        return _group(UNIFORM if uniform else SPREAD, group_id)


def _scripted(roles: Roles, cfg: GRPOConfig, maker: ScriptedGroups) -> Rollouts:
    """The app's rollouts over ``roles`` with ``cfg``'s concurrency, buffering and sampling."""
    sampling = DynamicSampling.from_config(cfg)
    rollouts = Rollouts(roles, maker, cfg.rollout_concurrency, cfg.max_buffered_groups, sampling=sampling)
    maker.rollouts = rollouts
    return rollouts


async def _local_roles(cfg: GRPOConfig) -> Roles:
    """The buffer and the dataset, in this process, as ``start_roles`` makes them."""
    from monarch.actor import this_proc

    from forge.actors import Dataset, DatasetConfig, ReplayBuffer

    buffer = this_proc().spawn("buffer_ds", ReplayBuffer, cfg.max_policy_age, 4 * cfg.max_buffered_groups)
    dataset = this_proc().spawn("dataset_ds", Dataset, DatasetConfig(source="toy", seed=cfg.seed))
    await asyncio.gather(buffer.setup.call_one(), dataset.setup.call_one())
    return Roles(buffer=buffer, dataset=dataset, local=[buffer, dataset])


async def _train_steps(cfg: GRPOConfig, rollouts: Rollouts, roles: Roles, steps: int) -> list[dict]:
    """The training loop's batch and metrics logic for ``steps`` steps (no trainer: the policy
    version stays 0, so nothing goes stale)."""
    rows = []
    tasks = rollouts.start()
    try:
        for _ in range(steps):
            groups = await asyncio.wait_for(rollouts.take_batch(cfg.prompts_per_step, 0), 30)
            rows.append({"groups": groups, **rollouts.end_step(groups), **rollouts.group_counts()})
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await rollouts.close()
    return rows


async def _stop(roles: Roles) -> None:
    await asyncio.gather(*(actor.stop() for actor in roles.local))


async def _run(cfg: GRPOConfig, uniform: set[int] | None, steps: int) -> list[dict]:
    """``steps`` steps of scripted rollouts (``uniform``: the prompts whose groups are uniform,
    None for all) against fresh local roles."""
    roles = await _local_roles(cfg)
    try:
        return await _train_steps(cfg, _scripted(roles, cfg, ScriptedGroups(uniform)), roles, steps)
    finally:
        await _stop(roles)


def _cfg(*overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, None, ["model.path=/m", "prompts_per_step=4", "group_size=4", *overrides])


async def test_with_dynamic_sampling_every_trained_group_has_a_reward_spread_and_none_is_lost():
    """Every third prompt's group is uniform: those are dropped before the buffer (their slots
    freed, so rollouts never stall), each batch holds only groups with a spread, and the books
    balance: started = stored + dropped + in flight, and the buffer saw only what was kept."""
    cfg = _cfg("rollout.dynamic_sampling=true")
    rows = await _run(cfg, set(range(0, 1000, 3)), steps=5)
    for row in rows:
        assert len(row["groups"]) == cfg.prompts_per_step
        assert not any(rewards_uniform(g) for g in row["groups"])
        assert row["batch_zero_std_groups"] == 0.0
        assert row["groups/lost"] == 0.0 and row["groups/unaccounted"] == 0.0, row
    # 20 trained groups with a spread came with about 10 uniform ones. With concurrency and
    # max_buffered_groups both 4, a dropped group that kept its slot would have stalled the run.
    dropped = sum(row["dropped_uniform_groups"] for row in rows)
    assert dropped >= 5 and rows[-1]["groups/dropped_uniform"] == dropped
    last = rows[-1]
    assert last["groups/started"] == last["groups/stored"] + dropped + last["groups/in_flight"]
    fractions = [row["zero_std_fraction"] for row in rows if not math.isnan(row["zero_std_fraction"])]
    assert fractions and all(0 < f < 1 for f in fractions)


async def test_without_dynamic_sampling_uniform_groups_train_and_are_counted():
    """Off (the default), the same prompts put uniform groups in the batches; zero_std_fraction
    still says how many there were, and nothing is dropped."""
    cfg = _cfg()
    rows = await _run(cfg, set(range(0, 1000, 3)), steps=3)
    # 12 of the first 16 prompts trained, and 6 of those 16 (0, 3, ..., 15) are uniform.
    assert sum(row["batch_zero_std_groups"] for row in rows) >= 2
    assert all(row["dropped_uniform_groups"] == 0.0 for row in rows)
    assert rows[-1]["groups/dropped_uniform"] == 0.0 and rows[-1]["groups/lost"] == 0.0
    assert any(row["zero_std_fraction"] > 0 for row in rows)


async def test_a_task_whose_every_group_is_uniform_still_trains_within_the_bound(caplog):
    """Every group uniform: each step drops at most rollout.max_dropped_per_step groups, then
    keeps uniform ones (with one warning per step), so training goes on instead of waiting forever."""
    cfg = _cfg("rollout.dynamic_sampling=true", "rollout.max_dropped_per_step=3")
    with caplog.at_level(logging.WARNING, logger="forge.grpo"):
        rows = await _run(cfg, None, steps=3)
    assert [len(row["groups"]) for row in rows] == [4, 4, 4]
    assert all(row["dropped_uniform_groups"] <= 3 for row in rows)
    assert rows[0]["dropped_uniform_groups"] == 3 and rows[0]["batch_zero_std_groups"] == 4
    assert all(row["zero_std_fraction"] == 1.0 for row in rows if not math.isnan(row["zero_std_fraction"]))
    assert any("rollout.max_dropped_per_step" in r.getMessage() for r in caplog.records)
    assert rows[-1]["groups/lost"] == 0.0 and rows[-1]["groups/unaccounted"] == 0.0


class DuplicatingGroups(ScriptedGroups):
    """The groups of prompts 2 and 3 come back under one ``group_id``, as a group generated again
    after a replica's death whose first try also got through would: the second reaches the
    buffer through the rollouts' own writer."""

    async def make(self, prompt: Prompt, group_id: str) -> EpisodeBatch:
        group = await super().make(prompt, group_id)
        return _group(SPREAD, "same-id") if _prompt_number(prompt) in (2, 3) else group


async def test_a_group_sent_to_the_buffer_twice_through_the_rollouts_is_refused_and_counted():
    """The buffer refuses the second group of an id it holds; the rollouts count it as a duplicate
    (``groups/duplicates``), free its slot, and every group stays accounted for."""
    cfg = _cfg()
    roles = await _local_roles(cfg)
    try:
        rows = await _train_steps(cfg, _scripted(roles, cfg, DuplicatingGroups(set())), roles, steps=3)
    finally:
        await _stop(roles)
    trained = [g.group_ids[0] for row in rows for g in row["groups"]]
    assert trained.count("same-id") == 1 and len(trained) == len(set(trained)) == 12
    last = rows[-1]
    assert last["groups/duplicates"] == 1.0
    assert last["groups/lost"] == 0.0 and last["groups/unaccounted"] == 0.0, last


# ----------------------------------------------------------------------------- the config
def test_the_default_bound_is_four_steps_of_prompts_and_zero_drops_none():
    cfg = _cfg("rollout.dynamic_sampling=true")
    assert cfg.rollout.max_dropped_per_step is None
    sampling = DynamicSampling.from_config(cfg)
    assert sampling.enabled and sampling.max_dropped_per_step == 16
    none = DynamicSampling.from_config(_cfg("rollout.dynamic_sampling=true", "rollout.max_dropped_per_step=0"))
    assert none.keep(_group(UNIFORM))
    assert not DynamicSampling.from_config(_cfg()).enabled


def test_single_and_multi_turn_rollouts_both_take_dynamic_sampling_from_the_config():
    from apps.grpo.groups import SingleTurnGroups
    from apps.grpo.multiturn import MultiTurnGroups

    single_cfg = _cfg("rollout.dynamic_sampling=true", "rollout.max_dropped_per_step=5")
    multi_cfg = _cfg(
        "rollout.dynamic_sampling=true", "rollout.max_dropped_per_step=5", "env.cls=forge.envs.toy:ReverseWithFeedback"
    )
    single = Rollouts.from_config(single_cfg, Roles(), "unused")
    multi = Rollouts.from_config(multi_cfg, Roles(env=object()), "unused")  # a placeholder handle: never called here
    assert type(single.maker) is SingleTurnGroups and type(multi.maker) is MultiTurnGroups
    assert multi.maker.max_turns == multi_cfg.env.max_turns and multi.maker.group_size == multi_cfg.group_size
    for rollouts in (single, multi):
        assert rollouts.sampling.enabled and rollouts.sampling.max_dropped_per_step == 5


def test_the_run_summary_says_how_many_groups_were_uniform_and_dropped(tmp_path):
    from apps.grpo.run_log import RunLog

    cfg = _cfg(f"logging.output_dir={tmp_path}", "logging.progress_bar=false", "logging.sinks=[jsonl]")
    log = RunLog(cfg, terminal=None)
    try:
        base = {"reward_mean": 0.5, "loss": 0.1}
        log.rows = [
            {**base, "zero_std_fraction": 0.5, "dropped_uniform_groups": 3.0},
            {**base, "zero_std_fraction": math.nan, "dropped_uniform_groups": 0.0},  # no group finished
            {**base, "zero_std_fraction": 0.25, "dropped_uniform_groups": 1.0},
        ]
        assert "uniform groups 38%, 4 dropped; " in log.summary(10.0, 1.0)
        log.rows = [base]  # a run from before these metrics: nothing to say
        assert "uniform groups" not in log.summary(10.0, 1.0)
    finally:
        log.close()
