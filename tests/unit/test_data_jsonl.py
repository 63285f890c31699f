"""Reading GSM8K-format JSONL files into Prompts, with errors that point at the bad line."""

import json

import pytest

from forge.data import DatasetFormatError, read_jsonl_prompts


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_gsm8k_records_into_prompts(tmp_path):
    """question -> text, answer -> answer (verbatim), id from file stem and line, extras in meta."""
    path = _write(
        tmp_path / "train.jsonl",
        [
            json.dumps({"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}),
            "",
            json.dumps({"question": "What is 3*3?", "answer": "#### 9", "level": 1}),
        ],
    )
    prompts = read_jsonl_prompts(path)
    assert [p.text for p in prompts] == ["What is 2+2?", "What is 3*3?"]
    assert prompts[0].answer == "2+2=4\n#### 4"
    assert [p.prompt_id for p in prompts] == ["train-1", "train-3"]
    assert prompts[1].meta == {"source": str(path), "line": 3, "level": 1}


def test_custom_keys_and_numeric_answers(tmp_path):
    """Other field names work; a numeric answer becomes its string."""
    path = _write(tmp_path / "d.jsonl", [json.dumps({"problem": "p", "solution": 42})])
    (prompt,) = read_jsonl_prompts(str(path), question_key="problem", answer_key="solution")
    assert (prompt.text, prompt.answer) == ("p", "42")


def test_missing_key_names_file_line_and_key(tmp_path):
    """A record without 'answer' on line 2 is reported as <path>:2 with the key and the keys present."""
    records = [json.dumps({"question": "a", "answer": "1"}), json.dumps({"question": "b"})]
    path = _write(tmp_path / "d.jsonl", records)
    with pytest.raises(DatasetFormatError) as info:
        read_jsonl_prompts(path)
    message = str(info.value)
    assert f"{path}:2" in message and "'answer'" in message and "['question']" in message


def test_invalid_json_names_file_and_line(tmp_path):
    """A truncated line is reported with its line number."""
    path = _write(tmp_path / "d.jsonl", [json.dumps({"question": "a", "answer": "1"}), '{"question": "b", '])
    with pytest.raises(DatasetFormatError, match=rf"{path}:2: invalid JSON"):
        read_jsonl_prompts(path)


@pytest.mark.parametrize(
    "line, expected",
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"question": 5, "answer": "1"}', "'question' must be a string"),
        ('{"question": "q", "answer": null}', "'answer' must be a string or number"),
    ],
)
def test_wrongly_typed_records_are_rejected(tmp_path, line, expected):
    """Non-object lines and wrongly typed fields raise with the rule they broke."""
    path = _write(tmp_path / "d.jsonl", [line])
    with pytest.raises(DatasetFormatError, match=expected):
        read_jsonl_prompts(path)


def test_missing_file_is_a_file_not_found_error_naming_it(tmp_path):
    """The path is in the message."""
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_jsonl_prompts(tmp_path / "nope.jsonl")


def test_empty_file_is_an_error(tmp_path):
    """A file with no records is refused rather than yielding an empty dataset."""
    path = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DatasetFormatError, match="no records"):
        read_jsonl_prompts(path)
