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
