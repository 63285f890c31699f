"""The RL roles as ForgeActors: policy (vLLM), reference model, rewards (functions and learned
models), trainer, buffer, dataset.

Each module holds one role and its small config dataclass. The roles know nothing of each
other: the controller (``apps/grpo/main.py``) wires them together through the service API.

The names below are imported on first use, not with the package: a role's process imports its
own module (a reward replica loads no model code, a trainer no vLLM), which keeps the start-up of
a run's processes, all importing at once on the same cores, short.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {
    "Dataset": "dataset",
    "DatasetConfig": "dataset",
    "MultiLoraPolicy": "multi_lora_policy",
    "Policy": "policy",
    "PolicyConfig": "policy",
    "PolicySettings": "policy",
    "prompt_key": "policy",
    "ReferenceConfig": "reference_model",
    "ReferenceModel": "reference_model",
    "length_bucket": "reference_model",
    "BufferStats": "replay_buffer",
    "GroupBuffer": "replay_buffer",
    "ReplayBuffer": "replay_buffer",
    "Sample": "replay_buffer",
    "group_version": "replay_buffer",
    "RewardModel": "reward_model",
    "RewardModelConfig": "reward_model",
    "RewardActor": "reward",
    "WeightedReward": "reward",
    "resolve_reward": "reward",
    "Trainer": "trainer",
    "TrainerConfig": "trainer_config",
    "TrainerSettings": "trainer_config",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'forge.actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"forge.actors.{module}"), name)
    globals()[name] = value  # once imported, a plain module attribute
    return value


def __dir__() -> list[str]:
    return __all__
