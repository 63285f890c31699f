"""Weight-sync checks on real-model layouts, and the file transport's space check (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from apps.grpo.config import GRPOConfig
from forge.config import load_config
from forge.generation.weight_sync import (
    check_file_transport_space,
    checkpoint_spec,
    file_transport_bytes,
    validate_state_dict,
)
from forge.models import make_tiny_model
from forge.models.tiny import LAYOUTS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {name: make_tiny_model(root / name, **LAYOUTS[name]) for name in ("tied", "tied_stored_head", "untied")}


def _published(path: Path) -> dict[str, torch.Tensor]:
    """What the trainer publishes for a tied model: every tensor but the head."""
    weights = load_file(str(path / "model.safetensors"))
    weights.pop("lm_head.weight", None)
    return weights


def test_a_tied_update_without_the_head_fits_a_checkpoint_that_stores_it(layouts: dict[str, Path]) -> None:
    """Qwen3-1.7B's layout: the trainer leaves the tied head out; validation must not demand it."""
    path = layouts["tied_stored_head"]
    spec = checkpoint_spec(path)
    assert "lm_head.weight" in spec
    validate_state_dict(_published(path), spec, tied=True)


def test_a_tied_head_that_differs_from_the_embedding_is_refused_in_both_tied_layouts(layouts: dict[str, Path]) -> None:
    """Sent, a tied head must equal the embedding, whether the checkpoint stores it or not."""
    for name in ("tied", "tied_stored_head"):
        weights = _published(layouts[name])
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1
        with pytest.raises(ValueError, match="differs from 'model.embed_tokens.weight'"):
            validate_state_dict(weights, checkpoint_spec(layouts[name]), tied=True)


def test_an_untied_update_must_carry_its_head(layouts: dict[str, Path]) -> None:
    """Untied, lm_head.weight is a tensor of its own: leaving it out is a missing key."""
    weights = load_file(str(layouts["untied"] / "model.safetensors"))
    validate_state_dict(weights, checkpoint_spec(layouts["untied"]), tied=False)
    del weights["lm_head.weight"]
    with pytest.raises(ValueError, match="missing 1 key.*lm_head.weight"):
        validate_state_dict(weights, checkpoint_spec(layouts["untied"]), tied=False)


def test_file_transport_bytes_are_three_copies_without_a_tied_head(layouts: dict[str, Path]) -> None:
    """3 x (every tensor but a tied head) x the publish dtype's size."""
    spec = checkpoint_spec(layouts["tied_stored_head"])
    numel = sum(torch.Size(s).numel() for n, s in spec.items() if n != "lm_head.weight")
    assert file_transport_bytes(spec, torch.bfloat16, tied=True) == 3 * numel * 2
    untied = checkpoint_spec(layouts["untied"])
    assert file_transport_bytes(untied, torch.float32, tied=False) == 3 * 4 * sum(
        torch.Size(s).numel() for s in untied.values()
    )


def test_the_space_check_names_the_size_and_the_alternatives(tmp_path: Path) -> None:
    """Too little room is a ValueError with the GiB needed, weight_sync.dir and the message transport."""
    check_file_transport_space(tmp_path / "not-yet" / "weights", 1 << 20)  # a missing folder: its parent is checked
    with pytest.raises(
        ValueError, match=r"needs 1048576\.00 GiB free.*weight_sync\.dir.*weight_sync\.transport=message"
    ):
        check_file_transport_space(tmp_path / "weights", 1 << 50)


def test_grpo_config_checks_the_file_transport_only(layouts: dict[str, Path], tmp_path: Path) -> None:
    """The app's start-up check: fine for a tiny model; the message transport is never checked."""
    base = [f"model.path={layouts['tied']}", f"weight_sync.dir={tmp_path}"]
    load_config(GRPOConfig, str(REPO / "configs/grpo_tiny.yaml"), base).check_weight_sync_space(layouts["tied"])
    cfg = load_config(GRPOConfig, str(REPO / "configs/grpo_tiny.yaml"), [*base, "weight_sync.transport=message"])
    cfg.check_weight_sync_space(tmp_path / "no-model-here")  # would fail reading the model if it checked
