"""Starting the GRPO app as a user does, for the end-to-end tests: a subprocess running
``python -m apps.grpo.main`` on the tiny config, shrunk by overrides, in a test's own folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from apps.grpo.cli import app_command

REPO = Path(__file__).resolve().parents[2]


def start_app(
    tmp_path: Path, *overrides: str, steps: int = 3, config: str = "configs/grpo_tiny.yaml"
) -> subprocess.Popen:
    """The app on ``config`` (the tiny single-turn one by default) with ``steps`` steps of 4
    prompts x 4 samples; model, outputs and weight files under ``tmp_path``; ``overrides`` come
    last, so they win."""
    args = app_command(config, tmp_path, f"steps={steps}", "prompts_per_step=4", "group_size=4", *overrides)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_app(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """The app's exit code, stdout and stderr; a run past ``timeout`` is killed and fails the test."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the app did not finish within {timeout}s\nstdout:\n{out}\nstderr:\n{err[-3000:]}")
    return proc.returncode, out, err
