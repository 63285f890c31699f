"""GRPO: group-normalised advantages, a clipped importance-weighted surrogate and a KL penalty.

Everything here is a pure function of tensors so that the trainer actor, a notebook and a test
can all call the same code. Shapes: ``B`` sequences (episodes) in a batch, ``T`` response tokens
per sequence (right-padded, with ``mask`` marking the real ones), ``G`` completions in a group.

Why the importance ratio: rollouts run concurrently with training, so a completion was sampled
by a *behaviour* policy that may be a few weight versions behind the one being trained. The
ratio ``exp(logprobs - behaviour_logprobs)`` corrects for that, and PPO-style clipping keeps a
stale sample from pushing the policy too far.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """Advantages of one group's completions: reward minus the group mean, over the group std.

    The group mean is GRPO's baseline: it replaces a learned value function. Dividing by the
    std (``scale=True``, as in DeepSeekMath) makes every prompt's update the same size whatever
    its reward spread; ``scale=False`` keeps raw differences (Dr. GRPO / nanochat style).
    The std is the population std (no Bessel correction) so a group of one gives a zero
    advantage instead of NaN; a group whose rewards are all equal also gets zeros.

    rewards: [G] -> advantages: [G]
    """
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor [G] of one group, got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    centred = rewards - rewards.mean()  # [G]
    if not scale:
        return centred
    return centred / (rewards.std(correction=0) + eps)  # [G]


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(r) - r - 1`` with ``r = ref - lp``.

    Schulman's k3 estimator is unbiased for tokens sampled from the policy, always >= 0, and
    needs only the sampled token's logprob under each model (no full-vocabulary distributions).

    logprobs, ref_logprobs: [...] (same shape) -> kl: [...]
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape"
        )
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss of a batch of episodes, to minimise, and detached statistics for logging.

    Per token ``t`` of sequence ``b``::

        ratio  = exp(logprobs - behaviour_logprobs)
        pg     = -min(ratio * A_b, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A_b)
        kl     = k3_kl(logprobs, ref_logprobs)
        token  = pg + beta * kl

    Aggregation: the masked per-token mean within each sequence, then the mean over sequences
    (the original GRPO objective). Every sequence weighs the same whatever its length, so a long
    rambling completion does not dominate the update; sequences with no valid token are left
    out of the mean rather than counted as zero. The loss is 0 (with a graph) if no sequence has
    a valid token.

    ``clip_eps_high`` (DAPO's "clip higher") lets the ratio rise further than it may fall; it
    defaults to ``clip_eps``. ``beta=0`` drops the reference model from the gradient (its
    logprobs are still used for the logged KL).

    logprobs:           [B, T] current policy's logprob of each sampled token (with grad)
    behaviour_logprobs: [B, T] logprob under the policy that sampled it (no grad)
    ref_logprobs:       [B, T] logprob under the frozen reference model (no grad)
    advantages:         [B]    one advantage per sequence, e.g. from ``group_advantages``
    mask:               [B, T] 1 for response tokens, 0 for padding (bool or float)

    Returns ``(loss [], stats)`` with stats ``kl`` (masked token mean of k3 KL),
    ``clip_fraction`` (share of valid tokens whose gradient the clip zeroed), ``ratio_mean``,
    ``pg_loss`` and ``kl_loss`` (each term aggregated like the loss). No entropy is computed:
    that would need full-vocabulary logits, which the loss never sees.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    same_shape = {"behaviour_logprobs": behaviour_logprobs, "ref_logprobs": ref_logprobs, "mask": mask}
    for name, t in same_shape.items():
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logprobs.shape)} like logprobs")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected ({logprobs.shape[0]},): "
            "one advantage per sequence"
        )
    if clip_eps < 0 or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError(f"clip_eps ({clip_eps}) and clip_eps_high ({clip_eps_high}) must be >= 0")
    clip_high = clip_eps if clip_eps_high is None else clip_eps_high

    valid = mask.bool()  # [B, T]
    mask = valid.to(logprobs.dtype)  # [B, T]
    adv = advantages.to(logprobs.dtype).unsqueeze(1)  # [B, 1]
    # Padding may hold anything (-inf, NaN). Zero it in the inputs, not only in the output:
    # a NaN times a zero mask is still NaN, and so is a zero gradient through exp(inf).
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(valid, logprobs, zero)
    behaviour_logprobs = torch.where(valid, behaviour_logprobs.detach(), zero)
    ref_logprobs = torch.where(valid, ref_logprobs.detach(), zero)

    ratio = torch.exp(logprobs - behaviour_logprobs)  # [B, T]
    unclipped = ratio * adv  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_high) * adv  # [B, T]
    pg_per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    kl_per_token = k3_kl(logprobs, ref_logprobs)  # [B, T]

    tokens_per_seq = mask.sum(dim=1)  # [B]
    has_tokens = tokens_per_seq > 0  # [B]
    num_seqs = has_tokens.sum().clamp(min=1)  # []

    def seq_mean(per_token: Tensor) -> Tensor:
        per_seq = (per_token * mask).sum(dim=1) / tokens_per_seq.clamp(min=1)  # [B]
        return (per_seq * has_tokens).sum() / num_seqs  # []

    pg_loss = seq_mean(pg_per_token)
    kl_loss = seq_mean(kl_per_token)
    loss = pg_loss + beta * kl_loss

    with torch.no_grad():
        num_tokens = mask.sum().clamp(min=1)
        # Clipping zeroes the gradient where the ratio left the band in the direction the
        # advantage pushes it: above 1+eps with A > 0, below 1-eps with A < 0.
        clipped_tokens = ((ratio > 1.0 + clip_high) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
        stats = {
            "kl": (kl_per_token * mask).sum() / num_tokens,
            "clip_fraction": (clipped_tokens.to(mask.dtype) * mask).sum() / num_tokens,
            "ratio_mean": (ratio * mask).sum() / num_tokens,
            "pg_loss": pg_loss.detach(),
            "kl_loss": kl_loss.detach(),
        }
    return loss, stats
