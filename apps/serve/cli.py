"""The serve app's command line, as tests and benchmarks start it: ``python -m apps.serve.main``
on a config, the model and outputs in one folder, on a free port."""

from __future__ import annotations

import sys
from pathlib import Path


def serve_command(
    folder: Path, *overrides: str, config: str = "configs/serve_tiny.yaml", python: str = sys.executable
) -> list[str]:
    """The server on ``config`` with its model (``model``) and outputs (``out``) under ``folder``, on a
    free port (it prints the URL), serving the model as ``tiny``; ``overrides`` come last, so they win."""
    run_files = [f"model.path={folder / 'model'}", f"logging.output_dir={folder / 'out'}"]
    return [
        python,
        "-m",
        "apps.serve.main",
        "--config",
        config,
        *run_files,
        "server.port=0",
        "server.model_name=tiny",
        *overrides,
    ]
