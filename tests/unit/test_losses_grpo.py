"""GRPO loss: hand-computed values, the on-policy gradient, clipping, masking and the KL term."""

import math

import pytest
import torch

from forge.losses import group_advantages, grpo_loss, k3_kl, trainable_lengths

# ---------------------------------------------------------------------------------------------
# group_advantages


def test_group_advantages_centre_and_scale_by_population_std():
    """[1, 0, 0, 1]: mean 0.5, population std 0.5, so advantages are [1, -1, -1, 1]."""
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]))


def test_group_advantages_without_scale_only_subtracts_the_mean():
    """scale=False keeps raw differences from the group mean."""
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), scale=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("rewards", [[0.3, 0.3, 0.3], [0.7]])
def test_group_advantages_are_zero_when_rewards_do_not_vary(rewards):
    """Equal rewards (or a group of one) give zero advantages, never NaN."""
    adv = group_advantages(torch.tensor(rewards))
    torch.testing.assert_close(adv, torch.zeros(len(rewards)))


@pytest.mark.parametrize("value", [0.3, 0.1, 0.7, 1 / 3])
def test_group_advantages_of_equal_non_dyadic_rewards_are_exactly_zero(value):
    """Eight rewards of 0.3 (not exact in binary) give exact zeros, not float32 residue / (std + eps)."""
    adv = group_advantages(torch.full((8,), value, dtype=torch.float32))
    assert torch.equal(adv, torch.zeros(8))
    assert adv.dtype == torch.float32


def test_group_advantages_of_equal_float64_rewards_are_exactly_zero():
    """62 float64 rewards of 0.9, whose float64 mean is off by a rounding step, give exact zeros:
    all-equal rewards are caught before the mean, not left to the arithmetic."""
    rewards = torch.full((62,), 0.9, dtype=torch.float64)
    assert bool((rewards - rewards.mean() != 0).any())  # the residue the early return avoids
    assert torch.equal(group_advantages(rewards), torch.zeros(62))


def test_group_advantages_have_no_float32_drift_in_a_varied_group():
    """0.3 x 7 and one 0.4: the float64 result, rounded once to float32."""
    rewards = [0.3] * 7 + [0.4]
    mean = sum(rewards) / 8
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 8)
    expected = torch.tensor([(r - mean) / (std + 1e-6) for r in rewards], dtype=torch.float32)
    assert torch.equal(group_advantages(torch.tensor(rewards)), expected)


def test_group_advantages_reject_a_batch_of_groups():
    """A 2-D tensor is refused with its shape in the message."""
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        group_advantages(torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------------
# k3_kl


def test_k3_kl_is_zero_when_policy_equals_reference():
    """lp == ref gives exactly zero KL per token."""
    lp = torch.tensor([[-0.1, -2.0, -7.5]])
    assert torch.equal(k3_kl(lp, lp.clone()), torch.zeros_like(lp))


def test_k3_kl_matches_formula_and_is_non_negative():
    """exp(r) - r - 1 with r = ref - lp, >= 0 for any sign of r."""
    lp = torch.tensor([-1.0, -1.0, -1.0])
    ref = torch.tensor([-1.5, -0.5, -3.0])
    r = ref - lp
    expected = torch.tensor([math.exp(x) - x - 1 for x in r.tolist()])
    kl = k3_kl(lp, ref)
    torch.testing.assert_close(kl, expected)
    assert (kl >= 0).all()


def test_k3_kl_is_finite_for_an_extreme_log_ratio():
    """ref - lp = -100 (or +100) gives a finite KL, bounded as verl's low_var_kl, not inf."""
    lp = torch.tensor([-0.1, -100.1])
    ref = torch.tensor([-100.1, -0.1])
    kl = k3_kl(lp, ref)
    assert torch.isfinite(kl).all()
    assert (kl <= 10.0).all() and (kl >= 0).all()


def test_grpo_loss_is_finite_when_beta_is_zero_and_the_kl_is_not():
    """beta == 0 leaves the KL out of the loss: a NaN reference logprob cannot make it NaN (0 * NaN)."""
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[float("nan"), -2.0]])
    loss, stats = grpo_loss(lp, lp.detach(), ref, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert loss.item() == pytest.approx(-1.0)


# ---------------------------------------------------------------------------------------------
# grpo_loss: a 2x3 batch computed by hand


def _hand_batch():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.0]])
    # lp - behaviour: row 0 = [0, +0.2, 0], row 1 = [0, -0.3, (masked)]
    behaviour = torch.tensor([[-1.0, -2.2, -0.5], [-0.3, -0.9, -5.0]])
    # ref - lp: row 0 = [0, 0, -0.5], row 1 = [0, +0.5, (masked)]
    ref = torch.tensor([[-1.0, -2.0, -1.0], [-0.3, -0.7, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return lp, behaviour, ref, adv, mask


def test_grpo_loss_matches_hand_computation_on_2x3_batch():
    """Every term of the loss and its stats, written out token by token (clip_eps 0.2, beta 0.04)."""
    lp, behaviour, ref, adv, mask = _hand_batch()
    loss, stats = grpo_loss(lp, behaviour, ref, adv, mask, clip_eps=0.2, beta=0.04)

    # Row 0, A = +1. Ratios: 1, e^0.2 = 1.2214 (above 1.2: clipped to 1.2), 1.
    #   pg tokens = -min(r*A, clip(r)*A) = [-1, -1.2, -1]      -> row mean -3.2/3
    #   kl tokens = exp(d) - d - 1, d = ref - lp = [0, 0, -0.5] -> [0, 0, e^-0.5 - 0.5]
    row0_pg = (-1.0 - 1.2 - 1.0) / 3
    kl_02 = math.exp(-0.5) + 0.5 - 1
    row0_kl = kl_02 / 3
    # Row 1, A = -2. Ratios: 1, e^-0.3 = 0.7408 (below 0.8 with A < 0: clipped to 0.8); token 2 masked.
    #   pg tokens = -min(r*A, clip(r)*A) = [-(-2), -min(-1.4816, -1.6)] = [2, 1.6] -> row mean 1.8
    #   kl tokens: d = [0, 0.5] -> [0, e^0.5 - 0.5 - 1]
    row1_pg = (2.0 + 1.6) / 2
    kl_11 = math.exp(0.5) - 0.5 - 1
    row1_kl = kl_11 / 2
    # Mean over the two sequences.
    pg_loss = (row0_pg + row1_pg) / 2
    kl_loss = (row0_kl + row1_kl) / 2
    expected_loss = pg_loss + 0.04 * kl_loss

    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert stats["pg_loss"].item() == pytest.approx(pg_loss, abs=1e-6)
    assert stats["kl_loss"].item() == pytest.approx(kl_loss, abs=1e-6)
    # Token-level stats over the 5 valid tokens.
    assert stats["kl"].item() == pytest.approx((kl_02 + kl_11) / 5, abs=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)
    ratio_sum = 1 + math.exp(0.2) + 1 + 1 + math.exp(-0.3)
    assert stats["ratio_mean"].item() == pytest.approx(ratio_sum / 5, abs=1e-6)


def test_grpo_loss_stats_are_detached():
    """Stats are for logging: none of them carries a graph."""
    lp, behaviour, ref, adv, mask = _hand_batch()
    lp.requires_grad_(True)
    loss, stats = grpo_loss(lp, behaviour, ref, adv, mask)
    assert loss.requires_grad
    assert all(not v.requires_grad for v in stats.values())


def test_on_policy_gradient_equals_plain_policy_gradient():
    """With behaviour == current logprobs (ratio 1) and beta 0, d loss / d lp is -A * mask / (n_b * B)."""
    torch.manual_seed(0)
    lp = (-torch.rand(4, 5) * 3).requires_grad_(True)
    adv = torch.tensor([1.5, -0.5, 0.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    loss, _ = grpo_loss(lp, lp.detach(), lp.detach(), adv, mask, beta=0.0)
    loss.backward()

    plain_lp = lp.detach().clone().requires_grad_(True)
    n = mask.sum(1, keepdim=True)
    plain = (-(adv[:, None] * plain_lp * mask) / n).sum(1).mean()  # REINFORCE, per-sequence mean
    plain.backward()

    torch.testing.assert_close(lp.grad, plain_lp.grad)
    torch.testing.assert_close(lp.grad, -adv[:, None] * mask / n / 4)


@pytest.mark.parametrize(
    "log_ratio, adv, clipped",
    [
        (math.log(1.5), 1.0, True),  # ratio 1.5 > 1.2 pushing up: clipped
        (math.log(1.1), 1.0, False),  # inside the band
        (math.log(0.5), -1.0, True),  # ratio 0.5 < 0.8 pushing down: clipped
        (math.log(1.5), -1.0, False),  # outside the band but the advantage pulls it back
    ],
)
def test_clipping_zeroes_gradient_only_beyond_clip_eps(log_ratio, adv, clipped):
    """The gradient vanishes exactly where the ratio left [1-eps, 1+eps] in the advantage's direction."""
    lp = torch.tensor([[-1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0 - log_ratio]])
    loss, stats = grpo_loss(lp, behaviour, lp.detach(), torch.tensor([adv]), torch.ones(1, 1), beta=0.0)
    loss.backward()
    assert (lp.grad.abs().item() == 0.0) == clipped
    assert stats["clip_fraction"].item() == (1.0 if clipped else 0.0)
    if clipped:
        bound = 1.2 if adv > 0 else 0.8
        assert loss.item() == pytest.approx(-bound * adv)


def test_clip_eps_high_widens_only_the_upper_bound():
    """With clip_eps_high=0.28 a ratio of 1.25 (A > 0) is no longer clipped; 0.75 (A < 0) still is."""
    lp = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    behaviour = lp.detach() - torch.tensor([[math.log(1.25)], [math.log(0.75)]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(lp, behaviour, lp.detach(), adv, torch.ones(2, 1), clip_eps_high=0.28, beta=0.0)
    loss.backward()
    assert lp.grad[0, 0].item() != 0.0
    assert lp.grad[1, 0].item() == 0.0
    assert stats["clip_fraction"].item() == pytest.approx(0.5)


def test_masked_tokens_do_not_contribute_even_if_nan_or_inf():
    """Changing padded positions (to NaN, inf) changes neither the loss nor the valid gradients."""
    lp, behaviour, ref, adv, mask = _hand_batch()
    lp = lp.clone().requires_grad_(True)
    loss, stats = grpo_loss(lp, behaviour, ref, adv, mask)
    loss.backward()

    lp2 = lp.detach().clone()
    lp2[1, 2] = float("nan")
    lp2.requires_grad_(True)
    behaviour2, ref2 = behaviour.clone(), ref.clone()
    behaviour2[1, 2] = float("-inf")
    ref2[1, 2] = float("inf")
    loss2, stats2 = grpo_loss(lp2, behaviour2, ref2, adv, mask)
    loss2.backward()

    assert loss2.item() == pytest.approx(loss.item())
    torch.testing.assert_close(lp2.grad, lp.grad)
    assert lp2.grad[1, 2].item() == 0.0
    for k in stats:
        assert stats2[k].item() == pytest.approx(stats[k].item())


def test_each_sequence_weighs_the_same_whatever_its_length():
    """Per-sequence mean then mean over sequences: a 1-token and a 3-token sequence count equally."""
    lp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, 1.0])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    # On-policy, ratio 1: every valid token contributes -A = -1, so each sequence's mean is -1.
    loss, _ = grpo_loss(lp, lp, lp, adv, mask, beta=0.0)
    assert loss.item() == pytest.approx(-1.0)


def test_fully_masked_sequences_are_left_out_of_the_mean():
    """A sequence with no valid token neither adds nor dilutes; an all-masked batch gives 0."""
    lp = torch.zeros(2, 2)
    adv = torch.tensor([2.0, 5.0])
    loss, _ = grpo_loss(lp, lp, lp, adv, torch.tensor([[1, 1], [0, 0]]), beta=0.0)
    assert loss.item() == pytest.approx(-2.0)
    empty, _ = grpo_loss(lp, lp, lp, adv, torch.zeros(2, 2), beta=0.0)
    assert empty.item() == 0.0


def test_kl_term_is_zero_when_policy_equals_reference():
    """ref == lp: kl stat and kl_loss are 0, so beta does not change the loss."""
    lp, behaviour, _, adv, mask = _hand_batch()
    with_kl, stats = grpo_loss(lp, behaviour, lp.clone(), adv, mask, beta=0.5)
    without_kl, _ = grpo_loss(lp, behaviour, lp.clone(), adv, mask, beta=0.0)
    assert stats["kl"].item() == 0.0
    assert stats["kl_loss"].item() == 0.0
    assert with_kl.item() == without_kl.item()


def test_kl_gradient_pulls_policy_towards_reference():
    """With zero advantages only beta * KL remains; a gradient step moves lp towards ref."""
    lp = torch.tensor([[-2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]])
    loss, _ = grpo_loss(lp, lp.detach(), ref, torch.zeros(1), torch.ones(1, 2), beta=1.0)
    loss.backward()
    stepped = lp.detach() - 0.1 * lp.grad
    assert ((stepped - ref).abs() < (lp.detach() - ref).abs()).all()


@pytest.mark.parametrize("bad", ["behaviour_logprobs", "ref_logprobs", "mask", "advantages"])
def test_grpo_loss_rejects_mismatched_shapes_naming_the_argument(bad):
    """A wrong-shaped input is a ValueError that names which argument is wrong."""
    args = dict(
        logprobs=torch.zeros(2, 3),
        behaviour_logprobs=torch.zeros(2, 3),
        ref_logprobs=torch.zeros(2, 3),
        advantages=torch.zeros(2),
        mask=torch.ones(2, 3),
    )
    args[bad] = torch.zeros(3, 3) if bad != "advantages" else torch.zeros(3)
    with pytest.raises(ValueError, match=bad):
        grpo_loss(**args)


# ---------------------------------------------------------------------------------------------
# loss_type: how per-token losses become one number

# _hand_batch's per-token terms (clip_eps 0.2), written out in test_grpo_loss_matches_hand_computation_on_2x3_batch:
# row 0 (3 valid tokens) and row 1 (2 valid tokens, one masked).
_HAND_PG = [[-1.0, -1.2, -1.0], [2.0, 1.6]]
_HAND_KL = [[0.0, 0.0, math.exp(-0.5) + 0.5 - 1], [0.0, math.exp(0.5) - 0.5 - 1]]


def _hand_loss(loss_type: str, **kwargs):
    lp, behaviour, ref, adv, mask = _hand_batch()
    return grpo_loss(lp, behaviour, ref, adv, mask, clip_eps=0.2, beta=0.04, loss_type=loss_type, **kwargs)


def test_dapo_is_the_mean_over_every_valid_token_of_the_batch():
    """dapo: (sum of the 5 valid tokens' terms) / 5, for the policy term, the KL term and the loss."""
    pg = sum(sum(row) for row in _HAND_PG) / 5  # (-3.2 + 3.6) / 5
    kl = sum(sum(row) for row in _HAND_KL) / 5
    loss, stats = _hand_loss("dapo")
    assert stats["pg_loss"].item() == pytest.approx(pg, abs=1e-6)
    assert stats["kl_loss"].item() == pytest.approx(kl, abs=1e-6)
    assert loss.item() == pytest.approx(pg + 0.04 * kl, abs=1e-6)


def test_dr_grpo_is_the_token_sum_over_sequences_times_a_constant_length():
    """dr_grpo with max_response_tokens 4: (sum of the valid tokens' terms) / (2 sequences x 4)."""
    pg = sum(sum(row) for row in _HAND_PG) / (2 * 4)
    kl = sum(sum(row) for row in _HAND_KL) / (2 * 4)
    loss, stats = _hand_loss("dr_grpo", max_response_tokens=4)
    assert stats["pg_loss"].item() == pytest.approx(pg, abs=1e-6)
    assert stats["kl_loss"].item() == pytest.approx(kl, abs=1e-6)
    assert loss.item() == pytest.approx(pg + 0.04 * kl, abs=1e-6)


def test_grpo_loss_type_is_the_default_seq_mean_of_token_means():
    """loss_type='grpo' is today's loss bit for bit: the mean of the row means."""
    pg = sum(sum(row) / len(row) for row in _HAND_PG) / 2
    default, default_stats = _hand_loss("grpo")
    lp, behaviour, ref, adv, mask = _hand_batch()
    implicit, implicit_stats = grpo_loss(lp, behaviour, ref, adv, mask, clip_eps=0.2, beta=0.04)
    assert default_stats["pg_loss"].item() == pytest.approx(pg, abs=1e-6)
    assert torch.equal(default, implicit)
    assert all(torch.equal(default_stats[k], implicit_stats[k]) for k in implicit_stats)


def test_the_three_loss_types_differ_on_a_ragged_batch_and_share_the_token_stats():
    """Rows of 3 and 2 valid tokens: three different losses; kl, clip_fraction and the ratio
    stats describe the tokens, so they do not depend on the loss_type."""
    losses = {t: _hand_loss(t, max_response_tokens=4) for t in ("grpo", "dapo", "dr_grpo")}
    values = [loss.item() for loss, _ in losses.values()]
    assert all(abs(a - b) > 1e-3 for i, a in enumerate(values) for b in values[i + 1 :]), values
    token_stats = ("kl", "clip_fraction", "ratio_mean", "mismatch_mean", "mismatch_max")
    for name in token_stats:
        assert len({stats[name].item() for _, stats in losses.values()}) == 1, name


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        # d loss / d lp of a valid on-policy token is -A times that token's weight.
        ("grpo", [[1 / 2, 0, 0, 0], [1 / 8, 1 / 8, 1 / 8, 1 / 8]]),  # 1 / (sequences x its length)
        ("dapo", [[1 / 5, 0, 0, 0], [1 / 5, 1 / 5, 1 / 5, 1 / 5]]),  # 1 / all tokens
        ("dr_grpo", [[1 / 12, 0, 0, 0], [1 / 12, 1 / 12, 1 / 12, 1 / 12]]),  # 1 / (2 sequences x 6)
    ],
)
def test_each_loss_type_weighs_a_token_as_its_normaliser_says(loss_type, expected):
    """A 1-token and a 4-token sequence, A = -1, on-policy: grpo gives the short one's token 4x
    the weight of each long one's; dapo and dr_grpo weigh every token the same."""
    lp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    loss, _ = grpo_loss(
        lp,
        lp.detach(),
        lp.detach(),
        torch.tensor([-1.0, -1.0]),
        mask,
        beta=0.0,
        loss_type=loss_type,
        max_response_tokens=6,
    )
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor(expected))


def test_dr_grpo_counts_every_row_and_dapo_an_all_masked_batch_is_zero():
    """dr_grpo's normaliser is a constant: a fully masked row still counts in B; with no valid
    token, dapo's and dr_grpo's loss is 0 (not NaN)."""
    lp = torch.zeros(2, 2)
    adv = torch.tensor([2.0, 5.0])
    half, _ = grpo_loss(
        lp, lp, lp, adv, torch.tensor([[1, 1], [0, 0]]), beta=0.0, loss_type="dr_grpo", max_response_tokens=2
    )
    assert half.item() == pytest.approx(-2.0 * 2 / (2 * 2))
    for loss_type in ("dapo", "dr_grpo"):
        empty, _ = grpo_loss(lp, lp, lp, adv, torch.zeros(2, 2), beta=0.0, loss_type=loss_type, max_response_tokens=2)
        assert empty.item() == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_type": "bogus"}, r"loss_type must be one of grpo, dapo, dr_grpo, got 'bogus'"),
        ({"loss_type": "DAPO"}, r"got 'DAPO'"),
        ({"loss_type": "dr_grpo"}, r"max_response_tokens must be > 0 .*got None"),
        ({"loss_type": "dr_grpo", "max_response_tokens": 0}, r"max_response_tokens must be > 0 .*got 0"),
    ],
)
def test_grpo_loss_rejects_an_unknown_loss_type_and_dr_grpo_without_a_length(kwargs, message):
    """A ValueError naming the bad value and the three allowed ones (or dr_grpo's missing length)."""
    with pytest.raises(ValueError, match=message):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), **kwargs)


# ---------------------------------------------------------------------------------------------
# mismatch corrections and the logged mismatch


def _mismatched_negative_token():
    """One token vLLM found e^-20 as likely as the trainer does, with a negative advantage."""
    lp = torch.tensor([[-1.0]], requires_grad=True)
    behaviour = torch.tensor([[-21.0]])  # ratio e^20
    return lp, behaviour, torch.tensor([-1.0])


def test_without_a_correction_one_mismatched_token_dominates_the_loss():
    """The unbounded case both corrections exist for: loss ~ ratio * |A| = e^20."""
    lp, behaviour, adv = _mismatched_negative_token()
    loss, stats = grpo_loss(lp, behaviour, lp.detach(), adv, torch.ones(1, 1), beta=0.0)
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-4)
    assert stats["mismatch_max"].item() == pytest.approx(20.0)


def test_dual_clip_caps_a_negative_advantage_tokens_loss_and_gradient():
    """dual_clip=3: the token's loss is 3 * |A| and its gradient is zero (verl's clip_ratio_c)."""
    lp, behaviour, adv = _mismatched_negative_token()
    loss, _ = grpo_loss(lp, behaviour, lp.detach(), adv, torch.ones(1, 1), beta=0.0, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.0)
    assert lp.grad.item() == 0.0


def test_dual_clip_leaves_positive_advantages_and_small_ratios_alone():
    """A > 0, or a ratio below dual_clip: the same loss and gradient as without it."""
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    behaviour = lp.detach() - torch.tensor([[math.log(2.0), math.log(1.1)]])
    for adv in (torch.tensor([1.0]), torch.tensor([-1.0])):
        grads = []
        for dual in (None, 3.0):
            lp.grad = None
            loss, _ = grpo_loss(lp, behaviour, lp.detach(), adv, torch.ones(1, 2), beta=0.0, dual_clip=dual)
            loss.backward()
            grads.append((loss.item(), lp.grad.clone()))
        assert grads[0][0] == pytest.approx(grads[1][0])
        torch.testing.assert_close(grads[0][1], grads[1][1])


def test_tis_bounds_a_mismatched_tokens_weight_by_the_cap():
    """tis_cap=2: the token's gradient is -A * 2 / n (weight min(e^20, 2)), not -A * e^20."""
    lp, behaviour, adv = _mismatched_negative_token()
    loss, stats = grpo_loss(lp, behaviour, lp.detach(), adv, torch.ones(1, 1), beta=0.0, tis_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(2.0)  # -A * ratio(1) * weight(2)
    assert lp.grad.item() == pytest.approx(2.0)
    assert stats["ratio_mean"].item() == pytest.approx(math.exp(20), rel=1e-4)  # still logged as is


def test_tis_weights_each_token_by_its_own_clamped_ratio():
    """Ratios 0.5 and 1.5 under cap 2: gradients are -A * w_t / n with w = [0.5, 1.5]."""
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    behaviour = lp.detach() - torch.tensor([[math.log(0.5), math.log(1.5)]])
    loss, _ = grpo_loss(lp, behaviour, lp.detach(), torch.tensor([1.0]), torch.ones(1, 2), beta=0.0, tis_cap=2.0)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -0.75]]))


def test_mismatch_stats_are_the_max_and_mean_absolute_logprob_gap_over_valid_tokens():
    """|lp - behaviour| = [0, 0.2, 0] and [0, 0.3, (masked 4.5)]: max 0.3, mean 0.1."""
    lp, behaviour, ref, adv, mask = _hand_batch()
    _, stats = grpo_loss(lp, behaviour, ref, adv, mask)
    assert stats["mismatch_max"].item() == pytest.approx(0.3, abs=1e-6)
    assert stats["mismatch_mean"].item() == pytest.approx(0.5 / 5, abs=1e-6)


@pytest.mark.parametrize("kwargs, message", [({"dual_clip": 1.0}, "dual_clip"), ({"tis_cap": 0.0}, "tis_cap")])
def test_corrections_reject_bounds_that_bound_nothing(kwargs, message):
    """dual_clip <= 1 or tis_cap <= 0 is a ValueError naming the argument."""
    with pytest.raises(ValueError, match=message):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), **kwargs)


# ---------------------------------------------------------------------------------------------
# trainable_lengths: stops and truncation


def test_trainable_lengths_end_at_the_first_stop_token_inclusive():
    """[5, 9, 7, 9] with stop 9 trains 2 tokens; a response without a stop trains all of it."""
    ids = torch.tensor([5, 9, 7, 9, 5, 6, 7])
    assert trainable_lengths(ids, [4, 3], ["stop", "length"], stop_token_ids=[9]) == [2, 3]


def test_trainable_lengths_leave_truncated_responses_out_with_mask_truncated():
    """finish_reason 'length' trains 0 tokens with mask_truncated, all of them without."""
    ids = torch.tensor([5, 6, 5, 6, 7])
    assert trainable_lengths(ids, [2, 3], ["stop", "length"], mask_truncated=True) == [2, 0]
    assert trainable_lengths(ids, [2, 3], ["stop", "length"], mask_truncated=False) == [2, 3]


def test_trainable_lengths_need_one_finish_reason_per_response():
    """A length mismatch names both counts."""
    with pytest.raises(ValueError, match="got 2 and 1"):
        trainable_lengths(torch.tensor([1, 2]), [1, 1], ["stop"])
