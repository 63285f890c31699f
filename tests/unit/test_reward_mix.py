"""Mixing reward sources: per-source normalisation, weights, every source logged apart, and the
reward section's errors named at start-up."""

from __future__ import annotations

import math

import pytest
import torch

from apps.grpo.reward_mix import RewardMix, RewardSettings, model_source_name
from forge.observability import drain_local_metrics


def _logged() -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for name, value, _ in drain_local_metrics():
        out.setdefault(name, []).append(value)
    return out


def test_none_weighs_the_raw_scores_and_logs_every_source_even_at_weight_zero():
    drain_local_metrics()
    mix = RewardMix(RewardSettings({"exact_match": 0.0, "len": 0.5}, {"outputs/rm_a/final_model": 2.0}))
    parts = [{"exact_match": 1.0, "len": 4.0}, {"exact_match": 0.0, "len": 2.0}]
    rewards = mix.combine(parts, [[0.25], [-1.0]])
    assert rewards.tolist() == [0.5 * 4 + 2 * 0.25, 0.5 * 2 + 2 * -1.0]
    logged = _logged()
    assert logged["reward/fn_exact_match"] == [0.5] and logged["reward/fn_len"] == [3.0]
    assert logged["reward/model_rm_a"] == [-0.375]


def test_batch_standardises_each_source_over_the_group_and_a_constant_source_adds_nothing():
    mix = RewardMix(RewardSettings({"check": 1.0}, {"rm": 1.0}, normalize="batch"))
    scores = [[10.0], [20.0], [30.0], [40.0]]
    rewards = mix.combine([{"check": 1.0}] * 4, scores)  # the checker agrees on the whole group
    raw = torch.tensor([10.0, 20.0, 30.0, 40.0])
    want = (raw - raw.mean()) / raw.std(unbiased=False)
    assert torch.allclose(rewards, want, atol=1e-6)


def test_running_standardises_by_everything_the_source_scored_so_far():
    mix = RewardMix(RewardSettings({}, {"rm": 1.0}, normalize="running"))
    first = mix.combine([{}, {}], [[1.0], [3.0]])
    assert torch.allclose(first, torch.tensor([-1.0, 1.0]))  # mean 2, std 1 over the two seen
    second = mix.combine([{}, {}], [[5.0], [7.0]])
    seen = torch.tensor([1.0, 3.0, 5.0, 7.0])
    mean, std = float(seen.mean()), math.sqrt(float(((seen - seen.mean()) ** 2).mean()))
    assert torch.allclose(second, (torch.tensor([5.0, 7.0]) - mean) / std)  # a group above the rest stays above
    assert bool((second > 0).all())


def test_a_model_source_is_named_by_its_folder_or_its_runs():
    assert model_source_name("outputs/rm_addition/final_model") == "rm_addition"
    assert model_source_name("/models/my-rm") == "my-rm"


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"fns": {}, "models": {}}, "the reward needs a source: reward.fns or reward.models"),
        ({"fns": {"a": 1.0}, "normalize": "z"}, r"reward.normalize must be one of none, batch, running, got 'z'"),
        ({"fns": {"a": 0.0}, "models": {"m": 0.0}}, "every reward source has weight 0"),
        ({"fns": {}, "models": {"a/final_model": 1.0, "x/a": 1.0}}, "both logged as model_a"),
    ],
)
def test_reward_settings_that_cannot_train_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        RewardSettings(**settings)


def test_the_grpo_config_names_what_a_learned_reward_cannot_do(tmp_path):
    from apps.common.config import EvalData
    from apps.grpo.config import EvalSection, GRPOConfig, RewardSection, RolloutSection

    rm = {"models": {"outputs/rm/final_model": 1.0}}
    with pytest.raises(ValueError, match="reward.models scores single-turn completions"):
        GRPOConfig(reward=RewardSection(**rm), rollout=RolloutSection(agent="forge.envs.agents:reversal_game"))
    with pytest.raises(ValueError, match="eval.reward is needed"):
        GRPOConfig(
            reward=RewardSection(fns={"exact_match": 0.0}, **rm), eval=EvalSection(every=5, data=EvalData(path="x"))
        )
