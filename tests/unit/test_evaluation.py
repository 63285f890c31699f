"""Held-out evaluation's figures from completions: accuracy, pass@k, mean@k, reward, length."""

import math

import pytest
import torch

from forge.evaluation import EvalSettings, eval_metrics, pass_at_k
from forge.types import Completion, Group, Prompt


def _group(prompt: Prompt, texts: list[str], version: int = 3) -> Group:
    return Group(
        prompt,
        [Completion(torch.tensor([1]), torch.tensor([5] * len(t)), torch.zeros(len(t)), t, version) for t in texts],
    )


def _exact(prompt: Prompt, text: str) -> float:
    return float(text == prompt.answer)


def test_pass_at_k_is_the_unbiased_estimate():
    """Chen et al.'s estimator: with n == k it is 'any correct'; otherwise 1 - C(n-c, k) / C(n, k)."""
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def test_figures_count_correct_greedy_answers_and_samples():
    """Two prompts: the first answered right greedily and by 1 of 4 samples, the second by none."""
    a, b = Prompt("a", "1+1=", "2"), Prompt("b", "2+2=", "4")
    greedy = [_group(a, ["2"]), _group(b, ["5"])]
    sampled = [_group(a, ["2", "3", "33", "9"], version=4), _group(b, ["1", "2", "3", "5"])]
    m = eval_metrics(greedy, sampled, _exact, EvalSettings(samples=4))
    assert m["eval/accuracy"] == 0.5
    assert m["eval/pass@4"] == 0.5 and m["eval/mean@4"] == pytest.approx(1 / 8)
    assert m["eval/reward_mean"] == pytest.approx(1 / 8)
    assert m["eval/length_mean"] == pytest.approx(9 / 8)  # tokens of the samples
    assert m["eval/prompts"] == 2 and m["eval/policy_version"] == 3 and m["eval/policy_version_max"] == 4


def test_greedy_only_reports_accuracy_and_the_greedy_reward():
    a = Prompt("a", "q", "x")
    m = eval_metrics(
        [_group(a, ["x"])], [], lambda p, t: 0.7 if t == "x" else 0.0, EvalSettings(samples=0, correct_at=0.5)
    )
    assert m["eval/accuracy"] == 1.0 and m["eval/reward_mean"] == pytest.approx(0.7)
    assert not any(k.startswith("eval/pass@") for k in m)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"samples": -1}, "samples must be an integer >= 0"), ({"max_tokens": 0}, "max_tokens must be >= 1")],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EvalSettings(**kwargs)


def _records(folder, split: str, n: int) -> None:
    import json

    folder.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"question": f"{split}{i}+1=", "answer": f"{i + 1}"}) for i in range(n))
    (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


def test_the_held_out_records_are_the_eval_split_of_the_run_data_unless_eval_data_names_its_own(tmp_path):
    """An empty eval.data.path takes the run data's files and keys with the eval split (not the
    training split); eval.data.path, when set, is read as it is."""
    from apps.common.config import EvalData, EvalSamplingSection, RecordsSection
    from apps.common.evaluation import eval_source

    data = RecordsSection(path=str(tmp_path / "run"), split="train", question_key="q", answer_key="a")
    inherited = eval_source(EvalSamplingSection(), data)
    assert (inherited.path, inherited.split, inherited.question_key, inherited.answer_key) == (
        data.path,
        "test",
        "q",
        "a",
    )
    own = eval_source(EvalSamplingSection(data=EvalData(path=str(tmp_path / "other.jsonl"), split="train")), data)
    assert (own.path, own.split, own.question_key) == (str(tmp_path / "other.jsonl"), "train", "question")
    with pytest.raises(ValueError, match="eval.data.path is required"):
        eval_source(EvalSamplingSection(), None)


def test_the_eval_plan_prompts_as_training_does_and_its_own_settings_win(tmp_path):
    """The first max_prompts held-out records, through the prompt template and the chat template
    (as SFT and GRPO format them), answers untouched; eval.temperature, eval.max_tokens and
    eval.reward win over the run's, which fill in where the section leaves them at 0 or empty."""
    from apps.common.config import EvalSamplingSection, RecordsSection
    from apps.common.evaluation import EvalPlan
    from forge.data import PromptFormat
    from forge.models import make_tiny_model
    from forge.models.tiny import LAYOUTS

    model = str(make_tiny_model(tmp_path / "chat", num_layers=1, **LAYOUTS["chat"]))
    _records(tmp_path / "data", "train", 4)
    _records(tmp_path / "data", "test", 5)
    data = RecordsSection(path=str(tmp_path / "data"), prompt_template="Q: {text}")
    section = EvalSamplingSection(max_prompts=3, samples=2, temperature=0.5, max_tokens=7, reward={"exact_match": 1})
    plan = EvalPlan.from_config(section, data, model, temperature=1.0, max_tokens=4, reward_fns={"gsm8k": 1})
    fmt = PromptFormat.from_model(model, "Q: {text}")
    assert [(p.text, p.answer) for p in plan.prompts] == [(fmt.prompt(f"test{i}+1="), f"{i + 1}") for i in range(3)]
    assert plan.prompts[0].text.startswith("<|im_start|>user\nQ: test0+1=")
    s = plan.settings
    assert (s.samples, s.temperature, s.max_tokens) == (2, 0.5, 7) and list(plan.score.fns) == ["exact_match"]
    defaults = EvalSamplingSection(samples=2)
    plan = EvalPlan.from_config(defaults, data, model, temperature=1.0, max_tokens=4, reward_fns={"gsm8k": 1})
    s = plan.settings
    assert (s.temperature, s.max_tokens, len(plan.prompts)) == (1.0, 4, 5) and list(plan.score.fns) == ["gsm8k"]
