"""Tasks, reward functions and dataset readers: where prompts come from and how answers score."""

from forge.data.jsonl import DatasetFormatError, read_jsonl_prompts
from forge.data.rewards import (
    RewardFn,
    UnknownRewardError,
    exact_match_reward,
    extract_final_number,
    get_reward,
    gsm8k_reward,
    list_rewards,
    register_reward,
    toy_partial_reward,
)
from forge.data.tasks import TOY_ALPHABET, ToyTask

__all__ = [
    "TOY_ALPHABET",
    "DatasetFormatError",
    "RewardFn",
    "ToyTask",
    "UnknownRewardError",
    "exact_match_reward",
    "extract_final_number",
    "get_reward",
    "gsm8k_reward",
    "list_rewards",
    "read_jsonl_prompts",
    "register_reward",
    "toy_partial_reward",
]
