"""Preference pairs from local files: a prompt, the response preferred and the one rejected.

The records are TRL's preference format (``prompt``, ``chosen``, ``rejected``, each a string;
the field names are settings), read through ``forge.data.datasets`` like every other split, so
paths, splits and ``held_out_fraction`` mean the same as for question/answer records. A reward
model learns to score ``chosen`` above ``rejected`` (``apps.rm``); DPO learns the preference
directly (``apps.dpo``).

A pair whose chosen text equals its rejected one teaches nothing and, in a pairwise accuracy,
counts as a coin flip: it is skipped, and one warning gives how many were.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from forge.data.datasets import DataError, DataSource, load_split

__all__ = ["PreferenceKeys", "PreferencePair", "load_preference_pairs", "pairs_from_samples", "write_preference_pairs"]

logger = logging.getLogger("forge.data")


@dataclass(frozen=True)
class PreferenceKeys:
    """The fields of a preference record."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


@dataclass(frozen=True)
class PreferencePair:
    """One preference: for ``prompt``, the response ``chosen`` is better than ``rejected``."""

    pair_id: str
    prompt: str
    chosen: str
    rejected: str


def load_preference_pairs(source: DataSource, keys: PreferenceKeys = PreferenceKeys()) -> list[PreferencePair]:
    """Every usable pair of ``source``'s split, in file order; ``pair_id`` is
    ``<name>-<split>-<index>`` (the record's index). A missing field, a value that is not a
    string (a conversation, a number) or a split with no usable pair is a ``DataError`` naming
    the path, the split and the field."""
    fields = {"prompt_key": keys.prompt, "chosen_key": keys.chosen, "rejected_key": keys.rejected}
    records = load_split(source, fields)
    columns = [records[key] for key in fields.values()]
    stem = Path(source.path).name.split(".")[0]
    pairs: list[PreferencePair] = []
    same = 0
    for i, values in enumerate(zip(*columns)):
        for key, value in zip(fields.values(), values):
            if not isinstance(value, str):
                raise DataError(
                    f"{source.path} (split {source.split!r}) record {i}: field {key!r} is a {type(value).__name__}, "
                    "expected a string (the text of the prompt or response)"
                )
        prompt, chosen, rejected = values
        if chosen == rejected:
            same += 1
            continue
        pairs.append(PreferencePair(f"{stem}-{source.split}-{i}", prompt, chosen, rejected))
    if same:
        logger.warning(
            "%s (split %r): skipped %d of %d pairs whose %r equals their %r (nothing to prefer)",
            source.path,
            source.split,
            same,
            len(records),
            keys.chosen,
            keys.rejected,
        )
    if not pairs:
        raise DataError(f"{source.path} (split {source.split!r}) holds no pair whose chosen and rejected differ")
    return pairs


def pairs_from_samples(records: list[dict], correct_at: float = 1.0) -> list[dict]:
    """Preference pairs from a policy's own judged samples (``forge.evaluation.judged_samples``):
    for each question, every distinct completion whose reward is below ``correct_at`` is rejected
    in favour of a correct one (a correct sample's text, written as the policy writes it, else the
    reference answer). A reward model trained on them learns to reject the mistakes the policy
    makes, not only the ones a generator thought of: the on-policy negatives of RLHF recipes."""
    pairs = []
    for record in records:
        completions = record["completions"]
        right = [c["text"] for c in completions if c["reward"] >= correct_at]
        chosen = right[0] if right else record["answer"]
        wrong = dict.fromkeys(c["text"] for c in completions if c["reward"] < correct_at and c["text"] != chosen)
        pairs += [
            {"prompt": record["question"], "chosen": chosen, "rejected": text, "answer": record["answer"]}
            for text in wrong
        ]
    return pairs


def write_preference_pairs(folder: str | Path, splits: dict[str, list[dict]]) -> Path:
    """Write each split's pairs as ``<split>.jsonl`` in ``folder`` (TRL's preference format, plus
    the answer a checker reads), atomically; returns the folder."""
    import json

    from forge.staging import staged_folder

    for name, pairs in splits.items():
        if not pairs:
            raise DataError(f"split {name!r} has no preference pair (the policy made no mistake to reject?)")
    with staged_folder(Path(folder), prefix=".tmp_data_") as tmp:
        for name, pairs in splits.items():
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    return Path(folder)
