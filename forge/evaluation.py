"""Held-out evaluation on a policy service: greedy accuracy, pass@k, mean@k, reward and length.

What users judge a post-training run by is the accuracy it reaches on prompts it never trained
on. ``evaluate`` asks the policy service for one greedy completion and ``samples`` sampled ones
of every held-out prompt (the ``Policy.sample`` endpoint, prebatched like rollouts, on the
weights the replicas serve at that moment) and scores them with the run's reward functions:

- ``eval/accuracy``: the share of prompts whose greedy completion is correct (its reward is at
  least ``correct_at``, 1.0 for a 0/1 reward);
- ``eval/pass@k`` / ``eval/mean@k`` (k = ``samples``, e.g. ``eval/pass@8``): the share of
  prompts with at least one correct sample among k, and the share of correct samples;
- ``eval/reward_mean``, ``eval/length_mean``: the mean reward and response length (tokens) of
  the samples (of the greedy completions when ``samples`` is 0);
- ``eval/s``: wall seconds of the evaluation; ``eval/prompts``; ``eval/policy_version`` and
  ``eval/policy_version_max``: the oldest and newest weights that answered (they differ only
  when a weight sync landed during an evaluation that ran beside training).

The GRPO app runs it beside training (rollouts keep going: the policy interleaves the
evaluation's batches with theirs), SFT at its evaluation steps, and ``apps.eval`` on any
checkpoint alone: the same function everywhere.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from forge.checks import check_int
from forge.types import Group, Prompt, SampleRequest

__all__ = ["EvalSettings", "eval_metrics", "evaluate", "judged_samples", "pass_at_k"]

Score = Callable[[Prompt, str], float]


@dataclass(kw_only=True)
class EvalSettings:
    """How each held-out prompt is sampled and judged."""

    samples: int = 8
    """Sampled completions per prompt for pass@k and mean@k (k); 0: greedy only."""
    temperature: float = 1.0
    """Temperature of the k samples (the greedy completion uses 0)."""
    max_tokens: int = 16
    """Most response tokens per completion."""
    correct_at: float = 1.0
    """A completion is correct when its reward is at least this."""

    def __post_init__(self) -> None:
        check_int("eval samples", self.samples, 0)
        if not self.temperature > 0 and self.samples:
            raise ValueError(f"eval temperature must be > 0 for sampled completions, got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"eval max_tokens must be >= 1, got {self.max_tokens}")


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``correct`` were right (Chen et al.
    2021): the chance that at least one of k samples drawn from the n is right."""
    if not 0 < k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= correct <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def eval_metrics(
    greedy: Sequence[Group], sampled: Sequence[Group], score: Score, settings: EvalSettings
) -> dict[str, float]:
    """The evaluation's figures from its completions (one greedy ``Group`` per prompt, and one of
    ``samples`` completions per prompt unless ``samples`` is 0)."""
    if not greedy:
        raise ValueError("an evaluation needs at least one prompt")

    def rewards(group: Group) -> list[float]:
        return [float(score(group.prompt, c.text)) for c in group.completions]

    greedy_rewards = [rewards(g)[0] for g in greedy]
    metrics = {"eval/accuracy": _mean([r >= settings.correct_at for r in greedy_rewards])}
    groups = sampled if settings.samples else greedy
    k = settings.samples
    if k:
        per_prompt = [rewards(g) for g in sampled]
        correct = [sum(r >= settings.correct_at for r in rs) for rs in per_prompt]
        metrics[f"eval/pass@{k}"] = _mean([pass_at_k(k, c, k) for c in correct])
        metrics[f"eval/mean@{k}"] = _mean([c / k for c in correct])
        metrics["eval/reward_mean"] = _mean([r for rs in per_prompt for r in rs])
    else:
        metrics["eval/reward_mean"] = _mean(greedy_rewards)
    lengths = [int(c.token_ids.numel()) for g in groups for c in g.completions]
    versions = [c.policy_version for g in (*greedy, *sampled) for c in g.completions]
    metrics.update(
        {
            "eval/length_mean": _mean(lengths),
            "eval/prompts": float(len(greedy)),
            "eval/policy_version": float(min(versions)),
            "eval/policy_version_max": float(max(versions)),
        }
    )
    return metrics


async def evaluate(
    policy: Any, prompts: Sequence[Prompt], score: Score, settings: EvalSettings, keep: list[Group] | None = None
) -> dict[str, float]:
    """Evaluate the weights ``policy`` (a ``Policy`` service) serves on ``prompts``.

    Every request is queued at once (``route`` queues at call time), so the replicas batch them
    with whatever else they serve; each batch has the service's call timeout, so an evaluation
    never waits forever on a dead replica (its requests are resent to a live one). ``keep``, if
    given, receives the sampled groups (the greedy ones when ``samples`` is 0), for
    ``judged_samples``.
    """
    if not prompts:
        raise ValueError("an evaluation needs at least one prompt")
    t0 = time.perf_counter()
    calls = [policy.sample.route(SampleRequest(p, 1, 0.0, settings.max_tokens)) for p in prompts]
    if settings.samples:
        calls += [
            policy.sample.route(SampleRequest(p, settings.samples, settings.temperature, settings.max_tokens))
            for p in prompts
        ]
    groups = await asyncio.gather(*calls)
    greedy, sampled = groups[: len(prompts)], groups[len(prompts) :]
    metrics = eval_metrics(greedy, sampled, score, settings)
    metrics["eval/s"] = time.perf_counter() - t0
    if keep is not None:
        keep.extend(sampled if settings.samples else greedy)
    return metrics


def judged_samples(groups: Sequence[Group], score: Score) -> list[dict[str, Any]]:
    """One record per group: its question, reference answer, and each completion's text with
    its reward (what ``forge.data.preferences.pairs_from_samples`` makes preference pairs of)."""
    return [
        {
            "question": group.prompt.question,
            "answer": group.prompt.answer,
            "completions": [{"text": c.text, "reward": float(score(group.prompt, c.text))} for c in group.completions],
        }
        for group in groups
    ]


def _mean(values: Sequence[float]) -> float:
    return float(sum(values)) / len(values) if values else math.nan
