"""Question/answer records from local files, through Hugging Face ``datasets``.

One ``DataSource`` names where the records are and which of them to use:

- ``path``: a ``.jsonl``/``.json``/``.parquet``/``.csv`` file (its records are the split
  ``train``), a folder of such files (``datasets`` names the splits by the files' names:
  ``train.jsonl``, ``test.parquet``, ...), or a folder written by ``save_to_disk``;
- ``split``: a split the files have, or ``held_out``: the ``held_out_fraction`` of ``train``
  set aside with ``held_out_seed`` (``train`` is then the rest, so the two never overlap);
- ``question_key``/``answer_key``: the fields holding the prompt and its reference answer.

GSM8K's own files work as they are (``question``; ``answer`` ending in ``#### N``, which the
``gsm8k`` reward reads). Everything is checked when the source is loaded, before any role
starts: a missing path, an unknown split, an absent key or an empty split is a ``DataError``
naming the path, the split and the key. Nothing is downloaded: ``datasets`` only reads the
local files (and keeps its Arrow cache of them).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from forge.types import Prompt

if TYPE_CHECKING:
    import datasets

__all__ = ["FORMATS", "HELD_OUT", "DataError", "DataSource", "PromptEpochs", "load_prompts", "load_split"]

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffix -> the ``datasets`` builder that reads it."""
HELD_OUT = "held_out"
"""The split name of the ``held_out_fraction`` set aside from ``train``."""


class DataError(ValueError):
    """A dataset is missing, empty, or lacks the split or key the config names."""


@dataclass(kw_only=True)
class DataSource:
    """Where a run's records come from and which of them it uses."""

    path: str = ""
    """A data file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``), a folder of them (one split per
    file name: ``train``, ``test``, ...) or a ``save_to_disk`` folder."""
    split: str = "train"
    """The split to use, or ``held_out`` for the ``held_out_fraction`` of ``train``."""
    question_key: str = "question"
    """The field with the prompt's text."""
    answer_key: str = "answer"
    """The field with the reference answer (what rewards, evaluation and SFT targets read)."""
    held_out_fraction: float = 0.0
    """Share of ``train`` set aside as the split ``held_out`` (0: none); ``train`` is the rest."""
    held_out_seed: int = 0
    """Seed of the held-out draw (not the run's seed: the held-out set stays the same across runs)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}")


def load_split(source: DataSource, keys: dict[str, str] | None = None) -> datasets.Dataset:
    """The records ``source`` names, checked: the split exists, has the keys and is not empty.

    ``keys``: the fields every record needs, by the setting that names each (a ``DataError``
    names the setting); by default ``question_key`` and ``answer_key``."""
    splits = _load_splits(source)
    name = source.split
    if source.held_out_fraction > 0:
        if "train" not in splits:
            raise DataError(f"{source.path}: held_out_fraction needs a 'train' split; it has {sorted(splits)}")
        if name in ("train", HELD_OUT):
            parts = splits["train"].train_test_split(test_size=source.held_out_fraction, seed=source.held_out_seed)
            splits = {**splits, "train": parts["train"], HELD_OUT: parts["test"]}
    elif name == HELD_OUT:
        raise DataError(
            f"{source.path}: split {HELD_OUT!r} is the held_out_fraction of 'train', but held_out_fraction is 0; "
            "set it (e.g. 0.05) or name one of the splits the data has: " + ", ".join(sorted(splits))
        )
    if name not in splits:
        raise DataError(f"{source.path}: no split {name!r}; it has {', '.join(sorted(splits))}")
    records = splits[name]
    if keys is None:
        keys = {"question_key": source.question_key, "answer_key": source.answer_key}
    for what, key in keys.items():
        if key not in records.column_names:
            raise DataError(
                f"{source.path} (split {name!r}): no field {key!r} ({what}); its fields are "
                + ", ".join(records.column_names)
            )
    if len(records) == 0:
        raise DataError(f"{source.path} (split {name!r}) holds no records")
    return records


def load_prompts(source: DataSource) -> list[Prompt]:
    """Every record of ``source`` as a ``Prompt`` (text and answer as strings), in file order.

    ``prompt_id`` is ``<name>-<split>-<index>``, so a prompt can be traced back to its record.
    """
    records = load_split(source)
    questions = records[source.question_key]
    answers = records[source.answer_key]
    stem = Path(source.path).name.split(".")[0]
    return [
        Prompt(prompt_id=f"{stem}-{source.split}-{i}", text=str(q), answer=str(a), meta={"index": i})
        for i, (q, a) in enumerate(zip(questions, answers))
    ]


class PromptEpochs:
    """The prompts of a source forever, reshuffled every epoch; position ``n`` is O(1) to reach.

    Epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so a resumed run that seeks to
    the position its checkpoint recorded sees exactly the prompts the first run would have seen.
    """

    def __init__(self, prompts: list[Prompt], seed: int = 0) -> None:
        if not prompts:
            raise DataError("PromptEpochs needs at least one prompt")
        self.prompts = prompts
        self.seed = seed
        self.position = 0
        self._epoch = -1
        self._order: list[int] = []

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            order = list(range(len(self.prompts)))
            random.Random(f"forge.epochs:{self.seed}:{epoch}").shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order

    def seek(self, position: int) -> None:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        self.position = position

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (crossing into the next epoch, reshuffled, when one ends)."""
        return [next(self) for _ in range(n)]

    @property
    def epoch(self) -> int:
        return self.position // len(self.prompts)

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        epoch, index = divmod(self.position, len(self.prompts))
        self.position += 1
        return self.prompts[self._order_of(epoch)[index]]


def _load_splits(source: DataSource) -> dict[str, datasets.Dataset]:
    """Every split at ``source.path``, by name."""
    import datasets

    path = Path(source.path)
    if not source.path or not path.exists():
        raise DataError(
            f"data path {source.path!r} does not exist; expected a {'/'.join(FORMATS)} file, a folder of them, "
            "or a folder written by datasets' save_to_disk"
        )
    datasets.disable_progress_bars()
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        loaded = datasets.load_from_disk(str(path))
        return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    if path.is_file():
        if path.suffix.lower() not in FORMATS:
            raise DataError(f"{path}: unknown data format {path.suffix!r}; expected one of {', '.join(FORMATS)}")
        return {"train": _load_file(path)}
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in FORMATS)
    if not files:
        raise DataError(f"{path}: a folder with no {'/'.join(FORMATS)} file and no save_to_disk dataset")
    by_split: dict[str, Path] = {}
    for file in files:
        name = file.name.split(".")[0]
        if name in by_split:
            raise DataError(f"{path}: two files for split {name!r} ({by_split[name].name}, {file.name}); keep one")
        by_split[name] = file
    # One file at a time: splits may have different extra fields (datasets would cast them to one).
    return {name: _load_file(file) for name, file in by_split.items()}


def _load_file(path: Path) -> datasets.Dataset:
    """One data file's records; a file ``datasets`` cannot parse is a ``DataError`` naming it."""
    import datasets

    with open(path, "rb") as f:
        if not f.read(4096).strip():  # datasets' readers fail on an empty file with a bare StopIteration
            raise DataError(f"{path} holds no records")
    try:
        return datasets.load_dataset(FORMATS[path.suffix.lower()], data_files={"train": str(path)}, split="train")
    except datasets.exceptions.DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        raise DataError(f"{path}: not a readable {path.suffix} data file: {cause}") from exc
