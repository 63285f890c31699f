"""Fixtures shared by the integration tests: tiny models written once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forge.models import make_tiny_model

# Nothing can be downloaded here; fail fast instead of waiting on a hub timeout.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Large init so the top logits are far apart: greedy outputs then do not depend on float
# rounding differences between vLLM and transformers.
_TEST_INIT_STD = 0.3


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 (seed 0) that engines start from."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed0", seed=0, init_std=_TEST_INIT_STD)


@pytest.fixture(scope="session")
def tiny_model_dir_alt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, other weights (seed 1): the "trained" policy in weight-sync tests."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed1", seed=1, init_std=_TEST_INIT_STD)
