"""Records from local files through Hugging Face ``datasets``: every format, splits, keys, errors."""

import json

import pytest

from forge.data import HELD_OUT, DataError, DataSource, PromptEpochs, load_prompts, load_split
from forge.data.arithmetic import addition_record, make_task_data, write_addition

GSM8K = [
    {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
    {"question": "What is 3*3?", "answer": "#### 9", "level": 1},
    {"question": "Half of 10?", "answer": "#### 5"},
]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _write(folder, fmt, records, name="train"):
    """``records`` in ``fmt`` (json lines, a JSON list, parquet, csv, save_to_disk) under ``folder``."""
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    table = datasets.Dataset.from_list(records)
    if fmt == "jsonl":
        return _jsonl(folder / f"{name}.jsonl", records)
    if fmt == "json":
        path = folder / f"{name}.json"
        path.write_text(json.dumps(records))
        return path
    if fmt == "parquet":
        table.to_parquet(str(folder / f"{name}.parquet"))
        return folder / f"{name}.parquet"
    if fmt == "csv":
        table.to_csv(str(folder / f"{name}.csv"), index=False)
        return folder / f"{name}.csv"
    table.save_to_disk(str(folder / "disk"))
    return folder / "disk"


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "disk"])
def test_every_format_reads_the_same_prompts(tmp_path, fmt):
    """jsonl, a JSON list, parquet, csv and a save_to_disk folder give the same prompts, in file order."""
    records = [{"question": r["question"], "answer": r["answer"]} for r in GSM8K]
    prompts = load_prompts(DataSource(path=str(_write(tmp_path, fmt, records))))
    assert [(p.text, p.answer) for p in prompts] == [(r["question"], r["answer"]) for r in records]
    assert prompts[0].prompt_id.endswith("-train-0")


def test_gsm8k_records_work_as_they_are_and_the_reward_reads_them(tmp_path):
    """GSM8K's own fields and '#### N' answers; the gsm8k reward scores against them."""
    from forge.data import gsm8k_reward

    prompts = load_prompts(DataSource(path=str(_jsonl(tmp_path / "train.jsonl", GSM8K))))
    assert prompts[0].answer == "2+2=4\n#### 4"
    assert gsm8k_reward(prompts[1], "so it is 9") == 1.0 and gsm8k_reward(prompts[1], "8") == 0.0


def test_field_names_are_configurable_and_numbers_become_strings(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"problem": "p", "solution": 42}])
    (prompt,) = load_prompts(DataSource(path=str(path), question_key="problem", answer_key="solution"))
    assert (prompt.text, prompt.answer) == ("p", "42")


def test_a_folder_of_files_has_one_split_per_file_name(tmp_path):
    """train.jsonl and test.jsonl in one folder are the splits 'train' and 'test'."""
    _jsonl(tmp_path / "train.jsonl", GSM8K[:2])
    _jsonl(tmp_path / "test.jsonl", GSM8K[2:])
    assert [p.text for p in load_prompts(DataSource(path=str(tmp_path), split="test"))] == ["Half of 10?"]
    assert len(load_prompts(DataSource(path=str(tmp_path)))) == 2


def test_a_held_out_fraction_splits_train_without_overlap_and_is_seeded(tmp_path):
    """held_out is a seeded share of train; train is the rest; the two never share a record."""
    path = _jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "answer": str(i)} for i in range(200)])
    source = {"path": str(path), "held_out_fraction": 0.1, "held_out_seed": 3}
    held = {p.text for p in load_prompts(DataSource(**source, split=HELD_OUT))}
    train = {p.text for p in load_prompts(DataSource(**source))}
    assert len(held) == 20 and len(train) == 180 and not held & train
    again = {p.text for p in load_prompts(DataSource(**source, split=HELD_OUT))}
    other = {p.text for p in load_prompts(DataSource(**{**source, "held_out_seed": 4}, split=HELD_OUT))}
    assert again == held and other != held


def test_a_missing_path_is_an_error_naming_it(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl.*does not exist"):
        load_split(DataSource(path=str(tmp_path / "nope.jsonl")))


def test_an_absent_key_is_an_error_naming_the_file_the_key_and_the_fields(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "a", "solution": "1"}])
    with pytest.raises(DataError, match=r"d\.jsonl.*no field 'answer' \(answer_key\).*question, solution"):
        load_split(DataSource(path=str(path)))


def test_an_absent_split_is_an_error_naming_the_splits_there(tmp_path):
    _jsonl(tmp_path / "train.jsonl", GSM8K)
    with pytest.raises(DataError, match="no split 'test'; it has train"):
        load_split(DataSource(path=str(tmp_path), split="test"))
    with pytest.raises(DataError, match="held_out_fraction is 0"):
        load_split(DataSource(path=str(tmp_path), split=HELD_OUT))


def test_an_empty_dataset_is_an_error(tmp_path):
    """An empty file, or a save_to_disk dataset of no records, is refused naming it."""
    import datasets

    records = datasets.Dataset.from_dict({"question": ["a"], "answer": ["1"]}).filter(lambda r: False)
    records.save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="empty.*holds no records"):
        load_split(DataSource(path=str(tmp_path / "empty")))
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"e\.jsonl holds no records"):
        load_split(DataSource(path=str(tmp_path / "e.jsonl")))


def test_an_unknown_file_format_is_an_error(tmp_path):
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(DataError, match=r"unknown data format '\.txt'"):
        load_split(DataSource(path=str(tmp_path / "d.txt")))


def test_epochs_reshuffle_and_seek_lands_where_reading_would(tmp_path):
    """Each epoch is a new permutation of all prompts; position n reached by seek equals reading n."""
    prompts = load_prompts(
        DataSource(path=str(_jsonl(tmp_path / "d.jsonl", [{"question": str(i), "answer": "a"} for i in range(50)])))
    )
    stream = PromptEpochs(prompts, seed=1)
    first, second = [p.text for p in stream.take(50)], [p.text for p in stream.take(50)]
    assert sorted(first) == sorted(second) == sorted(p.text for p in prompts) and first != second
    assert stream.epoch == 2
    jumped = PromptEpochs(prompts, seed=1)
    jumped.seek(73)
    read = PromptEpochs(prompts, seed=1)
    read.take(73)
    assert [p.text for p in jumped.take(10)] == [p.text for p in read.take(10)]


def test_the_addition_task_holds_out_pairs_and_answers_reversed(tmp_path):
    """The written splits never share an operand pair; answers are the zero-padded sum reversed."""
    assert addition_record(123, 456, 3) == {"question": "123+456=", "answer": "9750"}
    assert addition_record(999, 999, 3)["answer"] == "8991"
    assert addition_record(123, 456, 3, reversed_operands=True) == {"question": "321+654=", "answer": "9750"}
    folder = write_addition(tmp_path / "add", digits=2, train_size=500, test_size=100, seed=0)
    train = load_prompts(DataSource(path=str(folder)))
    test = load_prompts(DataSource(path=str(folder), split="test"))
    assert len(train) == 500 and len(test) == 100 and not {p.text for p in train} & {p.text for p in test}
    for p in test[:20]:
        a, b = (int(x) for x in p.text.rstrip("=").split("+"))
        assert p.answer == f"{a + b:03d}"[::-1]
    assert make_task_data(folder, {"task": "addition", "digits": 5}) == folder  # kept: nothing rewritten
    with pytest.raises(ValueError, match="exceeds the 100 distinct 1-digit pairs"):
        write_addition(tmp_path / "small", digits=1, train_size=100, test_size=1)
    with pytest.raises(ValueError, match="make_if_missing.task must be one of addition"):
        make_task_data(tmp_path / "x", {"task": "sorting"})


def test_a_malformed_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n{"question": "b", \n')
    with pytest.raises(DataError, match=r"d\.jsonl: not a readable \.jsonl data file"):
        load_split(DataSource(path=str(path)))
