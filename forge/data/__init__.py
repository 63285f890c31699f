"""Tasks, reward functions and datasets: where prompts come from and how answers score."""

from forge.data.arithmetic import write_addition
from forge.data.datasets import HELD_OUT, DataError, DataSource, PromptEpochs, load_prompts, load_split
from forge.data.formatting import PromptFormat
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
    "HELD_OUT",
    "TOY_ALPHABET",
    "DataError",
    "DataSource",
    "PromptEpochs",
    "PromptFormat",
    "RewardFn",
    "ToyTask",
    "UnknownRewardError",
    "exact_match_reward",
    "extract_final_number",
    "get_reward",
    "gsm8k_reward",
    "list_rewards",
    "load_prompts",
    "load_split",
    "register_reward",
    "toy_partial_reward",
    "write_addition",
]
