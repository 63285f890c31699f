"""PPO with a learned critic: per-token advantages by GAE, the critic's clipped value loss, and
how well the critic explains the returns.

GRPO's baseline is the group's mean reward, one advantage per sequence. PPO's is a value
function ``V(s_t)``, a model's estimate of the reward still to come after each token, so every
token gets its own advantage: generalised advantage estimation (Schulman et al. 2016) over the
response's tokens, with the episode's reward on its last trained token. The policy term is the
same clipped surrogate as GRPO's (``forge.losses.grpo_loss`` takes ``[B, T]`` advantages).

Pure tensor functions, as in ``forge.losses.grpo``. Shapes: ``B`` sequences, ``T`` response
tokens per sequence (right-padded); ``mask`` marks the trained tokens. Only masked tokens are
steps of the episode: a multi-turn episode's environment tokens between two turns are skipped,
so the value after a turn's last token is the value before the next turn's first one.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["explained_variance", "gae", "value_loss", "whiten"]


def _compact(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each masked token's step index in its row, and the row's number of steps: [B, T], [B]."""
    steps = mask.long().cumsum(1) - 1  # [B, T], the step of each masked token
    return steps, mask.long().sum(1)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Per-token advantages and returns of a batch of episodes, by GAE.

    Each episode's reward arrives on its last masked token; every other step's reward is 0.
    With ``V_n = 0`` past the end::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                 (the critic's regression target)

    ``lam = 1`` gives the Monte-Carlo return minus the value; ``lam = 0`` one-step TD. Computed in
    float64 over the compacted steps (the loop runs once per step, vectorised over the batch);
    unmasked positions get 0.

    rewards: [B]; values: [B, T]; mask: [B, T] (bool or 0/1) -> advantages [B, T], returns [B, T] float32
    """
    if values.dim() != 2 or mask.shape != values.shape:
        raise ValueError(f"values and mask must both be [B, T], got {tuple(values.shape)} and {tuple(mask.shape)}")
    if rewards.shape != values.shape[:1]:
        raise ValueError(f"rewards must be [B] = ({values.shape[0]},), one per episode, got {tuple(rewards.shape)}")
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma ({gamma}) and lam ({lam}) must be between 0 and 1")
    valid = mask.bool()
    rows, width = values.shape
    steps, lengths = _compact(valid)
    n_steps = int(lengths.max()) if rows else 0
    # The masked values moved to the front of each row: [B, n_steps], zero past each row's end.
    compact = torch.zeros(rows, n_steps + 1, dtype=torch.float64)
    row_of = torch.arange(rows).unsqueeze(1).expand(rows, width)
    compact[row_of[valid], steps[valid]] = values.detach().double()[valid]
    advantages = torch.zeros(rows, n_steps + 1, dtype=torch.float64)
    step_rewards = torch.zeros(rows, n_steps + 1, dtype=torch.float64)
    ended = lengths > 0
    step_rewards[torch.arange(rows)[ended], lengths[ended] - 1] = rewards.double()[ended]
    running = torch.zeros(rows, dtype=torch.float64)
    for t in range(n_steps - 1, -1, -1):
        inside = t < lengths  # [B]
        next_value = torch.where(t + 1 < lengths, compact[:, t + 1], torch.zeros((), dtype=torch.float64))
        delta = step_rewards[:, t] + gamma * next_value - compact[:, t]
        running = torch.where(inside, delta + gamma * lam * running, torch.zeros((), dtype=torch.float64))
        advantages[:, t] = running
    out_adv = torch.zeros(rows, width, dtype=torch.float64)
    out_adv[valid] = advantages[row_of[valid], steps[valid]]
    out_ret = torch.where(valid, out_adv + values.detach().double(), torch.zeros((), dtype=torch.float64))
    return out_adv.float(), out_ret.float()


def whiten(advantages: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Advantages standardised over the masked tokens of the whole batch (zero mean, unit std),
    0 elsewhere: PPO's usual normalisation, so the step's size does not follow the reward's scale."""
    valid = mask.bool()
    if not valid.any():
        return torch.zeros_like(advantages)
    picked = advantages[valid].double()
    centred = (advantages.double() - picked.mean()) / (picked.std(correction=0) + eps)
    return torch.where(valid, centred, torch.zeros((), dtype=torch.float64)).to(advantages.dtype)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's loss, to minimise: half the squared error to the returns, a token mean.

    With ``clip`` (PPO's value clipping, as in OpenAI's baselines and verl's ``cliprange_value``)
    a token's loss is the larger of its plain error and the error of its value kept within
    ``clip`` of ``old_values`` (the critic's prediction when the batch's targets were made), so
    repeated updates on one batch cannot move a value far in one go. None: no clipping.

    values: [B, T] (with grad); old_values, returns, mask: [B, T] -> (loss [], stats) with
    ``value_clip_fraction`` (share of tokens whose clipped error was the larger) and ``value_mean``.
    """
    for name, t in {"old_values": old_values, "returns": returns, "mask": mask}.items():
        if t.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(values.shape)} like values")
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip must be > 0 (or None: no clipping), got {clip}")
    valid = mask.bool()
    weight = valid.to(values.dtype)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(valid, values, zero)
    old = torch.where(valid, old_values.detach().to(values.dtype), zero)
    target = torch.where(valid, returns.detach().to(values.dtype), zero)
    plain = (values - target) ** 2
    per_token = plain
    clipped_larger = torch.zeros_like(valid)
    if clip is not None:
        kept = old + torch.clamp(values - old, -clip, clip)
        clipped = (kept - target) ** 2
        per_token = torch.maximum(plain, clipped)
        clipped_larger = clipped > plain
    tokens = weight.sum().clamp(min=1)
    loss = 0.5 * (per_token * weight).sum() / tokens
    with torch.no_grad():
        stats = {
            "value_clip_fraction": (clipped_larger.to(values.dtype) * weight).sum() / tokens,
            "value_mean": (values * weight).sum() / tokens,
        }
    return loss, stats


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the masked tokens: 1 when the critic
    predicts the returns exactly, 0 when it does no better than their mean, below 0 when worse.
    NaN when the returns do not vary (nothing to explain)."""
    valid = mask.bool()
    target = returns[valid].double()
    if target.numel() < 2:
        return float("nan")
    spread = target.var(correction=0)
    if spread == 0:
        return float("nan")
    return float(1.0 - (target - values[valid].double()).var(correction=0) / spread)
