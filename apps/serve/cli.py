"""The serve app's command line, as tests and benchmarks start it: ``python -m apps.serve.main``
on a config, the model and outputs in one folder, on a free port."""

from __future__ import annotations

import re
import subprocess
import sys
import time
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


def served_url(proc: subprocess.Popen, timeout_s: float = 180.0) -> str | None:
    """The base URL the server started by ``serve_command`` prints once it serves (its stdout a
    text pipe); None if it exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        found = re.search(r"serving 'tiny' at (http://\S+)", line)
        if found:
            return found.group(1)
        if not line and proc.poll() is not None:
            return None
    return None
