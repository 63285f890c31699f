"""GRPO: group-normalised advantages, a clipped importance-weighted surrogate and a KL penalty.

Everything here is a pure function of tensors so that the trainer actor, a notebook and a test
can all call the same code. Shapes: ``B`` sequences (episodes) in a batch, ``T`` response tokens
per sequence (right-padded, with ``mask`` marking the real ones), ``G`` completions in a group.

Why the importance ratio: rollouts run concurrently with training, so a completion was sampled
by a *behaviour* policy that may be a few weight versions behind the one being trained. The
ratio ``exp(logprobs - behaviour_logprobs)`` corrects for that, and PPO-style clipping keeps a
stale sample from pushing the policy too far.

Why a mismatch correction: the behaviour logprobs come from vLLM (bf16 kernels on GPUs), the
trainer's from its own forward pass, so even on-policy tokens have a ratio that is not exactly
1. For a negative advantage the clipped surrogate does not bound the ratio from above, so one
token that vLLM found much less likely than the trainer does can dominate a step. Two opt-in
bounds: ``dual_clip`` (Ye et al. 2020, verl's ``clip_ratio_c``) caps that token's loss at
``dual_clip * |A|``; ``tis_cap`` (truncated importance sampling, as TRL's and verl's vLLM
correction) weights each token by ``min(exp(trainer - behaviour), tis_cap)``. The loss reports
``mismatch_max``/``mismatch_mean`` (``|trainer - behaviour|`` logprob) so drift is visible.

Why a choice of aggregation (``loss_type``): how per-token losses become one number decides how
much each token weighs. ``grpo`` (DeepSeekMath) averages within each sequence first, so a
token of a long completion weighs less than one of a short completion; ``dapo`` (Yu et al.
2025) averages over all the batch's tokens, so every token weighs the same; ``dr_grpo`` (Liu et
al. 2025, "Understanding R1-Zero-like training") divides the sum by a constant (sequences x the
generation limit), so no length enters the normaliser at all.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor

# verl's low_var_kl bounds: the log-ratio is clamped before exp() (so a -100 gives a finite
# value, not inf) and the per-token estimate after it.
KL_LOG_RATIO_BOUND = 20.0
KL_BOUND = 10.0

LOSS_NORMALISERS = {"grpo": "sequences", "dapo": "tokens", "dr_grpo": "rows"}
"""What each ``loss_type`` divides the summed token losses by (see ``grpo_loss``): the trained
sequences (after each sequence's own token mean), the trained tokens, or all rows times the
constant response length. ``aggregate_tokens`` computes it for one batch; a trainer that splits
a batch into micro-batches and ranks weights each part by its share of the same count."""
LOSS_TYPES = tuple(LOSS_NORMALISERS)
"""How ``grpo_loss`` aggregates per-token losses (see its docstring)."""


def check_loss_type(loss_type: str, max_response_tokens: int | None = None) -> None:
    """Refuse an unknown ``loss_type``, and ``dr_grpo`` without its constant length.

    Shared by the loss and the trainer's config so that both say the same thing, and the
    trainer fails when it is configured rather than at its first step.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if loss_type == "dr_grpo" and not (max_response_tokens is not None and max_response_tokens > 0):
        raise ValueError(
            f"loss_type 'dr_grpo' divides by a constant response length: max_response_tokens must be > 0 "
            f"(the sampler's max_tokens), got {max_response_tokens}"
        )


def rewards_uniform(rewards: Tensor) -> bool:
    """Whether one group's rewards are all exactly equal: then every advantage is exactly 0
    (``group_advantages``) and the group teaches nothing (what dynamic sampling drops)."""
    return bool((rewards == rewards[0]).all())


def group_advantages(rewards: Tensor, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """Advantages of one group's completions: reward minus the group mean, over the group std.

    The group mean is GRPO's baseline: it replaces a learned value function. Dividing by the
    std (``scale=True``, as in DeepSeekMath) makes every prompt's update the same size whatever
    its reward spread; ``scale=False`` keeps raw differences (Dr. GRPO / nanochat style).
    The std is the population std (no Bessel correction) so a group of one gives a zero
    advantage instead of NaN; a group whose rewards are all equal gets exact zeros.

    Computed in float64 and returned as float32: in float32 the mean of eight rewards of 0.3 is
    off by one rounding step, and that residue divided by a std of the same size (plus ``eps``)
    gave every completion an advantage of +0.029 where all should be 0.

    rewards: [G] -> advantages: [G] float32
    """
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor [G] of one group, got shape {tuple(rewards.shape)}")
    rewards = rewards.double()
    if rewards_uniform(rewards):
        return torch.zeros(rewards.shape, dtype=torch.float32, device=rewards.device)  # nothing to prefer
    centred = rewards - rewards.mean()  # [G]
    if scale:
        centred = centred / (rewards.std(correction=0) + eps)  # [G]
    return centred.float()


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(r) - r - 1`` with ``r = ref - lp``.

    Schulman's k3 estimator is unbiased for tokens sampled from the policy, always >= 0, and
    needs only the sampled token's logprob under each model (no full-vocabulary distributions).
    Clamped as verl's ``low_var_kl``: ``r`` to +-``KL_LOG_RATIO_BOUND`` and the estimate to at
    most ``KL_BOUND``, so a token the reference finds impossible (``r = -100``) costs a bounded
    amount instead of inf (and inf * 0 = NaN in a masked sum).

    logprobs, ref_logprobs: [...] (same shape) -> kl: [...]
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape"
        )
    log_ratio = torch.clamp(ref_logprobs - logprobs, -KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, max=KL_BOUND)


def trainable_lengths(
    response_ids: Tensor,
    response_lens: Sequence[int] | Tensor,
    finish_reasons: Sequence[str],
    *,
    stop_token_ids: Collection[int] = (),
    mask_truncated: bool = False,
) -> list[int]:
    """How many leading tokens of each response the loss trains on.

    A response is trained up to and including its first stop token (``stop_token_ids``):
    whatever a sampler wrote after it (a base model's made-up next turn past ``<|im_end|>``)
    is not the answer and must not be trained. With ``mask_truncated``, a response cut at the
    length limit (``finish_reason == "length"``) trains nothing: its reward judged an unfinished
    answer, so its advantage says nothing about how the model should end.

    response_ids: [sum T] the responses one after another; response_lens: B lengths;
    finish_reasons: B strings -> B lengths (0 <= n_b <= T_b)
    """
    lens = torch.as_tensor(response_lens, dtype=torch.long)
    if lens.numel() != len(finish_reasons):
        raise ValueError(
            f"response_lens and finish_reasons must have one entry per response, "
            f"got {lens.numel()} and {len(finish_reasons)}"
        )
    if int(lens.sum()) != response_ids.numel():
        raise ValueError(
            f"response_lens add up to {int(lens.sum())} tokens, but response_ids has {response_ids.numel()}"
        )
    keep = lens.clone()
    stops = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)
    if stops.numel() and response_ids.numel():
        row = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        position = torch.arange(response_ids.numel()) - (lens.cumsum(0) - lens)[row]
        hit = torch.isin(response_ids.long(), stops)
        first = torch.full_like(lens, response_ids.numel())
        first.scatter_reduce_(0, row[hit], position[hit], reduce="amin")
        keep = torch.minimum(keep, first + 1)  # keep the stop token itself: the model must learn to stop
    if mask_truncated:
        keep[torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)] = 0
    return keep.tolist()


def grpo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    beta: float = 0.04,
    dual_clip: float | None = None,
    tis_cap: float | None = None,
    loss_type: str = "grpo",
    max_response_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss of a batch of episodes, to minimise, and detached statistics for logging.

    Per token ``t`` of sequence ``b``::

        ratio  = exp(logprobs - behaviour_logprobs)
        pg     = -min(ratio * A_b, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A_b)
        kl     = k3_kl(logprobs, ref_logprobs)
        token  = pg + beta * kl            (no KL term at all when beta == 0)

    Aggregation of the valid (masked-in) tokens, by ``loss_type``:

    - ``grpo`` (default): the per-token mean within each sequence, then the mean over sequences
      (the original GRPO objective). Every sequence weighs the same whatever its length, so a
      long rambling completion does not dominate the update; sequences with no valid token are
      left out of the mean rather than counted as zero.
    - ``dapo``: the sum over every valid token of the batch divided by their number (DAPO's
      token-level loss). Every token weighs the same, so a long completion weighs more than a
      short one, and a long wrong answer is penalised token by token.
    - ``dr_grpo``: the sum over every valid token divided by ``B * max_response_tokens``, a
      constant (Dr. GRPO): no length in the normaliser, so a short correct answer and a long
      wrong one are not rescaled by their lengths. ``B`` counts every row, trained or not.

    The KL term and the stats ``pg_loss``/``kl_loss`` are aggregated the same way as the policy
    term, so ``loss == pg_loss + beta * kl_loss`` whatever the ``loss_type``. The loss is 0
    (with a graph) if no token is valid.

    ``clip_eps_high`` (DAPO's "clip higher") lets the ratio rise further than it may fall; it
    defaults to ``clip_eps``. ``beta=0`` drops the reference model from the gradient and the
    loss (its logprobs are still used for the logged KL).

    Mismatch corrections (module docstring), both off by default:

    - ``dual_clip`` (> 1): for ``A < 0``, ``pg = min(pg, -dual_clip * A)``: the ratio's pull is
      capped at ``dual_clip`` times the advantage, as verl's ``clip_ratio_c``.
    - ``tis_cap`` (> 0): truncated importance sampling as TRL's and verl's vLLM correction. The
      PPO ratio is taken against the trainer's own detached logprobs (``exp(lp - sg(lp))``, value
      1: one optimizer step per batch), and each token's loss is multiplied by the detached
      weight ``min(exp(lp - behaviour_logprobs), tis_cap)``. Staleness and kernel mismatch are
      both folded into that bounded weight.

    logprobs:           [B, T] current policy's logprob of each sampled token (with grad)
    behaviour_logprobs: [B, T] logprob under the policy that sampled it (no grad)
    ref_logprobs:       [B, T] logprob under the frozen reference model (no grad)
    advantages:         [B]    one advantage per sequence, e.g. from ``group_advantages``; or
                        [B, T] one per token (PPO's, ``forge.losses.ppo.gae``)
    mask:               [B, T] 1 for response tokens, 0 for padding (bool or float)

    Returns ``(loss [], stats)`` with stats ``kl`` (masked token mean of k3 KL),
    ``clip_fraction`` (share of valid tokens whose gradient the clip zeroed), ``ratio_mean``
    (of ``exp(lp - behaviour)``), ``mismatch_max`` and ``mismatch_mean`` (of ``|lp - behaviour|``
    over valid tokens: the drift between sampler and trainer), ``pg_loss`` and ``kl_loss`` (each
    term aggregated like the loss, by ``loss_type``). ``kl``, ``clip_fraction``, ``ratio_mean``
    and ``mismatch_mean`` are token means whatever the ``loss_type``: they describe the tokens,
    not the objective. No entropy is computed:
    that would need full-vocabulary logits, which the loss never sees.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    same_shape = {"behaviour_logprobs": behaviour_logprobs, "ref_logprobs": ref_logprobs, "mask": mask}
    for name, t in same_shape.items():
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logprobs.shape)} like logprobs")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected ({logprobs.shape[0]},): "
            f"one advantage per sequence, or {tuple(logprobs.shape)}: one per token (PPO's, forge.losses.ppo)"
        )
    if clip_eps < 0 or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError(f"clip_eps ({clip_eps}) and clip_eps_high ({clip_eps_high}) must be >= 0")
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None to disable it), got {dual_clip}")
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0 (or None to disable it), got {tis_cap}")
    check_loss_type(loss_type, max_response_tokens)

    valid = mask.bool()  # [B, T]
    mask = valid.to(logprobs.dtype)  # [B, T]
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else torch.where(valid, adv, torch.zeros((), dtype=adv.dtype))  # [B, 1|T]
    # Padding may hold anything (-inf, NaN). Zero it in the inputs, not only in the output:
    # a NaN times a zero mask is still NaN, and so is a zero gradient through exp(inf).
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(valid, logprobs, zero)
    behaviour_logprobs = torch.where(valid, behaviour_logprobs.detach(), zero)
    ref_logprobs = torch.where(valid, ref_logprobs.detach(), zero)

    log_mismatch = logprobs.detach() - behaviour_logprobs  # [B, T]
    behaviour_ratio = torch.exp(log_mismatch)  # [B, T], no grad: for the stats and TIS
    if tis_cap is None:
        ratio = torch.exp(logprobs - behaviour_logprobs)  # [B, T]
    else:
        ratio = torch.exp(logprobs - logprobs.detach())  # [B, T], value 1, gradient of lp
    unclipped = ratio * adv  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_high) * adv  # [B, T]
    pg_per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    if dual_clip is not None:
        # Only negative advantages: there -ratio * A grows without bound in the ratio.
        pg_per_token = torch.where(adv < 0, torch.minimum(pg_per_token, -dual_clip * adv), pg_per_token)
    if tis_cap is not None:
        pg_per_token = pg_per_token * torch.clamp(behaviour_ratio, max=tis_cap)  # [B, T]
    kl_per_token = k3_kl(logprobs, ref_logprobs)  # [B, T]

    pg_loss = aggregate_tokens(pg_per_token, mask, loss_type, max_response_tokens)
    kl_loss = aggregate_tokens(kl_per_token, mask, loss_type, max_response_tokens)
    # beta == 0 leaves the KL out of the graph entirely: 0 * (a non-finite KL) would be NaN.
    loss = pg_loss + beta * kl_loss if beta != 0 else pg_loss

    with torch.no_grad():
        num_tokens = mask.sum().clamp(min=1)
        # Clipping zeroes the gradient where the ratio left the band in the direction the
        # advantage pushes it: above 1+eps with A > 0, below 1-eps with A < 0.
        clipped_tokens = ((ratio > 1.0 + clip_high) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
        stats = {
            "kl": (kl_per_token * mask).sum() / num_tokens,
            "clip_fraction": (clipped_tokens.to(mask.dtype) * mask).sum() / num_tokens,
            "ratio_mean": (behaviour_ratio * mask).sum() / num_tokens,
            "mismatch_max": torch.where(valid, log_mismatch.abs(), zero).max() if valid.any() else zero,
            "mismatch_mean": (log_mismatch.abs() * mask).sum() / num_tokens,
            "pg_loss": pg_loss.detach(),
            "kl_loss": kl_loss.detach(),
        }
    return loss, stats


def aggregate_tokens(per_token: Tensor, mask: Tensor, loss_type: str, max_response_tokens: int | None = None) -> Tensor:
    """One number from per-token values, as ``grpo_loss``'s ``loss_type`` says (its docstring).

    The policy term and the KL term both go through here, so they can never be normalised
    differently. ``per_token`` must be finite where ``mask`` is 0 (it is multiplied by the mask).

    per_token: [B, T]; mask: [B, T] float (1 valid, 0 padding) -> []
    """
    check_loss_type(loss_type, max_response_tokens)
    masked_sum = (per_token * mask).sum()  # []
    normaliser = LOSS_NORMALISERS[loss_type]
    if normaliser == "tokens":
        return masked_sum / mask.sum().clamp(min=1)
    if normaliser == "rows":
        return masked_sum / (max(per_token.shape[0], 1) * max_response_tokens)
    tokens_per_seq = mask.sum(dim=1)  # [B]
    has_tokens = tokens_per_seq > 0  # [B]
    per_seq = (per_token * mask).sum(dim=1) / tokens_per_seq.clamp(min=1)  # [B]
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)  # []
