"""The SFT app's config: a tree of typed dataclasses, loaded from YAML plus ``key=value`` overrides.

Sections it shares with the GRPO app mean the same there and here (``model``, ``policy``,
``weight_sync``, ``hosts``, ``logging``); the trainer section holds the optimizer's settings
only (SFT has no GRPO loss knobs), and ``eval`` adds the held-out loss and early stopping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.common.config import (
    EvalSamplingSection,
    LoggingSection,
    OptimizerSection,
    RecordsSection,
    TrainingSections,
    check_batch_run,
)


@dataclass(kw_only=True)
class SFTEvalSection(EvalSamplingSection):
    """Held-out evaluation every ``every`` steps and after the last one: the loss of the held-out
    answers (``eval/loss``) and, with ``generate``, the policy's greedy accuracy and pass@k on
    the held-out prompts (``forge.evaluation``, the same code as GRPO's and ``apps.eval``'s)."""

    every: int = 0
    """Steps between evaluations; 0: only after the last step."""
    loss_examples: int = 512
    """Held-out examples whose answer loss is computed (the first ones of the split)."""
    generate: bool = True
    """Also sample the held-out prompts on a policy service (vLLM, the ``policy`` section), on the
    weights of that step."""
    samples: int = 0
    """Sampled completions per prompt for ``eval/pass@k`` and ``eval/mean@k``; 0: greedy only."""
    reward: dict[str, float] = field(default_factory=lambda: {"exact_match": 1.0})
    """The reward functions that judge a completion (a registry name or ``module:function``)."""
    stop_at_accuracy: float = 0.0
    """Stop once the held-out greedy accuracy (``eval/accuracy``) reaches this, and export that
    model (e.g. an SFT starting point that RL improves); 0: never stop early."""


@dataclass(kw_only=True)
class SFTConfig(TrainingSections):
    """The whole SFT app: steps and batch, then one section per part (and those of every app's
    run, ``RunSections``; ``policy`` is the vLLM engine that samples the held-out prompts, with
    ``eval.generate``)."""

    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 64
    """Examples per optimizer step."""
    data: RecordsSection = field(default_factory=RecordsSection)
    """The training records (``question_key`` the prompt, ``answer_key`` the target)."""
    eval: SFTEvalSection = field(default_factory=SFTEvalSection)
    trainer: OptimizerSection = field(default_factory=OptimizerSection)
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(output_dir="outputs/sft"))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_batch_run(self, "examples", "the SFT records (jsonl, json, parquet, csv or save_to_disk)")
        for name in ("every", "loss_examples"):
            value = getattr(self.eval, name)
            if value < 0:
                raise ValueError(f"eval.{name} must be >= 0, got {value}")
        if not 0.0 <= self.eval.stop_at_accuracy <= 1.0:
            raise ValueError(
                f"eval.stop_at_accuracy must be in [0, 1] (0: never stop early), got {self.eval.stop_at_accuracy}"
            )
        if self.eval.stop_at_accuracy and not (self.eval.generate and self.eval.every):
            raise ValueError("eval.stop_at_accuracy needs eval.generate and eval.every > 0: accuracy is measured then")
        if self.eval.generate:
            self.eval.check()
            if not self.eval.reward:
                raise ValueError("eval.reward needs at least one reward function to judge completions")
