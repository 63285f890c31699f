"""Where the GRPO app's roles run: GPU ids per role (shared or disjoint) on faked device lists,
the one-GPU Qwen3 config, and the placement keys' checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.common.launch import assign_gpus
from apps.grpo.config import GRPOConfig
from forge.config import load_config

REPO = Path(__file__).resolve().parents[2]
PATHS = ["model.path=/models/Qwen3-1.7B", "data.path=/data/gsm8k.jsonl"]


def config(path: str = "configs/grpo_tiny.yaml", *overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, REPO / path, list(overrides))


def test_the_one_gpu_config_puts_every_gpu_role_on_gpu_0():
    cfg = config("configs/qwen3_1_7b_1gpu.yaml", *PATHS)
    assert assign_gpus(cfg, visible=["0"]) == {
        "policy": ["0"],
        "reference": ["0"],
        "reward": None,
        "reward_model": None,
        "trainer": ["0"],
        "critic": None,
    }
    assert cfg.policy.engine_kwargs["gpu_memory_utilization"] < 0.5  # leaves room for the others


def test_the_three_gpu_config_gives_each_role_its_own_gpu():
    cfg = config("configs/qwen3_1_7b.yaml", *PATHS)
    assert assign_gpus(cfg, visible=["0", "1", "2"]) == {
        "policy": ["0"],
        "reference": ["1"],
        "reward": None,
        "reward_model": None,
        "trainer": ["2"],
        "critic": None,
    }


def test_roles_without_listed_gpus_take_the_free_ones_after_a_tensor_parallel_policy():
    cfg = config(
        "configs/grpo_tiny.yaml",
        "policy.gpus=[0,1]",
        "policy.gpus_per_proc=2",
        "policy.engine_kwargs={tensor_parallel_size: 2}",
        "reference.with_gpus=true",
        "trainer.with_gpus=true",
        "trainer.procs=2",
    )
    assert assign_gpus(cfg, visible=["0", "1", "2", "3", "4"]) == {
        "policy": ["0", "1"],
        "reference": ["2"],
        "reward": None,
        "reward_model": None,
        "trainer": ["3", "4"],
        "critic": None,
    }


def test_listed_gpus_of_the_wrong_count_are_an_error_naming_the_keys():
    cfg = config("configs/grpo_tiny.yaml", "policy.gpus=[0]", "policy.num_replicas=2")
    with pytest.raises(ValueError, match=r"policy.gpus lists 1 device.*policy.procs x policy.gpus_per_proc x "):
        assign_gpus(cfg, visible=["0", "1"])


def test_too_few_free_gpus_is_an_error_naming_the_roles():
    cfg = config("configs/grpo_tiny.yaml", "policy.gpus=[0]", "reference.with_gpus=true", "trainer.with_gpus=true")
    with pytest.raises(ValueError, match=r"need 2 GPUs \(reference 1, trainer 1\) but 1 are free \(\['1'\]"):
        assign_gpus(cfg, visible=["0", "1"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["policy.with_gpus=true", "policy.engine_kwargs={tensor_parallel_size: 2}"], r"tensor_parallel_size \(2\)"),
        (["trainer.hosts=2"], r"trainer.hosts \(2\) places a replica on several hosts"),
        (["hosts.job=slurm", "hosts.num_hosts=2", "trainer.hosts=4"], r"more than hosts.num_hosts \(2\)"),
        (["hosts.job=process", "hosts.num_hosts=2", "trainer.hosts=2", "trainer.procs=3"], r"trainer.hosts x "),
        (["policy.gpus_per_proc=0"], r"policy.gpus_per_proc must be >= 1"),
        (["hosts.job=process", "hosts.num_hosts=2", "trainer.hosts=2", "trainer.min_hosts=3"], r"between 1 and "),
        (
            ["hosts.job=process", "hosts.num_hosts=4", "trainer.hosts=4", "trainer.min_hosts=3"]
            + ["prompts_per_step=5", "group_size=4"],
            r"trainer.min_hosts x trainer.procs \(3 x 1\) must divide prompts_per_step x group_size \(20\)",
        ),
    ],
)
def test_bad_placement_is_refused_naming_the_keys(overrides, message):
    with pytest.raises(ValueError, match=message):
        config("configs/grpo_tiny.yaml", *overrides)


def test_the_readme_slurm_example_splits_each_nodes_gpus_between_the_roles():
    """The controller sees no GPU (a login node): the roles split the nodes' ``gpus_per_node``."""
    cfg = config(
        "configs/grpo_tiny.yaml",
        "hosts.job=slurm",
        "hosts.num_hosts=2",
        "hosts.options={partition: gpu, gpus_per_node: 8, time_limit: '04:00:00'}",
        "trainer.hosts=2",
        "trainer.procs=4",
        "trainer.with_gpus=true",
        "policy.with_gpus=true",
        "policy.num_replicas=3",
        "reference.gpus=[7]",
        "weight_sync.transport=message",
    )
    assert assign_gpus(cfg) == {
        "policy": ["0", "1", "2"],
        "reference": ["7"],
        "reward": None,
        "reward_model": None,
        "trainer": ["3", "4", "5", "6"],
        "critic": None,
    }
