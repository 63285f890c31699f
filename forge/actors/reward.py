"""``RewardActor``: batched scoring of (prompt, response) pairs with pluggable reward functions.

A reward function is ``fn(prompt: Prompt, response: str) -> float``. It is named either by its
name in forge's reward registry (``forge.data.get_reward``) or as ``"package.module:function"``
for one of your own, and several can be combined with weights::

    reward = await RewardActor.options(num_replicas=1).as_service({"toy": 1.0})
    r = await reward.score.route((prompt, completion.text))

Callers send one pair each; the replica prebatches them. A caller with a whole group sends it
as one request, ``reward.score_groups.route((prompt, [c.text for c in completions]))``, and gets
one reward per response: the controller then pays one request per group, not one per response.
``score_group_parts`` gives each function's reward apart (the GRPO app logs every source and
mixes them with learned rewards, ``apps.grpo.reward_mix``). If a function raises on one pair,
only that pair's caller gets an error (a ``ValueError`` naming
the function and the prompt; in a group, that pair's entry); the rest of the batch is scored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from forge.controller import Batching, ForgeActor, endpoint
from forge.observability import record_metric
from forge.types import Prompt

__all__ = ["RewardActor", "RewardFn", "WeightedReward", "resolve_reward"]

RewardFn = Callable[[Prompt, str], float]


def resolve_reward(name: str) -> RewardFn:
    """The reward function called ``name``: a registry name or ``"module:function"``."""
    if ":" in name:
        from forge.plugins import import_object

        fn = import_object(name, "reward function", "function")
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is not callable")
        return fn
    from forge.data import get_reward

    return get_reward(name)


class WeightedReward:
    """The weighted sum of named reward functions, as one callable ``(prompt, text) -> float``.

    The reward actor scores with it, and so does held-out evaluation (``forge.evaluation``), so
    that a number means the same thing in both. A function that raises on one pair fails that
    pair alone: ``score_one`` returns the error instead of raising it.
    """

    def __init__(self, reward_fns: Mapping[str, float] | Sequence[str]) -> None:
        if isinstance(reward_fns, Mapping):
            self.weights = {str(k): float(v) for k, v in reward_fns.items()}
        else:
            self.weights = {str(name): 1.0 for name in reward_fns}
        if not self.weights:
            raise ValueError("a reward needs at least one reward function")
        self.fns = {name: resolve_reward(name) for name in self.weights}

    def score_one(self, prompt: Prompt, text: str) -> float | Exception:
        parts = self.parts_one(prompt, text)
        if isinstance(parts, Exception):
            return parts
        return sum(self.weights[name] * value for name, value in parts.items())

    def parts_one(self, prompt: Prompt, text: str) -> dict[str, float] | Exception:
        """Each function's own reward (unweighted), by name; or the first one's error."""
        parts: dict[str, float] = {}
        for name, fn in self.fns.items():
            try:
                parts[name] = float(fn(prompt, text))
            except Exception as exc:  # reported to this pair's caller only
                return ValueError(f"reward function {name!r} failed on prompt {prompt.prompt_id!r}: {exc!r}")
        return parts

    def __call__(self, prompt: Prompt, text: str) -> float:
        score = self.score_one(prompt, text)
        if isinstance(score, Exception):
            raise score
        return score


MAX_BATCH_PAIRS = 512
"""Most (prompt, response) pairs one batch scores."""


def group_pairs(group: tuple[Prompt, list[str]]) -> int:
    """Batching size of a group: its responses, at most a batch (a larger group goes alone)."""
    return min(MAX_BATCH_PAIRS, len(group[1]))


class RewardActor(ForgeActor):
    """Scores pairs with the weighted sum of its reward functions (``WeightedReward``)."""

    def __init__(self, reward_fns: Mapping[str, float] | Sequence[str]) -> None:
        self.reward_fns = reward_fns
        self.reward: WeightedReward | None = None
        if not reward_fns:
            raise ValueError("RewardActor needs at least one reward function")

    @endpoint
    async def setup(self) -> None:
        self.reward = WeightedReward(self.reward_fns)

    @endpoint(batch=Batching(max_size=MAX_BATCH_PAIRS, max_wait_s=0.002))
    async def score(self, items: list[tuple[Prompt, str]]) -> list[float | Exception]:
        """The reward of each (prompt, response text) pair; a failing pair fails alone."""
        record_metric("reward/batch_size", len(items))
        return [self.reward.score_one(prompt, text) for prompt, text in items]

    @endpoint(batch=Batching(max_size=MAX_BATCH_PAIRS, max_wait_s=0.002, size_fn=group_pairs))
    async def score_groups(self, groups: list[tuple[Prompt, list[str]]]) -> list[list[float | Exception]]:
        """The rewards of each group (a prompt and its responses' texts), one per response in
        order; a failing pair's entry is its error, and the caller decides what that costs."""
        record_metric("reward/batch_size", sum(len(texts) for _, texts in groups))
        return [[self.reward.score_one(prompt, text) for text in texts] for prompt, texts in groups]

    @endpoint(batch=Batching(max_size=MAX_BATCH_PAIRS, max_wait_s=0.002, size_fn=group_pairs))
    async def score_group_parts(
        self, groups: list[tuple[Prompt, list[str]]]
    ) -> list[list[dict[str, float] | Exception]]:
        """``score_groups`` with each function's own reward, unweighted, by name: what the caller
        needs to log every source apart, normalise each and weigh them itself."""
        record_metric("reward/batch_size", sum(len(texts) for _, texts in groups))
        return [[self.reward.parts_one(prompt, text) for text in texts] for prompt, texts in groups]
