"""Read prompts from local JSONL files such as GSM8K's ``train.jsonl`` (one object a line)."""

from __future__ import annotations

import json
from pathlib import Path

from forge.types import Prompt


class DatasetFormatError(ValueError):
    """A dataset file is not what the reader expects; the message names file and line."""


def read_jsonl_prompts(path: str | Path, question_key: str = "question", answer_key: str = "answer") -> list[Prompt]:
    """Every record of ``path`` as a ``Prompt`` (text from ``question_key``, answer from ``answer_key``).

    Blank lines are skipped. ``prompt_id`` is ``"<file stem>-<line number>"`` so a prompt can be
    traced back to its source line; ``meta`` holds ``source``, ``line`` and the record's other
    fields. Answers that are numbers are turned into strings; a question must be a string.
    Any malformed line raises ``DatasetFormatError`` naming the file and line, rather than
    being skipped: a silently shrunken dataset is harder to notice than an error.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetFormatError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DatasetFormatError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
            for key in (question_key, answer_key):
                if key not in record:
                    raise DatasetFormatError(f"{where}: missing key {key!r}; the record has keys {sorted(record)}")
            question, answer = record[question_key], record[answer_key]
            if not isinstance(question, str):
                raise DatasetFormatError(f"{where}: {question_key!r} must be a string, got {type(question).__name__}")
            if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
                raise DatasetFormatError(
                    f"{where}: {answer_key!r} must be a string or number, got {type(answer).__name__}"
                )
            extra = {k: v for k, v in record.items() if k not in (question_key, answer_key)}
            prompts.append(
                Prompt(
                    prompt_id=f"{path.stem}-{lineno}",
                    text=question,
                    answer=str(answer),
                    meta={**extra, "source": str(path), "line": lineno},
                )
            )
    if not prompts:
        raise DatasetFormatError(f"{path}: contains no records")
    return prompts
