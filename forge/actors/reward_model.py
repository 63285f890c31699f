"""``RewardModel``: learned rewards as a batched service, one score per response from each model.

A reward model is a Hugging Face sequence-classification checkpoint with one output (what
``apps.rm`` exports: a causal LM's body under a scalar head). Callers send one ``(prompt, text)``
each, or a whole group as one request, like the reward functions' actor::

    rm = await RewardModel.options(num_replicas=2).as_service(RewardModelConfig(model_paths=[path]))
    scores = await rm.score.route((prompt, completion.text))              # [one per model]
    per_text = await rm.score_groups.route((prompt, [c.text for c in group]))  # [[one per model]]

The replica tokenises the text itself, with each model's own tokenizer and the prompt format it
was trained on (``forge_prompt_format.json`` beside its weights): the question
(``Prompt.question``, before the policy's formatting) through that format, then the response as
an answer is written in training, with its end-of-answer token. So a reward model whose
tokenizer differs from the policy's scores the same text. The score is the head's output at the
last token, as the trainer reads it (``forge.actors.trainer_pairs.last_token_scores``).

Requests are prebatched up to ``token_budget`` tokens and by length bucket (the ``Batching``
key), as the reference model's are: a request's size is its characters, never fewer than its
tokens for a tokenizer whose tokens are at least one character (a batch may hold fewer tokens
than the budget, never more), and each forward pass holds at most ``token_budget`` real tokens.
With ``procs=N`` a replica is one SPMD mesh: each model is sharded with FSDP2 and every rank
scores a share of the batch. Each batch records ``reward_model/batch_size`` and
``reward_model/padding_fraction``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from forge.actors.reference_model import TOKEN_BUDGET, bucket_of
from forge.controller import Batching, ForgeActor, endpoint
from forge.distributed import SpmdRank, init_spmd, local_state_bytes, map_shares, shard_model, shutdown_spmd
from forge.models import forward_padding_fraction, right_pad
from forge.observability import record_metric
from forge.types import Prompt

if TYPE_CHECKING:
    from forge.data.formatting import PromptFormat

__all__ = [
    "PROMPT_FORMAT_FILE",
    "RewardModel",
    "RewardModelConfig",
    "check_reward_checkpoint",
    "read_prompt_format",
    "write_prompt_format",
]

PROMPT_FORMAT_FILE = "forge_prompt_format.json"
"""Beside a reward model's weights: the prompt template and chat-template switch it was trained with."""


def write_prompt_format(folder: str | Path, template: str, chat: bool) -> None:
    (Path(folder) / PROMPT_FORMAT_FILE).write_text(json.dumps({"prompt_template": template, "chat_template": chat}))


def read_prompt_format(folder: str | Path) -> tuple[str, bool]:
    """``(prompt_template, chat_template)`` a reward model was trained with; a folder without the
    file (a reward model trained elsewhere) is read as ``("{text}", True)``, forge's defaults."""
    path = Path(folder) / PROMPT_FORMAT_FILE
    if not path.is_file():
        return "{text}", True
    saved = json.loads(path.read_text())
    return str(saved.get("prompt_template", "{text}")), bool(saved.get("chat_template", True))


def check_reward_checkpoint(path: str | Path) -> None:
    """A ``ValueError`` naming ``path`` unless it is a checkpoint folder of a sequence-classification
    model with one output (a scalar head); reads ``config.json`` only."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"reward model {str(path)!r} is not a Hugging Face checkpoint folder (no config.json)")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"reward model {str(path)!r} has no scalar head: its architectures are {architectures}, expected a "
            "*ForSequenceClassification model with one label (what `python -m apps.rm.main` exports as final_model)"
        )
    labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 2))
    if labels != 1:
        raise ValueError(f"reward model {str(path)!r} has {labels} outputs; a reward model has one (num_labels: 1)")


def text_size(item: tuple[Prompt, str]) -> int:
    """Batching size of a request: its characters, an upper bound of its tokens."""
    prompt, text = item
    return min(TOKEN_BUDGET, len(prompt.text) + len(text))


def text_bucket(item: tuple[Prompt, str]) -> int:
    """Batching key of a request: the length bucket of its characters."""
    prompt, text = item
    return bucket_of(len(prompt.text) + len(text))


def group_size(group: tuple[Prompt, list[str]]) -> int:
    """Batching size of a group: its requests' characters, at most the budget (a larger group goes alone)."""
    prompt, texts = group
    return min(TOKEN_BUDGET, len(texts) * len(prompt.text) + sum(len(t) for t in texts))


def group_bucket(group: tuple[Prompt, list[str]]) -> int:
    """Batching key of a group: the bucket of its longest request."""
    prompt, texts = group
    return bucket_of(len(prompt.text) + max((len(t) for t in texts), default=0))


@dataclass(kw_only=True)
class RewardModelConfig:
    """The reward models a replica holds and how it scores."""

    model_paths: list[str]
    """Sequence-classification checkpoint folders with one output; every request gets one score
    from each, in this order."""
    dtype: str = "float32"
    """Weights dtype (``bfloat16`` on GPUs)."""
    pad_id: int = 0
    """Token id used for padding (scores are read at each row's own last token, whatever it is)."""
    token_budget: int = TOKEN_BUDGET
    """Most real tokens in one forward pass."""
    dist_timeout_s: float = 300.0
    """Longest the ranks of a ``procs > 1`` replica wait for each other."""

    def __post_init__(self) -> None:
        if not self.model_paths:
            raise ValueError("RewardModelConfig.model_paths needs at least one reward model")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")


@dataclass
class _Scorer:
    model: torch.nn.Module
    fmt: PromptFormat


class RewardModel(ForgeActor):
    """Frozen scalar-head models with batched, length-bucketed ``score`` and ``score_groups``."""

    def __init__(self, config: RewardModelConfig) -> None:
        self.config = config
        self.scorers: list[_Scorer] = []
        for path in config.model_paths:
            check_reward_checkpoint(path)

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoModelForSequenceClassification

        from forge.data.formatting import PromptFormat

        cfg = self.config
        self.rank: SpmdRank = await init_spmd(timeout_s=cfg.dist_timeout_s)
        self.device = self.rank.device
        for path in cfg.model_paths:
            model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, cfg.dtype))
            model = shard_model(model.to(self.device).eval().requires_grad_(False), self.rank)
            self.scorers.append(_Scorer(model, PromptFormat.from_model(path, *read_prompt_format(path))))

    @endpoint(batch=Batching(max_size=TOKEN_BUDGET, size_fn=text_size, key=text_bucket, max_wait_s=0.002))
    async def score(self, items: list[tuple[Prompt, str]]) -> list[list[float]]:
        """Each ``(prompt, response text)``'s scores, one per model (``model_paths``' order)."""
        return self._score(items)

    @endpoint(batch=Batching(max_size=TOKEN_BUDGET, size_fn=group_size, key=group_bucket, max_wait_s=0.002))
    async def score_groups(self, groups: list[tuple[Prompt, list[str]]]) -> list[list[list[float]]]:
        """Each group's (a prompt and its responses' texts) scores: one list per response, in
        order, of one score per model."""
        flat = self._score([(prompt, text) for prompt, texts in groups for text in texts])
        out, start = [], 0
        for _, texts in groups:
            out.append(flat[start : start + len(texts)])
            start += len(texts)
        return out

    def _score(self, items: list[tuple[Prompt, str]]) -> list[list[float]]:
        t0 = time.perf_counter()
        per_model = [self._score_with(scorer, items) for scorer in self.scorers]
        if self.rank.is_main:
            record_metric("reward_model/batch_size", len(items))
            record_metric("reward_model/forward_s", time.perf_counter() - t0, "sum")
        return [list(scores) for scores in zip(*per_model)]

    def _score_with(self, scorer: _Scorer, items: list[tuple[Prompt, str]]) -> list[float]:
        """One model's score of every item, in forward passes of at most ``token_budget`` tokens,
        the items sorted by length so that each pass pads little."""
        examples = [scorer.fmt.sft_example(prompt.question, text) for prompt, text in items]
        lengths = [int(e.prompt_ids.numel() + e.answer_ids.numel()) for e in examples]
        order = sorted(range(len(items)), key=lengths.__getitem__)
        passes: list[list[int]] = [[]]
        tokens = 0
        for i in order:
            if passes[-1] and tokens + lengths[i] > self.config.token_budget:
                passes.append([])
                tokens = 0
            passes[-1].append(i)
            tokens += lengths[i]
        scores: dict[int, float] = {}
        for indices in passes:
            values = map_shares(indices, lambda part: self._forward(scorer, [examples[i] for i in part]), self.rank)
            scores.update(zip(indices, values))
            if self.rank.is_main:
                record_metric(
                    "reward_model/padding_fraction", forward_padding_fraction([lengths[i] for i in indices], False)
                )
        return [scores[i] for i in range(len(items))]

    def _forward(self, scorer: _Scorer, examples: list[Any]) -> list[float]:
        from forge.actors.trainer_pairs import last_token_scores

        batch = right_pad(
            torch.cat([e.prompt_ids for e in examples]),
            [int(e.prompt_ids.numel()) for e in examples],
            torch.cat([e.answer_ids for e in examples]),
            [int(e.answer_ids.numel()) for e in examples],
            self.config.pad_id,
        )
        with torch.no_grad():
            return last_token_scores(scorer.model, batch, self.device).tolist()

    @endpoint
    async def state_bytes(self) -> int:
        """Bytes of weights this rank holds (its shards of every model)."""
        return sum(local_state_bytes(s.model) for s in self.scorers)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        """Monarch's stop hook: leave the process group."""
        shutdown_spmd()
