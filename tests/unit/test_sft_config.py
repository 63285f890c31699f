"""The SFT app's config refuses, naming the setting, what would fail or mislead only mid-run."""

from __future__ import annotations

import pytest

from apps.common.config import OptimizerSection, RecordsSection
from apps.sft.config import SFTConfig, SFTEvalSection


def _config(**kwargs) -> SFTConfig:
    return SFTConfig(**{"data": RecordsSection(path="data/addition"), **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 6, "trainer": OptimizerSection(procs=4)}, r"\(4\) must divide batch_size \(6\)"),
        ({"data": RecordsSection()}, "data.path is required"),
        ({"eval": SFTEvalSection(every=-1)}, "eval.every must be >= 0"),
        ({"eval": SFTEvalSection(stop_at_accuracy=0.5)}, "stop_at_accuracy needs eval.generate and eval.every > 0"),
        ({"eval": SFTEvalSection(every=5, generate=False, stop_at_accuracy=0.5)}, "needs eval.generate"),
        ({"eval": SFTEvalSection(every=5, stop_at_accuracy=1.5)}, r"stop_at_accuracy must be in \[0, 1\]"),
        ({"eval": SFTEvalSection(reward={})}, "eval.reward needs at least one reward function"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_them(kwargs: dict, message: str) -> None:
    """A batch the trainer ranks cannot split, no data, a negative interval, early stopping on an
    accuracy that is never measured or cannot be reached, or no reward to judge completions."""
    with pytest.raises(ValueError, match=message):
        _config(**kwargs)


def test_a_batch_the_ranks_split_evenly_and_stopping_at_a_measured_accuracy_are_accepted() -> None:
    cfg = _config(
        batch_size=8, trainer=OptimizerSection(procs=2, hosts=2), eval=SFTEvalSection(every=5, stop_at_accuracy=0.2)
    )
    assert cfg.checkpoint_dir.endswith("checkpoints")


def test_a_held_out_batch_is_cut_to_the_trainers_ranks_and_too_few_records_are_refused():
    """SFT's held-out loss batch and the preference apps' held-out pairs: equal shares per rank."""
    from types import SimpleNamespace

    from apps.common.config import rank_shares

    cfg = SimpleNamespace(trainer=SimpleNamespace(procs=2, hosts=2))
    assert rank_shares(list(range(10)), cfg, "pairs") == list(range(8))
    with pytest.raises(ValueError, match="the held-out split has 3 records, fewer than the trainer's 4 ranks"):
        rank_shares([1, 2, 3], cfg, "records")
