"""SFT, held-out evaluation and GRPO from the SFT model, end to end, as a user runs them:
``python -m apps.sft.main``, ``python -m apps.eval.main`` and ``python -m apps.grpo.main`` in
subprocesses, on a generated addition task and a tiny model, each shrunk to a few steps.

One SFT run and its resume (a module fixture) serve every test of it: the resume's data and
steps, the evaluated weights, the held-out loss it gains, and the final model in the evaluation
and GRPO apps. The figures are checked against what transformers computes from the same files."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from app_runs import REPO, finish_app, start_app

from forge.data import DataSource, PromptFormat, load_prompts
from forge.generation.weight_folder import RUN_PREFIX
from forge.types import Prompt
from tests.numerics import assert_close_to_scale

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(240)

TASK = "{task: addition, digits: 2, train_size: 2000, test_size: 200}"
LOSS_EXAMPLES = 32
"""eval.loss_examples of the SFT runs: the fixed held-out batch whose loss they report."""
GAIN_FLOOR = 0.7
"""Least fall of that loss over 6 steps, in nats: half of what runs show (4.09 -> 2.70)."""
ACCURACY_CEILING = 0.1
"""Most held-out greedy accuracy a 6-step model of 2-digit addition shows (0 in runs)."""
TIE_GAP = 1e-3
"""Top-two logit gap under which a greedy token could differ between two float32 kernels."""


def _run(app: str, config: str, tmp_path: Path, *overrides: str, timeout: float = 180) -> tuple[int, str, str]:
    args = [sys.executable, "-m", f"apps.{app}.main", "--config", config, *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return finish_app(proc, timeout)


def _sft(tmp_path: Path, *overrides: str, timeout: float = 180) -> tuple[int, str, str]:
    """The SFT app on the addition config, shrunk: a 1-layer 64-wide model, 2-digit sums."""
    return _run(
        "sft",
        "configs/sft_addition.yaml",
        tmp_path,
        f"model.path={tmp_path / 'tiny'}",
        "model.tiny.hidden_size=64",
        "model.tiny.num_layers=1",
        f"data.path={tmp_path / 'data'}",
        f"data.make_if_missing={TASK}",
        f"logging.output_dir={tmp_path / 'sft'}",
        "logging.progress_bar=false",
        f"weight_sync.dir={tmp_path / 'weights'}",
        "batch_size=16",
        "eval.max_prompts=40",
        f"eval.loss_examples={LOSS_EXAMPLES}",
        "eval.max_tokens=4",
        "policy.max_tokens=4",
        "eval.stop_at_accuracy=0",
        "trainer.num_threads=1",
        "trainer.warmup_steps=0",
        "trainer.lr=3e-3",
        *overrides,
        timeout=timeout,
    )


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@dataclass
class SFTRuns:
    """One SFT run of 4 steps, killed (its step-4 checkpoint gone), resumed from step 2 to step 6."""

    root: Path
    first: list[dict]
    """The first run's rows (steps 1-4)."""
    rows: list[dict]
    """metrics.jsonl after the resumed run: steps 1-2 of the first run, 3-6 of the resumed one."""
    out: str
    """The resumed run's stdout."""

    @property
    def model(self) -> Path:
        return self.root / "sft" / "final_model"


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory: pytest.TempPathFactory) -> SFTRuns:
    """SFT: 4 steps with packed sequences on one rank, checkpoints at steps 2 and 4; the step-4
    checkpoint is removed (the run was killed while writing it); then ``--resume`` on a two-rank
    FSDP2 trainer (the one-rank checkpoint reshards) continues from step 2 to step 6. Held-out
    loss and greedy accuracy every 3 steps and at each run's last."""
    root = tmp_path_factory.mktemp("sft_runs")
    common = ("eval.every=3", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3")
    code, out, err = _sft(root, "steps=4", *common, "trainer.pack_sequences=true")
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    first = _rows(root / "sft")
    checkpoints = root / "sft" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002", "step_00000004"]
    shutil.rmtree(checkpoints / "step_00000004")
    code, out, err = _sft(root, "steps=6", *common, "trainer.procs=2", "--resume")
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    return SFTRuns(root, first, _rows(root / "sft"), out)


def test_a_resumed_sft_run_repeats_the_uninterrupted_runs_steps_on_the_same_data(sft_runs: SFTRuns) -> None:
    """Resumed from step 2, steps 3 and 4 take the batches (data position), weights and optimizer
    state the uninterrupted run had: the same losses and gradient norms, and the same held-out
    figures at step 3; then it goes on to step 6 and exports its final model."""
    rows, first = sft_runs.rows, sft_runs.first
    assert [r["step"] for r in first] == [1, 2, 3, 4] and [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[:2] == first[:2]  # the first run's rows up to the checkpoint are kept
    for name in ("loss", "grad_norm"):
        # Two ranks unpacked vs one rank packed: the same sums in another order.
        assert_close_to_scale([r[name] for r in rows[2:4]], [r[name] for r in first[2:4]], 1e-4, what=name)
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["eval/step"] for r in evals] == [3, 6]  # every 3 steps and the run's last
    assert_close_to_scale(evals[0]["eval/loss"], first[2]["eval/loss"], 1e-4, what="eval/loss at step 3")
    # The same weights' greedy completions: the same figures, exactly.
    for name in ("eval/accuracy", "eval/length_mean", "eval/prompts"):
        assert evals[0][name] == first[2][name], name
    assert "sft: 6 steps" in sft_runs.out and "held-out loss" in sft_runs.out
    assert (sft_runs.model / "model.safetensors").is_file() and (sft_runs.root / "sft" / "loss.png").is_file()
    # The file transport's weight folder of each run is removed when it ends (RunResources.close).
    weights = sft_runs.root / "weights"
    assert weights.is_dir() and list(weights.glob(f"{RUN_PREFIX}*")) == []


def test_sft_evaluates_the_weights_of_the_step_it_reports(sft_runs: SFTRuns) -> None:
    """Every evaluation's completions come from the policy at the version of its step (the weights
    were synced first), and the last one's held-out loss is final_model's, recomputed here."""
    evals = [r for r in sft_runs.first + sft_runs.rows if "eval/loss" in r]
    assert [(r["eval/policy_version"], r["eval/policy_version_max"]) for r in evals] == [
        (r["eval/step"], r["eval/step"]) for r in evals
    ]
    assert_close_to_scale(
        evals[-1]["eval/loss"], _nll(sft_runs.root, "sft/final_model"), 1e-4, what="eval/loss at step 6"
    )


def test_sft_lowers_the_held_out_loss_and_cannot_add_yet(sft_runs: SFTRuns) -> None:
    """The answers' loss on a fixed held-out batch, recomputed here from the initial and the final
    model, falls by at least GAIN_FLOOR in 6 steps (about 1.4 nats in runs); a model of 6 steps
    cannot add: its held-out greedy accuracy stays at or below ACCURACY_CEILING (0 in runs)."""
    before, after = _nll(sft_runs.root, "tiny"), _nll(sft_runs.root, "sft/final_model")
    assert before - after >= GAIN_FLOOR, (before, after)
    evals = [r for r in sft_runs.first + sft_runs.rows if "eval/accuracy" in r]
    assert evals and all(r["eval/accuracy"] <= ACCURACY_CEILING and r["eval/prompts"] == 40 for r in evals)


def test_the_eval_app_finds_the_models_own_greedy_answers_all_correct(sft_runs: SFTRuns, tmp_path: Path) -> None:
    """The evaluation app on SFT's final_model, whose held-out answers are that model's own greedy
    completions (transformers, argmax; prompts with a near tie left out): greedy accuracy is 1, as
    only greedy decoding reaches (sampling at temperature 1 scores about 0.1), and pass@2/mean@2
    come from the samples."""
    prompts = _held_out(sft_runs.root)[:40]
    answers = _greedy_answers(sft_runs.model, [p.text for p in prompts], max_tokens=4)
    own = [{"question": p.text, "answer": a} for p, a in zip(prompts, answers) if a is not None]
    assert len(own) >= 20, f"only {len(own)} of 40 prompts have an unambiguous greedy answer"
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own))
    code, out, err = _run(
        "eval",
        "configs/eval_addition.yaml",
        tmp_path,
        f"model.path={sft_runs.model}",
        f"data.path={sft_runs.root / 'data'}",
        f"eval.data.path={tmp_path / 'own'}",
        "eval.samples=2",
        "eval.max_tokens=4",
        "write_samples=true",
        f"logging.output_dir={tmp_path / 'eval'}",
    )
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["eval/prompts"] == len(own) and result["eval/accuracy"] == 1.0, result
    assert {"eval/pass@2", "eval/mean@2", "eval/s"} <= set(result) and result["eval/policy_version"] == 0
    # write_samples: the sampled completions the figures came from, each with its reward.
    samples = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert sorted((r["question"], r["answer"]) for r in samples) == sorted((o["question"], o["answer"]) for o in own)
    rewards = [c["reward"] for r in samples for c in r["completions"]]
    assert len(rewards) == 2 * len(own) and abs(sum(rewards) / len(rewards) - result["eval/mean@2"]) < 1e-9
    assert all(c["reward"] == float(c["text"] == r["answer"]) for r in samples for c in r["completions"])


def test_grpo_trains_from_the_sft_model_and_evaluates_beside_training(sft_runs: SFTRuns, tmp_path: Path) -> None:
    """SFT's final_model loads as it is as the GRPO app's model.path, whose held-out evaluation
    runs at step 0, beside training and after the last step."""
    proc = start_app(
        tmp_path / "grpo",
        f"model.path={sft_runs.model}",
        f"data.path={sft_runs.root / 'data'}",
        "eval.every=2",
        "eval.max_prompts=40",
        "eval.samples=2",
        "policy.max_tokens=4",
        "eval.max_tokens=4",
        steps=5,
        config="configs/grpo_addition.yaml",
    )
    code, out, err = finish_app(proc, 180)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = _rows(tmp_path / "grpo" / "out")
    evals = [(r["step"], r["eval/step"]) for r in rows if "eval/accuracy" in r]
    # Step 0's before training (in step 1's row) and the last step's in its own row; those of steps 2
    # and 4 ran beside training and reached a later row, or were skipped (one still running, or
    # superseded by the last), and counted.
    assert evals[0] == (1, 0) and evals[-1] == (5, 5), evals
    beside = [at for _, at in evals[1:-1]]
    assert set(beside) <= {2, 4} and len(beside) + rows[-1]["eval/skipped"] == 2, (evals, rows[-1])
    assert "held-out accuracy" in out


def _held_out(root: Path) -> list[Prompt]:
    """The addition task's test split: what the runs evaluate on, in order."""
    return load_prompts(DataSource(path=str(root / "data"), split="test"))


@functools.cache
def _nll(root: Path, name: str) -> float:
    """The held-out loss of the model ``root / name`` (once per model: two tests ask for it) by its
    definition: -mean over every answer token of the first LOSS_EXAMPLES held-out records (the EOS
    that ends it included) of log_softmax(logits) at that token, in transformers, the prompts
    formatted as SFT formats them."""
    from transformers import AutoModelForCausalLM

    model_dir = root / name
    prompts = _held_out(root)
    fmt = PromptFormat.from_model(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for p in prompts[:LOSS_EXAMPLES]:
            e = fmt.sft_example(p.text, p.answer)
            ids = torch.cat([e.prompt_ids, e.answer_ids])[None]
            logprobs = model(ids).logits[0, :-1].log_softmax(-1)
            answer = slice(len(e.prompt_ids) - 1, None)
            total -= float(logprobs[answer].gather(-1, ids[0, 1:][answer, None]).sum())
            count += len(e.answer_ids)
    return total / count


def _greedy_answers(model_dir: Path, questions: list[str], max_tokens: int) -> list[str | None]:
    """Each question's greedy completion in transformers, decoded as the policy decodes it; None
    where the top two logits of some step are within TIE_GAP (float rounding could flip it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fmt = PromptFormat(tokenizer)
    answers: list[str | None] = []
    with torch.no_grad():
        for question in questions:
            ids = torch.tensor([tokenizer(fmt.prompt(question), add_special_tokens=True).input_ids])
            out: list[int] = []
            clear = True
            for _ in range(max_tokens):
                top = model(ids).logits[0, -1].topk(2)
                clear = clear and float(top.values[0] - top.values[1]) > TIE_GAP
                out.append(int(top.indices[0]))
                if out[-1] == tokenizer.eos_token_id:
                    break
                ids = torch.cat([ids, top.indices[:1][None]], 1)
            answers.append(tokenizer.decode(out, skip_special_tokens=True) if clear else None)
    return answers


def test_sft_data_without_the_answer_key_fails_at_start_up_naming_the_key_and_the_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"question": "1+1=", "solution": "2"}) + "\n")
    (data / "test.jsonl").write_text(json.dumps({"question": "1+2=", "solution": "3"}) + "\n")
    code, _, err = _sft(tmp_path, "steps=2", "data.make_if_missing={}")
    assert code == 1, err[-2000:]
    assert "no field 'answer' (answer_key)" in err and str(data) in err and "question, solution" in err


def test_grpo_eval_data_that_is_missing_fails_at_start_up(tmp_path: Path) -> None:
    """eval.data.path names no file: the run stops before any role starts, naming the path."""
    proc = start_app(tmp_path, "eval.every=2", f"eval.data.path={tmp_path / 'nope.jsonl'}", steps=2)
    code, _, err = finish_app(proc, 60)
    assert code == 1 and "nope.jsonl' does not exist" in err, err[-2000:]
