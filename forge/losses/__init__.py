"""Pure tensor losses for RL post-training (no actors, no optimizers, no config)."""

from forge.losses.grpo import group_advantages, grpo_loss, k3_kl, rewards_uniform, trainable_lengths
from forge.losses.preference import DPO_LOSSES, bradley_terry_loss, dpo_loss
from forge.losses.sft import sft_loss

__all__ = [
    "DPO_LOSSES",
    "bradley_terry_loss",
    "dpo_loss",
    "group_advantages",
    "grpo_loss",
    "k3_kl",
    "rewards_uniform",
    "sft_loss",
    "trainable_lengths",
]
