"""Config sections the apps share: where records come from, how they are shown to the model,
how held-out evaluation samples and scores, and W&B."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from forge.data.datasets import DataSource


@dataclass(kw_only=True)
class RecordsSection(DataSource):
    """Question/answer records from local files (``forge.data.datasets``: jsonl/json, parquet,
    csv or a ``save_to_disk`` folder) and how their questions become prompts."""

    prompt_template: str = "{text}"
    """Format of the text sent to the policy; ``{text}`` is the record's question."""
    chat_template: bool = True
    """Wrap each prompt in the model tokenizer's chat template (a user turn, the assistant's
    turn opened), where the tokenizer has one; false: the templated text as it is."""
    make_if_missing: dict[str, Any] = field(default_factory=dict)
    """A generated task written to ``path`` when nothing is there, e.g. ``{task: addition,
    digits: 3, train_size: 200000, test_size: 2000}`` (``forge.data.arithmetic``); empty: none."""


@dataclass(kw_only=True)
class EvalData(DataSource):
    """The held-out records an evaluation scores. An empty ``path`` means the run's ``data.path``
    (with its keys and held-out fraction); the prompts are formatted as the training data's."""

    split: str = "test"
    """The held-out split: a split of the files (``test``), or ``held_out`` for the run data's
    ``held_out_fraction`` of ``train``."""


@dataclass(kw_only=True)
class EvalSamplingSection:
    """How an evaluation samples and judges each held-out prompt (``forge.evaluation``)."""

    data: EvalData = field(default_factory=EvalData)
    """The held-out records."""
    max_prompts: int = 500
    """The first this many held-out records are evaluated (all of them if fewer)."""
    samples: int = 8
    """Sampled completions per prompt for ``eval/pass@k`` and ``eval/mean@k`` (k); 0: greedy only."""
    temperature: float = 0.0
    """Temperature of the k samples; 0: the policy's ``temperature``."""
    max_tokens: int = 0
    """Most response tokens per completion; 0: the policy's ``max_tokens``."""
    correct_at: float = 1.0
    """A completion is correct (``eval/accuracy``, pass@k, mean@k) when its reward is at least this."""
    reward: dict[str, float] = field(default_factory=dict)
    """The reward functions that judge a completion (as ``reward.fns``); empty: the run's own."""

    def check(self, section: str = "eval") -> None:
        """Cross-field rules, named with the section's path."""
        if self.max_prompts < 1:
            raise ValueError(f"{section}.max_prompts must be >= 1, got {self.max_prompts}")
        if self.samples < 0:
            raise ValueError(f"{section}.samples must be >= 0 (0: greedy only), got {self.samples}")
        if self.temperature < 0:
            raise ValueError(f"{section}.temperature must be >= 0 (0: the policy's), got {self.temperature}")
        if self.max_tokens < 0:
            raise ValueError(f"{section}.max_tokens must be >= 0 (0: the policy's), got {self.max_tokens}")


@dataclass(kw_only=True)
class WandbSection:
    """The ``wandb`` sink's run (``logging.sinks`` must name ``wandb``)."""

    project: str = "forge"
    """W&B project."""
    name: str = ""
    """Run name; empty: W&B's own."""
    mode: str = ""
    """``online``, ``offline`` or ``disabled``; empty: online if W&B is configured on this machine
    (``WANDB_API_KEY``, ``wandb login``) or ``WANDB_MODE`` says so, else offline (``wandb sync``
    uploads it later)."""
