"""Multi-digit addition with the sum written reversed: a task where a CPU run shows real learning.

A prompt is ``"123+456="``; its answer is the sum, zero-padded to ``digits + 1`` digits and
written least significant digit first: 123 + 456 = 0579, so ``"9750"``. Reversed, each answer
digit depends on the two operand digits at its place and on the carry of the digit written just
before it, so a small transformer can learn the algorithm instead of a table; forward, the
first digit written would depend on every carry at once. With ``reversed_operands`` the
operands are written least significant digit first as well (``"321+654="`` for 123 + 456):
then the digits to add stand at the same place in both operands and in the answer, and a
transformer finds the alignment several times sooner (``docs/benchmarks.md``).

Why it counts as learning: the held-out operand pairs never appear in training (the split is
made by pair, not by record), there are ``10^(2 * digits)`` pairs (10^6 for 3 digits) so they
cannot be memorised from a few hundred thousand examples, and the reward is exact match of the
whole answer, with no partial credit, length or format shaping. ``write_addition`` writes the
task as ``train.jsonl`` and ``test.jsonl`` (``question``/``answer`` records) that every app
loads through ``forge.data.datasets`` like any other data.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from forge.checks import check_int
from forge.staging import staged_folder

__all__ = ["TASKS", "addition_record", "make_task_data", "near_miss", "write_addition", "write_addition_preferences"]


def addition_record(a: int, b: int, digits: int, reversed_operands: bool = False) -> dict[str, str]:
    """The record of ``a + b``: ``{"question": "aaa+bbb=", "answer": <reversed padded sum>}``;
    with ``reversed_operands`` the operands are written least significant digit first too."""
    x, y = f"{a:0{digits}d}", f"{b:0{digits}d}"
    if reversed_operands:
        x, y = x[::-1], y[::-1]
    return {"question": f"{x}+{y}=", "answer": f"{a + b:0{digits + 1}d}"[::-1]}


def _operand_splits(digits: int, train_size: int, test_size: int, seed: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """``[("test", pairs), ("train", pairs)]``: ``train_size + test_size`` distinct operand pairs
    drawn with ``seed``, the first ``test_size`` of them the test split."""
    for name, value in (("digits", digits), ("train_size", train_size), ("test_size", test_size)):
        check_int(name, value, 1)
    space = 10 ** (2 * digits)
    if train_size + test_size > space:
        raise ValueError(
            f"train_size + test_size ({train_size + test_size}) exceeds the {space} distinct {digits}-digit pairs"
        )
    codes = random.Random(f"forge.addition:{digits}:{seed}").sample(range(space), train_size + test_size)
    operands = [divmod(code, 10**digits) for code in codes]
    return [("test", operands[:test_size]), ("train", operands[test_size:])]


def write_addition(
    folder: str | Path,
    *,
    digits: int = 3,
    train_size: int = 200_000,
    test_size: int = 2_000,
    seed: int = 0,
    reversed_operands: bool = False,
) -> Path:
    """Write ``train.jsonl`` and ``test.jsonl`` of ``digits``-digit additions into ``folder``.

    The operand pairs are drawn without replacement from all ``10^digits x 10^digits`` pairs
    with ``seed``; the first ``test_size`` are the test split, the next ``train_size`` the
    training split, so no test pair is ever trained on. ``reversed_operands`` writes every
    number least significant digit first, so that the digits that are added stand at the same
    place in each operand and in the answer. Written atomically (a finished folder or none).
    Returns the folder.
    """
    with staged_folder(Path(folder), prefix=".tmp_data_") as tmp:
        for name, part in _operand_splits(digits, train_size, test_size, seed):
            lines = (json.dumps(addition_record(a, b, digits, reversed_operands)) for a, b in part)
            (tmp / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return Path(folder)


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer close to ``answer``, the rejected response of a preference pair, drawn from
    ``rng``: half the time one digit changed, a quarter two digits changed, a quarter one digit
    dropped or added (a sampled policy makes all three; a reward model that saw only one kind
    scores the others blindly, and a policy trained on it finds them)."""
    kind = rng.random()
    if kind < 0.25 and len(answer) > 1:
        place = rng.randrange(len(answer))
        if rng.random() < 0.5:
            return answer[:place] + answer[place + 1 :]
        return answer[:place] + rng.choice("0123456789") + answer[place:]
    wrong = answer
    for place in rng.sample(range(len(answer)), 2 if kind < 0.5 and len(answer) > 1 else 1):
        wrong = wrong[:place] + rng.choice([d for d in "0123456789" if d != answer[place]]) + wrong[place + 1 :]
    return wrong


def write_addition_preferences(
    folder: str | Path,
    *,
    digits: int = 3,
    train_size: int = 20_000,
    test_size: int = 1_000,
    seed: int = 0,
    reversed_operands: bool = False,
) -> Path:
    """Write ``train.jsonl`` and ``test.jsonl`` of addition preference pairs into ``folder``.

    Each record is ``{"prompt", "chosen", "rejected", "answer"}`` (TRL's preference format, and
    the answer a checker reads): the prompt and the correct sum of ``addition_record``, preferred
    over a near miss (``near_miss``: one or two digits wrong, or one dropped or added). The operand pairs are drawn as
    ``write_addition`` draws them, with the same ``seed``, so the test pairs here are the test
    pairs of the addition records made with the same settings: a reward model never sees a
    held-out question of the policy it will judge. Written atomically; returns the folder.
    """
    misses = random.Random(f"forge.addition_preferences:{digits}:{seed}")
    with staged_folder(Path(folder), prefix=".tmp_data_") as tmp:
        for name, part in _operand_splits(digits, train_size, test_size, seed):
            lines = []
            for a, b in part:
                record = addition_record(a, b, digits, reversed_operands)
                answer = record["answer"]
                pair = {"prompt": record["question"], "chosen": answer, "rejected": near_miss(answer, misses)}
                lines.append(json.dumps({**pair, "answer": answer}))
            (tmp / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return Path(folder)


TASKS = {"addition": write_addition, "addition_preferences": write_addition_preferences}
"""Generated tasks an app's ``data.make_if_missing`` can name, with their writer."""


def make_task_data(folder: str | Path, spec: dict) -> Path:
    """Write the generated task ``spec`` (``{"task": name, **options}``) into ``folder`` unless
    a dataset is already there; returns the folder."""
    folder = Path(folder)
    if folder.exists():
        return folder
    options = dict(spec)
    task = options.pop("task", None)
    if task not in TASKS:
        raise ValueError(f"make_if_missing.task must be one of {', '.join(TASKS)}, got {task!r}")
    return TASKS[task](folder, **options)
