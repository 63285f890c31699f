"""PPO in the GRPO app (``algorithm: ppo``): the critic role, each step's per-token advantages, and
the critic's checkpoints.

A step's batch goes to the critic first: its value of every response token (``Trainer.token_values``).
The controller then makes the targets over the whole batch at once, GAE with the episode's reward
on its last trained token, whitened over the batch (``forge.losses.ppo``): the policy trains on
those per-token advantages (``EpisodeBatch.token_advantages``; the GRPO loss's clipping, KL and
corrections apply unchanged) while the critic, at the same time, fits its values to the returns
(``Trainer.value_step``). The trained tokens are the trainer's own (``trained_tokens``), so a
multi-turn episode's environment tokens are no steps of GAE.

The critic is checkpointed under ``<checkpoint_dir>/critic`` at the trainer's steps, written
before the trainer's, so that every complete trainer checkpoint has its critic's.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from apps.common.config import settings
from apps.grpo.faults import mesh_call

if TYPE_CHECKING:
    from apps.common.launch import Roles
    from apps.grpo.config import GRPOConfig
    from forge.actors.trainer import TrainerConfig
    from forge.types import EpisodeBatch

__all__ = [
    "critic_checkpoint",
    "critic_config",
    "critic_step",
    "load_critic",
    "ppo_targets",
    "save_critic",
    "with_ppo_targets",
]


def critic_config(cfg: GRPOConfig, model_path: str) -> TrainerConfig:
    """The critic's ``TrainerConfig``: the ``critic`` section's optimizer on a scalar head over
    ``critic.model`` (default: the policy's checkpoint), training the tokens the trainer trains."""
    from forge.actors.trainer import OptimizerSettings, TrainerConfig

    c = cfg.critic
    assert c is not None, "algorithm: ppo's config check requires a critic section"
    # One more than the trainer's: every trainer checkpoint kept has its critic's, which is written first.
    keep = max(c.keep_checkpoints, cfg.trainer.keep_checkpoints + 1)
    return TrainerConfig(
        **{**settings(c, OptimizerSettings), "keep_checkpoints": keep},
        model_path=c.model or model_path,
        head="scalar",
        value_clip=c.value_clip,
        seed=cfg.seed,
        checkpoint_dir=critic_dir(cfg) if cfg.trainer.checkpoint_every else None,
        stop_token_ids=list(cfg.policy.stop_token_ids),
        mask_truncated=cfg.trainer.mask_truncated,
        total_steps=cfg.steps,
    )


def critic_dir(cfg: GRPOConfig) -> str:
    return str(Path(cfg.checkpoint_dir) / "critic")


def critic_checkpoint(cfg: GRPOConfig, trainer_checkpoint: Path) -> Path:
    """The critic's checkpoint of the same step as ``trainer_checkpoint`` (same folder name)."""
    return Path(critic_dir(cfg)) / Path(trainer_checkpoint).name


async def critic_call(cfg: GRPOConfig, endpoint: Any, *args: Any) -> Any:
    """A call to every critic rank, bounded like the trainer's (``faults.mesh_call``)."""
    return await mesh_call(cfg, "critic", endpoint, *args)


def ppo_targets(
    batch: EpisodeBatch, values: torch.Tensor, trained: torch.Tensor, *, gamma: float, lam: float, whiten: bool
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Per-token advantages and returns of ``batch`` from the critic's ``values`` (flat like
    ``response_ids``) over its ``trained`` tokens (flat, bool); returns the three flat columns for
    ``EpisodeBatch`` (``token_advantages``, ``returns``, ``values``) and the step's statistics."""
    from forge.actors.trainer_batches import laid_out
    from forge.losses import ppo

    lens = batch.response_lens.long()
    if values.shape != (int(lens.sum()),) or trained.shape != values.shape:
        raise ValueError(
            f"PPO targets need one value and one trained flag per response token ({int(lens.sum())}), got values "
            f"{tuple(values.shape)} and trained {tuple(trained.shape)}"
        )
    width = int(lens.max()) if lens.numel() else 0
    rows = torch.arange(width)[None, :] < lens[:, None]  # [B, T]: each response's tokens, left-aligned
    value_rows = laid_out(values.float(), rows)
    mask_rows = laid_out(trained.bool(), rows)
    advantages, returns = ppo.gae(batch.rewards.float(), value_rows, mask_rows.float(), gamma=gamma, lam=lam)
    any_trained = bool(mask_rows.any())

    def mean_over_trained(x: torch.Tensor) -> float:
        return float(x[mask_rows].mean()) if any_trained else 0.0

    stats = {
        "critic/explained_variance": ppo.explained_variance(value_rows, returns, mask_rows),
        "critic/value_mean": mean_over_trained(value_rows),
        "critic/return_mean": mean_over_trained(returns),
        "ppo/advantage_std": float(advantages[mask_rows].std(correction=0)) if any_trained else 0.0,
    }
    if whiten:
        advantages = ppo.whiten(advantages, mask_rows)
    columns = {"token_advantages": advantages[rows], "returns": returns[rows], "values": values.float()}
    return columns, stats


async def with_ppo_targets(cfg: GRPOConfig, roles: Roles, batch: EpisodeBatch) -> tuple[EpisodeBatch, dict[str, float]]:
    """``batch`` with PPO's per-token advantages, returns and values, from the critic's values now."""
    from forge.actors.trainer_batches import trained_tokens

    values = await critic_call(cfg, roles.critic.token_values, batch)
    trained = trained_tokens(batch, cfg.policy.stop_token_ids, cfg.trainer.mask_truncated)
    columns, stats = ppo_targets(batch, values, trained, gamma=cfg.ppo.gamma, lam=cfg.ppo.lam, whiten=cfg.ppo.whiten)
    return dataclasses.replace(batch, **columns), stats


async def critic_step(cfg: GRPOConfig, roles: Roles, batch: EpisodeBatch) -> dict[str, float]:
    """One critic optimizer step on ``batch``'s returns; its figures under ``critic/``."""
    stats = await critic_call(cfg, roles.critic.value_step, batch)
    return {
        "critic/value_loss": float(stats["loss"]),
        "critic/value_clip_fraction": float(stats.get("value_clip_fraction", 0.0)),
        "critic/grad_norm": float(stats.get("grad_norm", math.nan)),
    }


async def save_critic(cfg: GRPOConfig, roles: Roles, step: int) -> None:
    """The critic's checkpoint of ``step``, complete before the trainer's is begun."""
    await critic_call(cfg, roles.critic.save_checkpoint, step, {})
    await critic_call(cfg, roles.critic.wait_checkpoint)


async def load_critic(cfg: GRPOConfig, roles: Roles, trainer_checkpoint: Path) -> None:
    """Load the critic's checkpoint of the trainer checkpoint's step; an error naming it if absent."""
    path = critic_checkpoint(cfg, trainer_checkpoint)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{trainer_checkpoint} has no critic checkpoint beside it ({path}): a PPO run resumes its critic too"
        )
    await critic_call(cfg, roles.critic.load_checkpoint, str(path))
