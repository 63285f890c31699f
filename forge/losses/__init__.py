"""Pure tensor losses for RL post-training (no actors, no optimizers, no config)."""

from forge.losses.grpo import group_advantages, grpo_loss, k3_kl, rewards_uniform, trainable_lengths
from forge.losses.sft import sft_loss

__all__ = ["group_advantages", "grpo_loss", "k3_kl", "rewards_uniform", "sft_loss", "trainable_lengths"]
