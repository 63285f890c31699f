"""A response's reward from several sources: reward functions and learned reward models.

Each source gives every response of a group a raw score: a reward function (``reward.fns``,
``forge.actors.reward``) its value, a reward model (``reward.models``,
``forge.actors.reward_model``) its head's output. Each source is normalised on its own
(``reward.normalize``), weighted, and the weighted scores are summed::

    reward = sum over sources s of  weight_s * normalise_s(score_s)

``none`` keeps the scores as they are; ``batch`` standardises each source over the group (mean
0, standard deviation 1; a source that gives the whole group one score contributes 0);
``running`` standardises by the mean and standard deviation of every score the source gave so
far in this process (Welford's update, the group's scores included), as OpenRLHF's reward
normalisation does: a learned score's scale is arbitrary, and this puts each source on one scale
before the weights apply, without erasing a group's offset from the rest.

Every source's raw group mean is recorded as ``reward/fn_<name>`` or ``reward/model_<name>``:
the learned reward and the task's checker side by side, so reward hacking (the model's score
rising while the checked reward does not) shows in the run's log. A function with weight 0 is
logged and never trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from forge.observability import record_metric

__all__ = ["NORMALIZATIONS", "RewardMix", "RewardSettings", "model_source_name"]

NORMALIZATIONS = ("none", "batch", "running")


def model_source_name(path: str) -> str:
    """A reward model's name in the log: its folder's name, or the run's folder for an
    ``apps.rm`` export (``outputs/rm_addition/final_model`` -> ``rm_addition``)."""
    folder = Path(path)
    return folder.parent.name if folder.name == "final_model" and folder.parent.name else folder.name


@dataclass
class RewardSettings:
    """The ``reward`` section's sources and normalisation, as a group maker needs them."""

    fns: dict[str, float]
    """Reward function name -> weight."""
    models: dict[str, float] = field(default_factory=dict)
    """Reward model folder -> weight, in the reward-model service's order."""
    normalize: str = "none"

    def __post_init__(self) -> None:
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"reward.normalize must be one of {', '.join(NORMALIZATIONS)}, got {self.normalize!r}")
        if not self.fns and not self.models:
            raise ValueError("the reward needs a source: reward.fns or reward.models")
        names = [model_source_name(p) for p in self.models]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"reward.models: two models are both logged as model_{twice[0]}; give their folders other names"
            )
        if all(w == 0 for w in [*self.fns.values(), *self.models.values()]):
            raise ValueError("every reward source has weight 0: nothing would be trained on")


class _Running:
    """Welford's running mean and variance."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: torch.Tensor) -> None:
        for v in values.tolist():
            self.count += 1
            delta = v - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (v - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 0.0


class RewardMix:
    """Combines a group's per-source scores into its rewards (module docstring)."""

    def __init__(self, settings: RewardSettings) -> None:
        self.settings = settings
        self.fn_names = list(settings.fns)
        self.model_names = [model_source_name(p) for p in settings.models]
        self._running: dict[str, _Running] = {}

    def combine(self, fn_parts: list[dict[str, float]], model_scores: list[list[float]] | None) -> torch.Tensor:
        """The group's rewards (float32 [n]) from each response's function values (by name) and
        its reward-model scores (one per model, ``settings.models``' order; None without models)."""
        n = len(fn_parts)
        total = torch.zeros(n, dtype=torch.float32)
        sources: list[tuple[str, float, torch.Tensor]] = [
            (f"fn_{name}", weight, torch.tensor([p[name] for p in fn_parts], dtype=torch.float32))
            for name, weight in self.settings.fns.items()
        ]
        if self.settings.models:
            if model_scores is None or len(model_scores) != n:
                got = 0 if model_scores is None else len(model_scores)
                raise ValueError(f"a group of {n} responses got {got} reward-model scores")
            scores = torch.tensor(model_scores, dtype=torch.float32).reshape(n, len(self.model_names))
            weights = self.settings.models.values()
            sources += [(f"model_{m}", w, scores[:, j]) for j, (m, w) in enumerate(zip(self.model_names, weights))]
        for name, weight, raw in sources:
            record_metric(f"reward/{name}", float(raw.mean()))
            if weight:
                total += weight * self._normalised(name, raw)
        return total

    def _normalised(self, name: str, raw: torch.Tensor) -> torch.Tensor:
        how = self.settings.normalize
        if how == "none":
            return raw
        if how == "batch":
            mean, std = float(raw.mean()), float(raw.std(unbiased=False))
        else:
            stats = self._running.setdefault(name, _Running())
            stats.update(raw)
            mean, std = stats.mean, stats.std
        return (raw - mean) / std if std > 1e-6 else torch.zeros_like(raw)
