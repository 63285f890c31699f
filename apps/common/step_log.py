"""A run's per-step record: one row per step to every sink, a progress bar, a plot at the end.

The GRPO app's ``RunLog`` adds what its services recorded to each row; SFT and other loops that
know their whole row write it here directly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("forge.metrics")


def wandb_options(cfg: Any) -> dict[str, Any]:
    """The ``wandb`` sink's arguments from an app config: its ``logging.wandb`` section and the
    resolved config, which W&B records with the run."""
    from forge.config import config_to_dict

    w = cfg.logging.wandb
    return {"project": w.project, "name": w.name, "mode": w.mode, "config": config_to_dict(cfg)}


class StepLog:
    """Rows to ``metrics.jsonl`` and the other sinks of ``cfg.logging``, shown on a progress bar."""

    def __init__(self, cfg: Any, terminal: Any, total: int, resume_after: int | None = None, desc: str = "run") -> None:
        """``resume_after``: the checkpoint's step when resuming; the earlier rows are kept (and
        count in the summary), later ones dropped. None starts a fresh record."""
        from forge.observability import make_sinks

        self.out = Path(cfg.logging.output_dir)
        self.metrics_path = self.out / "metrics.jsonl"
        self.sinks = make_sinks(list(cfg.logging.sinks), self.out, resume_after, wandb=wandb_options(cfg))
        if "console" in cfg.logging.sinks:
            logging.getLogger("forge.metrics").setLevel(logging.INFO)
        self.rows: list[dict[str, Any]] = []
        if resume_after is not None:
            self.rows = [json.loads(line) for line in self.metrics_path.read_text().splitlines()]
        self.plot_enabled = bool(cfg.logging.plot)
        self.bar = None
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=len(self.rows), desc=desc, unit="step", file=terminal, dynamic_ncols=True
            )
        self._shown: dict[str, float] = {}

    def write(self, step: int, row: Mapping[str, float], show: Sequence[str] = ()) -> None:
        """Log ``row`` as step ``step`` to every sink; the bar shows the latest value of each key
        in ``show`` (an ``eval/*`` key keeps its last value between evaluations)."""
        row = {"step": step, **row}
        self.rows.append(row)
        for sink in self.sinks:
            sink.log(step, {k: v for k, v in row.items() if k != "step"})
        if self.bar is not None:
            self._shown.update({k: row[k] for k in show if k in row})
            self.bar.set_postfix({k.removeprefix("eval/"): f"{v:.4g}" for k, v in self._shown.items()}, refresh=False)
            self.bar.update(1)

    def plot(self, name: str, keys: Sequence[str], beside: Mapping[str, Sequence[str]] | None = None) -> Path | None:
        if not self.rows or not self.plot_enabled:
            return None
        from forge.observability import plot_run

        return plot_run(self.metrics_path, self.out / name, keys=keys, beside=beside)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []
