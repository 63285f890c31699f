"""The GRPO app with LoRA end to end, as a user runs it: ``configs/grpo_tiny_lora.yaml``, shrunk.

A real run: vLLM policy serving each version as a new adapter, the LoRA trainer scoring the
reference with its adapter off (no reference process), reward, buffer, dataset, adapter-only
weight sync through files, an adapter-only checkpoint and the two-folder export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from app_runs import finish_app, start_app

pytest.importorskip("vllm")

pytestmark = pytest.mark.timeout(180)


def test_lora_app_learns_with_adapter_only_sync_checkpoints_and_export(tmp_path: Path) -> None:
    """50 steps of 32 prompts x 8 on the toy task with a LoRA adapter: exit 0, one version a step
    (every one an adapter the policy loaded), no reference role started, the reward of the last
    5 steps well above the first 5's; the checkpoint holds the adapter alone; ``final_model`` is a
    merged Hugging Face folder that transformers loads, with the PEFT adapter in ``adapter/``."""
    from transformers import AutoModelForCausalLM

    from forge.checkpoint import checkpoint_shapes, latest_checkpoint

    overrides = ("prompts_per_step=32", "group_size=8", "trainer.checkpoint_every=50")
    proc = start_app(tmp_path, *overrides, steps=50, config="configs/grpo_tiny_lora.yaml")
    code, out, err = finish_app(proc, timeout=170)
    assert code == 0, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, 51))
    assert "restarts/policy" in rows[-1] and "restarts/reference" not in rows[-1]  # no reference role ran
    first, last = (sum(r["reward_mean"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last > first + 0.08, [round(r["reward_mean"], 3) for r in rows]
    assert abs(rows[0]["kl"]) < 1e-3 and abs(rows[0]["ratio_mean"] - 1.0) < 1e-3, rows[0]  # adapter 0 = base

    shapes = checkpoint_shapes(latest_checkpoint(tmp_path / "out" / "checkpoints"))
    assert shapes and all("lora_" in name for name in shapes), sorted(shapes)[:3]
    final = tmp_path / "out" / "final_model"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (final / "adapter").iterdir()}
    assert AutoModelForCausalLM.from_pretrained(final).config.model_type == "qwen2"
    assert list((tmp_path / "weights").iterdir()) == []  # the adapter folders went with the run
