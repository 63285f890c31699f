"""The multi-adapter app's config: K GRPO runs, each a GRPO config of its own, sharing one policy.

Each run is the GRPO app's config (``grpo``, a YAML file, e.g. ``configs/grpo_tiny_lora.yaml``),
then the ``shared`` overrides, then its own ``overrides`` (its seed, task, reward, steps...), so
every GRPO setting and check applies per run, and a run reads as a GRPO run does. What the one
policy service decides must be the same in every run (the model, the ``policy`` section, the
group size, the adapter's settings): a run that differs is an error naming it and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from apps.common.roles import RUN_ENV
from apps.grpo.config import GRPOConfig

__all__ = ["AdapterRun", "MultiLoraConfig", "RunConfig"]

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SHARED_KEYS = ("model", "policy", "group_size", "trainer.lora", "weight_sync.transport")
"""What the one policy service decides: equal in every run."""


@dataclass(kw_only=True)
class AdapterRun:
    """One GRPO run of the job: its adapter's name and its own settings."""

    name: str = MISSING
    """The run's name: its adapter id on the policy (each request names it) and its output folder
    ``<output_dir>/<name>``; letters, digits, ``_.-``."""
    overrides: list[str] = field(default_factory=list)
    """GRPO ``key=value`` overrides of this run, after ``shared`` (e.g. ``seed=1``, ``steps=20``,
    ``reward.fns={toy: 1.0}``)."""


@dataclass(kw_only=True)
class MultiLoraConfig:
    """K LoRA GRPO runs, each with its own trainer, reward, buffer and data, on one policy service."""

    grpo: str = MISSING
    """The GRPO config every run starts from (a YAML file of ``apps.grpo``, with ``trainer.lora``)."""
    shared: list[str] = field(default_factory=list)
    """GRPO overrides of every run (e.g. ``model.path=...``, ``policy.num_replicas=2``)."""
    runs: list[AdapterRun] = field(default_factory=list)
    """The runs; at least one, names unique."""
    max_loras: int = 0
    """Adapters one policy replica holds at once (vLLM's ``max_loras`` and the multiplexing's
    ``max_models``); past it the least recently used idle one is evicted. 0: one per run."""
    output_dir: str = "outputs/multi_lora"
    """Each run writes its GRPO outputs in ``<output_dir>/<name>``; the job's ``summary.json`` here."""

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError("runs is empty: list at least one run (name and overrides)")
        names = [r.name for r in self.runs]
        for name in names:
            if not RUN_NAME.match(name):
                raise ValueError(f"runs: name {name!r} must be letters, digits and '_.-' (at most 64), e.g. 'addition'")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"runs: names must be unique (each is an adapter id), {dupes} appear more than once")
        if isinstance(self.max_loras, bool) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an int >= 0 (0: one per run), got {self.max_loras!r}")

    @property
    def adapters_per_replica(self) -> int:
        """``max_loras`` resolved: at most one per run."""
        return min(self.max_loras, len(self.runs)) if self.max_loras else len(self.runs)

    def run_configs(self) -> list[RunConfig]:
        """Every run's GRPO config, loaded and checked; a ``ValueError`` names the run that is wrong."""
        from forge.config import load_config

        out = []
        for run in self.runs:
            overrides = [*self.shared, f"logging.output_dir={Path(self.output_dir) / run.name}", *run.overrides]
            try:
                cfg = load_config(GRPOConfig, self.grpo, overrides)
            except ValueError as exc:
                raise ValueError(f"run {run.name!r}: {exc}") from exc
            check_run(run.name, cfg)
            for section in (cfg.trainer, cfg.reward, cfg.env):  # a run's processes are told apart by it
                section.env = {**section.env, RUN_ENV: run.name}
            out.append(RunConfig(run.name, cfg))
        first = out[0]
        for other in out[1:]:
            for key in SHARED_KEYS:
                mine, theirs = _value(first.grpo, key), _value(other.grpo, key)
                if mine != theirs:
                    raise ValueError(
                        f"run {other.name!r}: {key} is {theirs!r} but run {first.name!r} has {mine!r}; the runs share "
                        f"one policy, so {key} must be the same in every run (set it in shared)"
                    )
        return out

    def resume_points(self, resume: bool) -> dict[str, Path | None]:
        """Each run's checkpoint to continue from (``--resume``: its newest; None: a fresh run);
        as the GRPO app's, per run: ``--resume`` without one, or a fresh job over a run's
        checkpoints, is an error naming the run."""
        from apps.common.cli import checkpoint_to_resume

        points = {}
        for run in self.run_configs():
            try:
                points[run.name] = checkpoint_to_resume(run.grpo.checkpoint_dir, resume)
            except (FileNotFoundError, FileExistsError) as exc:
                raise type(exc)(f"run {run.name!r}: {exc}") from exc
        return points


@dataclass
class RunConfig:
    """One run: its name (adapter id) and its GRPO config."""

    name: str
    grpo: GRPOConfig


def check_run(name: str, cfg: GRPOConfig) -> None:
    """What a run of a multi-adapter job needs beyond a valid GRPO config."""
    if cfg.trainer.lora is None:
        raise ValueError(f"run {name!r}: trainer.lora is null; each run trains an adapter (set trainer.lora)")
    if cfg.weight_sync.transport != "message":
        raise ValueError(
            f"run {name!r}: weight_sync.transport is {cfg.weight_sync.transport!r}, expected 'message': each "
            "version's adapter tensors go to every policy replica, which keeps the newest on its own disk"
        )
    if not cfg.ref_from_base:
        raise ValueError(f"run {name!r}: reference.from_base is false; each run's reference is its adapter's base")
    if cfg.rollout.workers:
        raise ValueError(
            f"run {name!r}: rollout.workers is {cfg.rollout.workers}; a run's groups are made in the job's process "
            "(the policy is shared: set it to 0)"
        )


def _value(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg
