"""PPO's pure pieces: GAE against a step-by-step reference, whitening, the clipped value loss,
explained variance, and the GRPO surrogate with per-token advantages."""

from __future__ import annotations

import pytest
import torch

from forge.losses import grpo_loss
from forge.losses.ppo import explained_variance, gae, value_loss, whiten
from tests.numerics import assert_close_to_scale


def reference_gae(rewards, values, mask, gamma, lam):
    """GAE one row at a time over the row's masked tokens, written out as the textbook does."""
    adv = torch.zeros_like(values, dtype=torch.float64)
    for b in range(values.shape[0]):
        idx = [t for t in range(values.shape[1]) if mask[b, t]]
        following = 0.0
        for k in reversed(range(len(idx))):
            v = float(values[b, idx[k]])
            v_next = float(values[b, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            r = float(rewards[b]) if k == len(idx) - 1 else 0.0
            following = r + gamma * v_next - v + gamma * lam * following
            adv[b, idx[k]] = following
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_the_step_by_step_definition_with_holes_in_the_mask(gamma, lam):
    torch.manual_seed(0)
    values = torch.randn(5, 9)
    mask = torch.rand(5, 9) > 0.3  # holes: a multi-turn episode's environment tokens
    mask[3] = False  # a row with nothing trained
    rewards = torch.randn(5)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    want = reference_gae(rewards, values, mask, gamma, lam)
    assert_close_to_scale(adv, want.float(), what="advantages")
    assert_close_to_scale(ret, torch.where(mask, want.float() + values, torch.zeros(())), what="returns")
    assert not adv[~mask].any() and not ret[~mask].any()


def test_monte_carlo_gae_is_the_reward_minus_each_value():
    values = torch.tensor([[0.2, 0.5, 0.9, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    adv, ret = gae(torch.tensor([1.0]), values, mask, gamma=1.0, lam=1.0)
    assert adv[0, :3].tolist() == pytest.approx([0.8, 0.5, 0.1])
    assert ret[0, :3].tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_gae_refuses_bad_shapes_and_discounts():
    with pytest.raises(ValueError, match="rewards must be"):
        gae(torch.zeros(3), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(2), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool), gamma=1.5)


def test_whiten_standardises_the_masked_tokens_only():
    torch.manual_seed(1)
    adv = torch.randn(4, 6) * 3 + 2
    mask = torch.rand(4, 6) > 0.4
    out = whiten(adv, mask)
    assert abs(float(out[mask].mean())) < 1e-5
    assert float(out[mask].std(correction=0)) == pytest.approx(1.0, rel=1e-4)
    assert not out[~mask].any()


def test_value_clipping_stops_a_value_moving_past_the_clip():
    old = torch.zeros(1, 3)
    target = torch.full((1, 3), 2.0)
    mask = torch.ones(1, 3, dtype=torch.bool)
    # Past the clip on the target's side: the clipped error is larger, and its gradient is zero.
    values = torch.tensor([[0.5, 0.1, 3.0]], requires_grad=True)
    loss, stats = value_loss(values, old, target, mask, clip=0.2)
    loss.backward()
    # token 0: moved 0.5 > clip towards the target -> clipped error (2 - 0.2)^2 larger, no gradient
    # token 1: inside the clip -> plain; token 2: past the target, plain error (1) < clipped (1.8^2)
    assert values.grad[0, 0] == 0
    assert values.grad[0, 1] == pytest.approx((0.1 - 2.0) / 3)
    assert float(stats["value_clip_fraction"]) == pytest.approx(2 / 3)
    plain, _ = value_loss(values.detach(), old, target, mask, clip=None)
    assert float(plain) == pytest.approx(0.5 * ((1.5**2) + (1.9**2) + 1.0) / 3)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 4), 2.5), returns, mask) == pytest.approx(0.0)
    assert explained_variance(-returns, returns, mask) < -1


def test_grpo_loss_takes_per_token_advantages():
    torch.manual_seed(2)
    lp = torch.randn(3, 5, requires_grad=True)
    behaviour = lp.detach() + 0.05 * torch.randn(3, 5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    per_seq = torch.tensor([0.5, -1.0, 2.0])
    a, _ = grpo_loss(lp, behaviour, behaviour, per_seq, mask, beta=0.0)
    b, _ = grpo_loss(lp, behaviour, behaviour, per_seq.unsqueeze(1).expand(3, 5).clone(), mask, beta=0.0)
    assert_close_to_scale(b, a, what="loss")
    per_token = torch.zeros(3, 5)
    per_token[0, 1] = 1.0  # one token's advantage: the gradient reaches that token alone
    loss, _ = grpo_loss(lp, behaviour, behaviour, per_token, mask, beta=0.0, loss_type="dapo")
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0, 1] != 0 and int((grad != 0).sum()) == 1
    with pytest.raises(ValueError, match="one per token"):
        grpo_loss(lp, behaviour, behaviour, torch.zeros(3, 4), mask)
