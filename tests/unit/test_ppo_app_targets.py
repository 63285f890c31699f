"""PPO in the GRPO app (``algorithm: ppo``): each step's per-token targets from the critic's values,
the config's checks, and the critic role the app starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apps.grpo.config import GRPOConfig
from apps.grpo.ppo import critic_checkpoint, ppo_targets
from forge.config import load_config
from forge.types import Episode, EpisodeBatch
from tests.numerics import assert_close_to_scale

REPO = Path(__file__).resolve().parents[2]


def config(*overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, REPO / "configs/grpo_tiny.yaml", ["algorithm=ppo", *overrides])


def _batch() -> tuple[EpisodeBatch, torch.Tensor, torch.Tensor]:
    """Three episodes of 2, 4 and 3 tokens; the second trains only its first 3 (a stop token, say)."""
    gen = torch.Generator().manual_seed(1)
    lens, rewards = [2, 4, 3], [1.0, -0.5, 0.25]
    episodes = []
    for i, (n, reward) in enumerate(zip(lens, rewards)):
        zeros = torch.zeros(n)
        episodes.append(
            Episode(
                f"g{i}", torch.tensor([5, 6]), torch.randint(4, 60, (n,), generator=gen), zeros, zeros, reward, 0.0, 0
            )
        )
    values = torch.randn(sum(lens), generator=gen)
    trained = torch.tensor([True, True, True, True, True, False, True, True, True])
    return EpisodeBatch.pack(episodes), values, trained


def _textbook(batch: EpisodeBatch, values: torch.Tensor, trained: torch.Tensor, gamma: float, lam: float):
    """GAE one episode at a time, over its trained tokens only, the reward on the last of them."""
    advantages, returns = torch.zeros_like(values, dtype=torch.float64), torch.zeros_like(values, dtype=torch.float64)
    start = 0
    for n, reward in zip(batch.response_lens.tolist(), batch.rewards.tolist()):
        steps = [start + j for j in range(n) if trained[start + j]]
        running, next_value = 0.0, 0.0
        for k, t in reversed(list(enumerate(steps))):
            r = reward if k == len(steps) - 1 else 0.0
            delta = r + gamma * next_value - float(values[t])
            running = delta + gamma * lam * running
            advantages[t], returns[t] = running, running + float(values[t])
            next_value = float(values[t])
        start += n
    return advantages.float(), returns.float()


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_the_targets_are_each_episodes_gae_over_its_trained_tokens(gamma, lam):
    batch, values, trained = _batch()
    columns, stats = ppo_targets(batch, values, trained, gamma=gamma, lam=lam, whiten=False)
    want_adv, want_ret = _textbook(batch, values, trained, gamma, lam)
    assert_close_to_scale(columns["token_advantages"], want_adv, 1e-6)
    assert_close_to_scale(columns["returns"], want_ret, 1e-6)
    assert columns["token_advantages"][5] == 0 and columns["returns"][5] == 0  # the untrained token
    assert torch.equal(columns["values"], values)
    assert columns["token_advantages"].shape == batch.response_ids.shape
    assert -10 < stats["critic/explained_variance"] <= 1 and stats["ppo/advantage_std"] > 0


def test_whitened_targets_have_zero_mean_and_unit_spread_over_the_trained_tokens():
    batch, values, trained = _batch()
    columns, _ = ppo_targets(batch, values, trained, gamma=1.0, lam=0.95, whiten=True)
    picked = columns["token_advantages"][trained]
    assert abs(float(picked.mean())) < 1e-6 and abs(float(picked.std(correction=0)) - 1.0) < 1e-5
    assert columns["token_advantages"][5] == 0
    raw, _ = ppo_targets(batch, values, trained, gamma=1.0, lam=0.95, whiten=False)
    assert torch.equal(columns["returns"], raw["returns"])  # the critic's targets are never whitened


def test_targets_refuse_values_that_are_not_one_per_response_token():
    batch, values, trained = _batch()
    with pytest.raises(ValueError, match=r"one value and one trained flag per response token \(9\)"):
        ppo_targets(batch, values[:-1], trained[:-1], gamma=1.0, lam=0.95, whiten=True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm=reinforce", r"algorithm must be one of grpo, ppo, got 'reinforce'"),
        ("ppo.lam=1.5", r"ppo.lam must be a number in \[0, 1\], got 1.5"),
        ("ppo.gamma=-0.1", r"ppo.gamma must be a number in \[0, 1\], got -0.1"),
        ("critic.value_clip=0", r"critic.value_clip must be > 0"),
        ("critic.pack_sequences=true", r"critic.pack_sequences must be false"),
        ("critic.procs=0", r"critic.procs must be >= 1"),
    ],
)
def test_bad_ppo_settings_are_errors_naming_them(override, message):
    with pytest.raises(ValueError, match=message):
        config(override)


def test_ppo_without_a_critic_section_is_an_error_at_load_and_critic_braces_take_the_defaults():
    with pytest.raises(ValueError, match=r"algorithm: ppo needs a critic section"):
        load_config(GRPOConfig, None, ["model.path=/m", "algorithm=ppo"])
    assert load_config(GRPOConfig, None, ["model.path=/m", "algorithm=ppo", "critic={}"]).critic.lr == 1e-3
    assert load_config(GRPOConfig, None, ["model.path=/m"]).critic is None  # GRPO needs none


def test_a_ppo_run_starts_a_scalar_head_critic_that_trains_the_trainers_tokens(tmp_path):
    from apps.grpo.roles import role_specs

    cfg = config("trainer.checkpoint_every=2", "trainer.mask_truncated=true", f"logging.output_dir={tmp_path}")
    specs = {spec.name: spec for spec in role_specs(cfg, "/models/policy")}
    critic, trainer = specs["critic"].arg, specs["trainer"].arg
    assert not specs["critic"].service and critic.head == "scalar" and trainer.head == "lm"
    assert critic.model_path == "/models/policy" and critic.value_clip == 0.2
    assert critic.keep_checkpoints == trainer.keep_checkpoints + 1  # the trainer's kept ones all have the critic's
    assert critic.stop_token_ids == trainer.stop_token_ids and critic.mask_truncated is True
    assert Path(critic.checkpoint_dir) == tmp_path / "checkpoints" / "critic"
    assert (
        critic_checkpoint(cfg, tmp_path / "checkpoints" / "step_00000004")
        == Path(critic.checkpoint_dir) / "step_00000004"
    )
    other = config("critic.model=/models/critic", "critic.lr=0.5")
    critic = {s.name: s for s in role_specs(other, "/models/policy")}["critic"].arg
    assert critic.model_path == "/models/critic" and critic.lr == 0.5
    grpo = load_config(GRPOConfig, REPO / "configs/grpo_tiny.yaml", [])
    assert "critic" not in {s.name for s in role_specs(grpo, "/models/policy")}
