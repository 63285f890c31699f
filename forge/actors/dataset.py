"""``Dataset``: hands out prompts, with their answers, one at a time.

Sources: ``toy`` (``forge.data.ToyTask``, an endless stream of digit-reversal prompts a tiny
model learns on a CPU), ``dataset`` (records of local files through Hugging Face ``datasets``:
``forge.data.datasets``, e.g. GSM8K or the generated addition task, reshuffled every epoch), or
``"package.module:factory"``, your own ``factory(seed=..., **options)`` returning an iterable of
``Prompt``. Each prompt's text is formatted for the policy (``forge.data.PromptFormat``: the
``prompt_template``, then the model's chat template where it has one); the answer is left
untouched for the reward functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from forge.controller import ForgeActor, endpoint
from forge.data.datasets import DataSource, PromptEpochs, load_prompts
from forge.types import QUESTION, Prompt

__all__ = ["DATASET_SOURCES", "Dataset", "DatasetConfig", "prompt_stream"]

DATASET_SOURCES = ("toy", "dataset")
"""The built-in prompt sources; anything else is a ``package.module:factory``."""


@dataclass(kw_only=True)
class DatasetConfig:
    source: str = "toy"
    """``toy``, ``dataset`` or ``"package.module:factory"``."""
    records: DataSource | None = None
    """The files, split and keys of the ``dataset`` source."""
    prompt_template: str = "{text}"
    """Format of the policy's input; ``{text}`` is the prompt's text."""
    chat_model: str | None = None
    """A checkpoint folder whose tokenizer's chat template wraps each prompt (where it has one);
    None: the templated text as it is."""
    seed: int = 0
    """Seed of the prompt order."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of ``ToyTask`` or of your factory."""


def prompt_stream(config: DatasetConfig) -> Iterator[Prompt]:
    """An endless iterator of prompts from ``config``, formatted for the policy."""
    if config.source == "toy":
        from forge.data import ToyTask

        source: Iterator[Prompt] = iter(ToyTask(seed=config.seed, **config.options))
    elif config.source == "dataset":
        if config.records is None or not config.records.path:
            raise ValueError("DatasetConfig.records (with a path) is required for source 'dataset'")
        source = PromptEpochs(load_prompts(config.records), config.seed)
    elif ":" in config.source:
        from forge.plugins import import_object

        source = iter(import_object(config.source, "dataset factory", "factory")(seed=config.seed, **config.options))
    else:
        raise ValueError(
            f"DatasetConfig.source must be 'toy', 'dataset' or 'package.module:factory', got {config.source!r}"
        )
    if config.prompt_template == "{text}" and config.chat_model is None:
        return source
    from forge.data.formatting import PromptFormat

    if config.chat_model is None:
        fmt = None
    else:
        fmt = PromptFormat.from_model(config.chat_model, config.prompt_template)

    def formatted(p: Prompt) -> Prompt:
        text = fmt.prompt(p.text) if fmt is not None else config.prompt_template.format(text=p.text)
        # The question as the record holds it: a reward model formats it as it was trained to.
        return dataclasses.replace(p, text=text, meta={**p.meta, QUESTION: p.text})

    return _Formatted(source, formatted)


class _Formatted:
    """A prompt stream with each prompt formatted; ``_seek`` reaches through it to the inner
    stream's O(1) ``seek``, where that has one."""

    def __init__(self, inner: Iterator[Prompt], fn: Any) -> None:
        self.inner, self.fn = inner, fn

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        return self.fn(next(self.inner))


def _seek(stream: Iterator[Prompt], position: int) -> bool:
    """Move ``stream`` to ``position`` in O(1) if it can; False if it must be read up to there."""
    if isinstance(stream, _Formatted):  # as seekable as the stream it formats
        return _seek(stream.inner, position)
    if hasattr(stream, "seek"):
        stream.seek(position)
        return True
    return False


class Dataset(ForgeActor):
    """``sample()`` returns the next prompt; ``sample_many(n)`` the next ``n``.

    ``position()`` is how many prompts were handed out; ``seek(n)`` restarts the stream and
    skips its first ``n`` prompts, so a resumed run continues where the checkpointed one was
    (the stream is deterministic given the config's seed).
    """

    def __init__(self, config: DatasetConfig) -> None:
        self.config = config
        self._prompts: Iterator[Prompt] | None = None
        self.served = 0

    @endpoint
    async def setup(self) -> None:
        self._prompts = prompt_stream(self.config)

    @endpoint
    async def sample(self) -> Prompt:
        self.served += 1
        return next(self._prompts)

    @endpoint
    async def sample_many(self, n: int) -> list[Prompt]:
        self.served += n
        return [next(self._prompts) for _ in range(n)]

    @endpoint
    async def position(self) -> int:
        """Prompts handed out since the stream began."""
        return self.served

    @endpoint
    async def seek(self, position: int) -> None:
        """Restart the stream and skip its first ``position`` prompts (O(1) for the ``dataset``
        source; other streams are read up to there)."""
        if position < 0:
            raise ValueError(f"Dataset.seek position must be >= 0, got {position}")
        self._prompts = prompt_stream(self.config)
        if not _seek(self._prompts, position):
            for _ in range(position):
                next(self._prompts)
        self.served = position
