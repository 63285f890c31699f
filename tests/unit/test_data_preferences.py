"""Preference pairs from files: TRL's format, configurable keys, equal pairs skipped and counted,
bad records named; and the generated addition pairs, whose held-out questions are the task's."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from forge.data import DataError, DataSource, load_prompts
from forge.data.arithmetic import write_addition, write_addition_preferences
from forge.data.preferences import PreferenceKeys, load_preference_pairs


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_pairs_load_with_their_own_keys_and_equal_ones_are_skipped_with_one_warning(tmp_path, caplog):
    path = _write(
        tmp_path / "prefs.jsonl",
        [
            {"q": "1+1=", "good": "2", "bad": "3"},
            {"q": "1+2=", "good": "3", "bad": "3"},
            {"q": "2+2=", "good": "4", "bad": "4"},
            {"q": "2+3=", "good": "5", "bad": "6"},
        ],
    )
    with caplog.at_level(logging.WARNING, logger="forge.data"):
        pairs = load_preference_pairs(DataSource(path=str(path)), PreferenceKeys("q", "good", "bad"))
    assert [(p.pair_id, p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ("prefs-train-0", "1+1=", "2", "3"),
        ("prefs-train-3", "2+3=", "5", "6"),
    ]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "skipped 2 of 4 pairs whose 'good' equals their 'bad'" in warnings[0]


def test_a_missing_key_a_non_string_and_nothing_to_prefer_are_named(tmp_path):
    path = _write(tmp_path / "a.jsonl", [{"prompt": "x", "chosen": "y"}])
    with pytest.raises(DataError, match=r"no field 'rejected' \(rejected_key\)"):
        load_preference_pairs(DataSource(path=str(path)))
    path = _write(tmp_path / "b.jsonl", [{"prompt": "x", "chosen": [{"role": "assistant"}], "rejected": "z"}])
    with pytest.raises(DataError, match=r"record 0: field 'chosen' is a list, expected a string"):
        load_preference_pairs(DataSource(path=str(path)))
    path = _write(tmp_path / "c.jsonl", [{"prompt": "x", "chosen": "y", "rejected": "y"}])
    with pytest.raises(DataError, match="holds no pair whose chosen and rejected differ"):
        load_preference_pairs(DataSource(path=str(path)))


def test_addition_preferences_prefer_the_sum_over_a_near_miss_on_the_tasks_own_split(tmp_path):
    options = {"digits": 3, "train_size": 300, "test_size": 50, "seed": 2, "reversed_operands": True}
    write_addition(tmp_path / "task", **options)
    write_addition_preferences(tmp_path / "prefs", **options)
    questions = load_prompts(DataSource(path=str(tmp_path / "task"), split="test"))
    pairs = load_preference_pairs(DataSource(path=str(tmp_path / "prefs"), split="test"))
    assert [p.prompt for p in pairs] == [q.text for q in questions]  # the held-out questions, in order
    kinds = set()
    for pair, question in zip(pairs, questions):
        assert pair.chosen == question.answer and pair.rejected != pair.chosen and pair.rejected.isdigit()
        if len(pair.rejected) != len(pair.chosen):
            kinds.add("length")
            assert abs(len(pair.rejected) - len(pair.chosen)) == 1
        else:
            wrong = sum(a != b for a, b in zip(pair.chosen, pair.rejected))
            assert wrong in (1, 2)
            kinds.add(wrong)
    assert kinds == {1, 2, "length"}  # every kind of miss a sampled policy makes


def test_a_policys_judged_samples_become_pairs_of_a_right_answer_over_each_distinct_mistake(tmp_path):
    from forge.data.preferences import pairs_from_samples, write_preference_pairs

    records = [
        {  # a right sample is the chosen side, as the policy writes it; the two mistakes once each
            "question": "1+1=",
            "answer": "2",
            "completions": [
                {"text": "2 ", "reward": 1.0},
                {"text": "3", "reward": 0.0},
                {"text": "3", "reward": 0.0},
                {"text": "4", "reward": 0.5},
            ],
        },
        {"question": "2+2=", "answer": "4", "completions": [{"text": "5", "reward": 0.0}]},  # no right sample
        {"question": "3+3=", "answer": "6", "completions": [{"text": "6", "reward": 1.0}]},  # no mistake
    ]
    pairs = pairs_from_samples(records)
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [
        ("1+1=", "2 ", "3"),
        ("1+1=", "2 ", "4"),
        ("2+2=", "4", "5"),
    ]
    assert [p["rejected"] for p in pairs_from_samples(records, correct_at=0.5)] == ["3", "5"]
    folder = write_preference_pairs(tmp_path / "prefs", {"train": pairs, "test": pairs[:1]})
    loaded = load_preference_pairs(DataSource(path=str(folder), split="train"))
    assert [(p.prompt, p.chosen, p.rejected) for p in loaded] == [
        (p["prompt"], p["chosen"], p["rejected"]) for p in pairs
    ]
    with pytest.raises(DataError, match="split 'test' has no preference pair"):
        write_preference_pairs(tmp_path / "none", {"train": pairs, "test": []})
