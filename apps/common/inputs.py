"""What a run needs ready before any role starts: the model's checkpoint (the tiny model made on
the fly where the config asks), a tokenizer that fits it, and the task's records (written where
the config asks, read as ``forge.data.DataSource`` says)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from apps.common.config import settings

__all__ = ["check_tokenizer", "make_model", "prepare_data", "records_source"]

if TYPE_CHECKING:
    from apps.common.config import ModelSection, RecordsSection
    from forge.data.datasets import DataSource


def make_model(section: ModelSection) -> Path:
    """The ``model`` section's checkpoint folder; the tiny model is made there first if the
    section asks for it (``tiny.make_if_missing``)."""
    path = Path(section.path)
    if section.tiny.make_if_missing:
        from forge.models import make_tiny_model

        t = section.tiny
        make_tiny_model(
            path,
            arch=t.arch,
            hidden_size=t.hidden_size,
            num_layers=t.num_layers,
            seed=t.seed,
            init_std=t.init_std,
            chat_template=t.chat_template,
        )
    elif not path.is_dir():
        raise FileNotFoundError(f"model.path {str(path)!r} is not a folder; point it at a Hugging Face checkpoint")
    check_tokenizer(path, section.tokenizer)
    return path


def check_tokenizer(model_path: Path, expected: str = "") -> None:
    """``model_path``'s tokenizer fits its embeddings and, if ``expected`` names a folder, is the
    same as that folder's (vocabulary, special tokens, chat template); a ``ValueError`` naming
    both otherwise. A checkpoint trained with another tokenizer reads every prompt as other tokens."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
    if len(tokenizer) > rows:
        raise ValueError(
            f"model.path {str(model_path)!r}: its tokenizer has {len(tokenizer)} tokens but its embeddings only "
            f"{rows} rows; the tokenizer is not the model's"
        )
    if not expected:
        return
    other = AutoTokenizer.from_pretrained(expected)
    mine, theirs = tokenizer.get_vocab(), other.get_vocab()
    differences = [f"{len(mine)} tokens vs {len(theirs)}"] if len(mine) != len(theirs) else []
    differences += [f"{t!r} is id {mine[t]} vs {theirs.get(t)}" for t in sorted(mine) if mine[t] != theirs.get(t)][:3]
    for name in ("eos_token", "pad_token", "bos_token", "chat_template"):
        if getattr(tokenizer, name, None) != getattr(other, name, None):
            differences.append(f"{name} {getattr(tokenizer, name, None)!r} vs {getattr(other, name, None)!r}")
    if differences:
        raise ValueError(
            f"model.path {str(model_path)!r} has another tokenizer than model.tokenizer {expected!r}: "
            + "; ".join(differences[:4])
            + ". Train the checkpoint from that tokenizer's model, or point model.tokenizer at its own"
        )


def prepare_data(section: RecordsSection) -> None:
    """Write a generated task's records at ``section.path`` if it names one and nothing is there
    (``data.make_if_missing``)."""
    if section.make_if_missing and section.path:
        from forge.data.arithmetic import make_task_data

        make_task_data(section.path, dict(section.make_if_missing))


def records_source(section: DataSource) -> DataSource:
    """The ``forge.data.DataSource`` fields of a config section (a ``data`` or ``eval.data``)."""
    from forge.data.datasets import DataSource

    return DataSource(**settings(section, DataSource))
