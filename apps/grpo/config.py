"""The GRPO app's config: a tree of typed dataclasses, loaded from YAML plus ``key=value`` overrides.

Every field is documented where it is defined. ``forge.config.load_config`` checks a YAML file
and the command-line overrides against ``GRPOConfig``: an unknown key, a wrong type or a missing
required value is an error naming the full key path (e.g. ``trainer.lr``). Cross-field rules
live in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from forge.actors.policy import PolicySettings
from forge.actors.trainer import TrainerSettings


@dataclass(kw_only=True)
class TinyModel:
    """The tiny random-init model made at ``model.path`` (CPU demos and tests)."""

    make_if_missing: bool = False
    """Make the tiny model at ``model.path`` when no model is there."""
    arch: str = "qwen2"
    """``qwen2`` or ``qwen3``."""
    hidden_size: int = 128
    """Model width, a multiple of 64."""
    num_layers: int = 2
    """Decoder layers."""
    seed: int = 0
    """Seed of the random init."""
    init_std: float = 0.02
    """Std of the normal weight init."""


@dataclass(kw_only=True)
class ModelSection:
    path: str = MISSING
    """Hugging Face checkpoint folder shared by policy, reference and trainer (required)."""
    tiny: TinyModel = field(default_factory=TinyModel)
    """The tiny model to make at ``path`` if ``tiny.make_if_missing`` and none is there."""


@dataclass(kw_only=True)
class Placement:
    """Where a role runs (see ``forge.controller.ActorOptions``)."""

    procs: int = 1
    """Processes per replica."""
    num_replicas: int = 1
    """Replicas (services only)."""
    with_gpus: bool = False
    """Give each process its own GPU."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the role's processes."""


@dataclass(kw_only=True)
class PolicySection(Placement, PolicySettings):
    """The policy's settings (``forge.actors.policy.PolicySettings``) and placement. Keep
    ``top_p`` at 1.0: the trainer's logprobs apply no nucleus mask."""


@dataclass(kw_only=True)
class ReferenceSection(Placement):
    dtype: str = "float32"
    """Reference model dtype."""


@dataclass(kw_only=True)
class RewardSection(Placement):
    fns: dict[str, float] = field(default_factory=lambda: {"toy": 1.0})
    """Reward functions (registry name or ``module:function``) and their weights."""


@dataclass(kw_only=True)
class TrainerSection(Placement, TrainerSettings):
    """The trainer's settings (``forge.actors.trainer.TrainerSettings``), placement and
    checkpointing."""

    checkpoint_every: int = 0
    """Save a full checkpoint (weights, optimizer, step, policy version, RNG, dataset position)
    under ``<logging.output_dir>/checkpoints`` every N steps and at the last step; 0 never.
    ``--resume`` continues a killed run from the newest one."""


@dataclass(kw_only=True)
class DataSection:
    source: str = "toy"
    """``toy`` (the built-in arithmetic task), ``jsonl`` (prompts read from ``path``) or
    ``package.module:factory`` (your ``factory(seed=..., **options)`` yielding ``Prompt``s)."""
    path: str | None = None
    """JSONL file of prompts when ``source`` is ``jsonl``."""
    prompt_template: str = "{text}"
    """Format of the text sent to the policy; ``{text}`` is the prompt's text."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the task (e.g. ``min_digits``) or of ``read_jsonl_prompts``
    (``question_key``, ``answer_key``)."""


@dataclass(kw_only=True)
class RolloutSection:
    concurrency: int = 0
    """Prompts in flight at once (each one group); 0 means ``prompts_per_step``."""
    max_buffered_groups: int = 0
    """Most groups buffered or in flight before rollouts wait; 0 means
    ``prompts_per_step * max(1, max_policy_age)``: what the next ``max_policy_age`` steps can
    use. More would be evicted as stale before it trains: wasted generation."""


@dataclass(kw_only=True)
class WeightSyncSection:
    transport: str = "message"
    """``message``: tensors in a Monarch message via the controller; ``file``: the trainer writes
    a safetensors file under ``dir`` (same host only) and the policy loads it."""
    dir: str = "/dev/shm/forge-weights"
    """Folder of the ``file`` transport."""


@dataclass(kw_only=True)
class LoggingSection:
    output_dir: str = "outputs/grpo"
    """Where ``metrics.jsonl``, the plot and TensorBoard events go."""
    sinks: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Metric sinks: ``jsonl`` (``metrics.jsonl``), ``tensorboard`` (if installed), ``console``
    (one log line per step)."""
    plot: bool = True
    """Write ``<output_dir>/reward_loss.png`` at the end."""
    progress_bar: bool = True
    """Show a progress bar with reward, loss and step time."""


@dataclass(kw_only=True)
class GRPOConfig:
    """The whole app: GRPO settings, then one section per role."""

    steps: int = 150
    """Training steps (optimizer updates)."""
    group_size: int = 8
    """Completions per prompt."""
    prompts_per_step: int = 16
    """Groups (prompts) in one training batch."""
    max_policy_age: int = 1
    """Off-by-n: a group sampled by policy version g trains at version v only if v - g <= this."""
    seed: int = 0
    """Seed of data order, sampling and the trainer."""
    model: ModelSection = field(default_factory=ModelSection)
    policy: PolicySection = field(default_factory=PolicySection)
    reference: ReferenceSection = field(default_factory=ReferenceSection)
    reward: RewardSection = field(default_factory=RewardSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    def __post_init__(self) -> None:
        for name in ("steps", "group_size", "prompts_per_step"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.trainer.checkpoint_every < 0:
            raise ValueError(
                f"trainer.checkpoint_every must be >= 0 (0 disables checkpoints), got {self.trainer.checkpoint_every}"
            )
        if self.trainer.keep_checkpoints < 1:
            raise ValueError(f"trainer.keep_checkpoints must be >= 1, got {self.trainer.keep_checkpoints}")
        if self.max_policy_age < 0:
            raise ValueError(f"max_policy_age must be >= 0, got {self.max_policy_age}")
        if self.policy.top_p != 1.0:
            raise ValueError(
                f"policy.top_p must be 1.0, got {self.policy.top_p}: the trainer's logprobs "
                "do not apply a nucleus mask, so behaviour and trainer logprobs would disagree"
            )
        if not self.policy.temperature > 0:
            raise ValueError(f"policy.temperature must be > 0 for RL sampling, got {self.policy.temperature}")
        if self.weight_sync.transport not in ("message", "file"):
            raise ValueError(f"weight_sync.transport must be 'message' or 'file', got {self.weight_sync.transport!r}")
        if self.data.source not in ("toy", "jsonl") and ":" not in self.data.source:
            raise ValueError(
                f"data.source must be 'toy', 'jsonl' or 'package.module:factory', got {self.data.source!r}"
            )
        if self.data.source == "jsonl" and not self.data.path:
            raise ValueError("data.path is required when data.source is 'jsonl'")
        if "jsonl" not in self.logging.sinks:
            raise ValueError(
                "logging.sinks must include 'jsonl': metrics.jsonl is the run's record and the plot's source"
            )
        if not self.reward.fns:
            raise ValueError("reward.fns needs at least one reward function")

    @property
    def checkpoint_dir(self) -> str:
        """Where the run's checkpoints go: ``<logging.output_dir>/checkpoints``."""
        return str(Path(self.logging.output_dir) / "checkpoints")

    @property
    def rollout_concurrency(self) -> int:
        return self.rollout.concurrency or self.prompts_per_step

    @property
    def max_buffered_groups(self) -> int:
        return self.rollout.max_buffered_groups or self.prompts_per_step * max(1, self.max_policy_age)
