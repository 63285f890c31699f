"""The RL roles as ForgeActors: policy (vLLM), reference model, reward, trainer, buffer, dataset.

Each module holds one role and its small config dataclass. The roles know nothing of each
other: the controller (``apps/grpo/main.py``) wires them together through the service API.
"""

from forge.actors.dataset import Dataset, DatasetConfig
from forge.actors.policy import Policy, PolicyConfig, PolicySettings, prompt_key
from forge.actors.reference_model import ReferenceConfig, ReferenceModel, length_bucket
from forge.actors.replay_buffer import BufferStats, GroupBuffer, ReplayBuffer, Sample, group_version
from forge.actors.reward import RewardActor, resolve_reward
from forge.actors.trainer import Trainer, TrainerConfig, TrainerSettings

__all__ = [
    "BufferStats",
    "Dataset",
    "DatasetConfig",
    "GroupBuffer",
    "Policy",
    "PolicyConfig",
    "PolicySettings",
    "ReferenceConfig",
    "ReferenceModel",
    "ReplayBuffer",
    "RewardActor",
    "Sample",
    "Trainer",
    "TrainerConfig",
    "TrainerSettings",
    "group_version",
    "length_bucket",
    "prompt_key",
    "resolve_reward",
]
