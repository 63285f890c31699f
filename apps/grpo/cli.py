"""The GRPO app's command line, as tests and benchmarks start it: ``python -m apps.grpo.main``
with a config and overrides, and a run's files in one folder."""

from __future__ import annotations

import sys
from pathlib import Path


def app_command(config: str, folder: Path | None = None, *overrides: str, python: str = sys.executable) -> list[str]:
    """The command that runs the app on ``config`` as a user does. With ``folder``, the run's
    model (``tiny``), outputs (``out``) and weight files (``weights``) go under it and the
    progress bar is off; ``overrides`` come last, so they win."""
    run_files = []
    if folder is not None:
        run_files = [
            f"model.path={folder / 'tiny'}",
            f"logging.output_dir={folder / 'out'}",
            "logging.progress_bar=false",
            f"weight_sync.dir={folder / 'weights'}",
        ]
    return [python, "-m", "apps.grpo.main", "--config", config, *run_files, *overrides]
