"""The DPO app's config: the preference apps' sections (``apps.common.preferences``), a trainer
with DPO's knobs, the reference service, and an evaluation that may also sample the policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.common.config import EvalSamplingSection, LoggingSection, OptimizerSection, Placement
from apps.common.preferences import PairEvalSection, PreferenceSections
from forge.actors.trainer_config import DPOSettings


@dataclass(kw_only=True)
class DPOTrainerSection(OptimizerSection, DPOSettings):
    """The optimizer's settings, placement and checkpointing, and DPO's ``dpo_beta`` and ``dpo_loss``."""

    def __post_init__(self) -> None:
        OptimizerSection.__post_init__(self)
        DPOSettings.__post_init__(self)


@dataclass(kw_only=True)
class DPOReferenceSection(Placement):
    """The reference service: the starting model, frozen, scoring each pair's responses once."""

    dtype: str = "float32"


@dataclass(kw_only=True)
class DPOEvalSection(PairEvalSection, EvalSamplingSection):
    """The held-out pairs (``split``, ``pairs``) and, with ``generate``, the policy's greedy
    accuracy on the held-out prompts (``data``, ``max_prompts``, ``reward``: as SFT's)."""

    generate: bool = False
    """Also sample the held-out prompts on a policy service (vLLM, the ``policy`` section), on
    the weights of that step; the records need an answer (``data.answer_key``)."""
    samples: int = 0
    """Sampled completions per prompt for ``eval/pass@k``; 0: greedy only."""
    reward: dict[str, float] = field(default_factory=lambda: {"exact_match": 1.0})
    """The reward functions that judge a sampled answer."""


@dataclass(kw_only=True)
class DPOConfig(PreferenceSections):
    """DPO on preference pairs, from ``model.path`` (its own reference)."""

    trainer: DPOTrainerSection = field(default_factory=DPOTrainerSection)
    reference: DPOReferenceSection = field(default_factory=DPOReferenceSection)
    eval: DPOEvalSection = field(default_factory=DPOEvalSection)
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(output_dir="outputs/dpo"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eval.generate:
            self.eval.check()
            if not self.eval.reward:
                raise ValueError("eval.reward needs at least one reward function to judge sampled answers")
