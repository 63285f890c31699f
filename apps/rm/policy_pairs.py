"""Preference pairs from a policy's own mistakes, for a reward model that is not fooled by them.

    python -m apps.eval.main --config configs/eval_addition.yaml write_samples=true \\
        eval.data.split=train eval.max_prompts=20000 eval.samples=4 logging.output_dir=outputs/samples_train
    python -m apps.eval.main --config configs/eval_addition.yaml write_samples=true \\
        eval.max_prompts=1000 eval.samples=4 logging.output_dir=outputs/samples_test
    python -m apps.rm.policy_pairs --train outputs/samples_train/samples.jsonl \\
        --test outputs/samples_test/samples.jsonl --out data/addition_3d_rev_policy_preferences

A reward model trained only on generated near misses ranks those well, and a policy optimised
against it finds the wrong answers it overrates (reward hacking). Pairs whose rejected side is
what the policy itself wrote wrong, judged by the task's checker (``eval.reward``), teach it the
mistakes the policy makes. The folder is what ``apps.rm``'s ``data.path`` reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from forge.data.preferences import pairs_from_samples, write_preference_pairs


def read_samples(path: str) -> list[dict]:
    """``apps.eval``'s ``samples.jsonl``: one judged question per line."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", required=True, help="samples.jsonl of the training questions")
    parser.add_argument("--test", required=True, help="samples.jsonl of held-out questions")
    parser.add_argument("--out", required=True, help="the preference folder to write (train.jsonl, test.jsonl)")
    parser.add_argument("--correct-at", type=float, default=1.0, help="a completion with this reward or more is right")
    args = parser.parse_args(argv)
    splits = {
        name: pairs_from_samples(read_samples(path), args.correct_at)
        for name, path in (("train", args.train), ("test", args.test))
    }
    folder = write_preference_pairs(args.out, splits)
    print(json.dumps({"folder": str(folder), **{name: len(pairs) for name, pairs in splits.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
