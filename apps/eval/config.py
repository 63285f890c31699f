"""The evaluation app's config: a checkpoint, held-out records, how to sample and judge them."""

from __future__ import annotations

from dataclasses import dataclass, field

from apps.common.config import EvalSamplingSection, LoggingSection, RecordsSection, RunSections


@dataclass(kw_only=True)
class EvalAppConfig(RunSections):
    """Evaluate one checkpoint (``model.path``) on held-out records, as GRPO and SFT runs do (the
    sections of every app's run, ``RunSections``: ``policy`` is the vLLM engine and its placement,
    whose ``temperature`` and ``max_tokens`` are the defaults of ``eval.temperature`` and
    ``eval.max_tokens``; ``logging.output_dir`` receives ``eval.json``)."""

    data: RecordsSection = field(default_factory=RecordsSection)
    """How prompts are formatted (template, chat template) and, when ``eval.data.path`` is empty,
    which files hold the held-out records."""
    eval: EvalSamplingSection = field(default_factory=lambda: EvalSamplingSection(reward={"exact_match": 1.0}))
    """The held-out split, how many prompts, samples per prompt, and the reward that judges them."""
    logging: LoggingSection = field(default_factory=lambda: LoggingSection(output_dir="outputs/eval"))
    write_samples: bool = False
    """Also write every sampled completion with its reward to ``<logging.output_dir>/samples.jsonl``
    (e.g. a policy's own mistakes, as preference pairs: ``python -m apps.rm.policy_pairs``)."""

    def __post_init__(self) -> None:
        self.eval.check()
        if not self.eval.reward:
            raise ValueError("eval.reward needs at least one reward function to judge completions")
        if not (self.eval.data.path or self.data.path):
            raise ValueError("eval.data.path (or data.path) is required: the held-out records")
