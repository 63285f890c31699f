"""``Dataset``: hands out prompts, with their answers, one at a time.

Sources: ``toy`` (``forge.data.ToyTask``, an endless stream of arithmetic-style prompts a tiny
model can learn on a CPU), ``jsonl`` (``forge.data.read_jsonl_prompts``, e.g. GSM8K, reshuffled
every epoch), or ``"package.module:factory"``, your own ``factory(seed=..., **options)``
returning an iterable of ``Prompt``. ``prompt_template`` formats the text the policy sees (``{text}`` is the
prompt's own text); the answer is left untouched for the reward functions.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from forge.controller import ForgeActor, endpoint
from forge.types import Prompt

__all__ = ["Dataset", "DatasetConfig", "prompt_stream"]


@dataclass(kw_only=True)
class DatasetConfig:
    source: str = "toy"
    """``toy``, ``jsonl`` or ``"package.module:factory"``."""
    path: str | None = None
    """JSONL file (``jsonl`` source)."""
    prompt_template: str = "{text}"
    """Format of the policy's input; ``{text}`` is the prompt's text."""
    seed: int = 0
    """Seed of the prompt order."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of ``ToyTask`` or ``read_jsonl_prompts``."""


def prompt_stream(config: DatasetConfig) -> Iterator[Prompt]:
    """An endless iterator of prompts from ``config`` (templated)."""
    if config.source == "toy":
        from forge.data import ToyTask

        source: Iterator[Prompt] = iter(ToyTask(seed=config.seed, **config.options))
    elif config.source == "jsonl":
        if not config.path:
            raise ValueError("DatasetConfig.path is required for source 'jsonl'")
        source = _epochs(config.path, config.seed, config.options)
    elif ":" in config.source:
        module_name, _, attr = config.source.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        source = iter(factory(seed=config.seed, **config.options))
    else:
        raise ValueError(
            f"DatasetConfig.source must be 'toy', 'jsonl' or 'package.module:factory', got {config.source!r}"
        )
    if config.prompt_template == "{text}":
        return source
    return (dataclasses.replace(p, text=config.prompt_template.format(text=p.text)) for p in source)


def _epochs(path: str, seed: int, options: dict[str, Any]) -> Iterator[Prompt]:
    from forge.data import read_jsonl_prompts

    prompts = list(read_jsonl_prompts(path, **options))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    rng = random.Random(seed)
    while True:
        order = prompts[:]
        rng.shuffle(order)
        yield from order


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
        """Restart the stream and skip its first ``position`` prompts (reads them: O(position))."""
        if position < 0:
            raise ValueError(f"Dataset.seek position must be >= 0, got {position}")
        self._prompts = prompt_stream(self.config)
        for _ in range(position):
            next(self._prompts)
        self.served = position
