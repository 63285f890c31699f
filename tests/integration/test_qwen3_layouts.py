"""Real-model layouts end to end on CPU: trainer -> weight sync -> vLLM, resume, and the Qwen3 config.

Each tiny model reproduces one way a real checkpoint differs from forge's default tiny model
(``forge.models.tiny.LAYOUTS``): a tied checkpoint that stores ``lm_head.weight`` (Qwen3-1.7B,
whose first weight sync used to crash), untied embeddings, Qwen3's 151,936-token vocabulary, and
all of Qwen3-1.7B's at once. On each, the real ``Trainer`` takes a step, its published weights
load into both vLLM engine modes (whose logprobs are then the trained model's), and a trainer
resumed from its checkpoint publishes the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from transformers import AutoModelForCausalLM  # noqa: E402

from forge.checkpoint import latest_checkpoint  # noqa: E402
from forge.generation import AsyncVllmEngine, VllmEngine  # noqa: E402
from forge.models import make_tiny_model, sequence_logprobs  # noqa: E402
from forge.models.tiny import LAYOUTS  # noqa: E402
from forge.types import Episode, EpisodeBatch  # noqa: E402
from tests.numerics import assert_close_to_scale  # noqa: E402

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
LAYOUT_NAMES = ["tied", "tied_stored_head", "untied", "big_vocab", "qwen3_1_7b"]
PROMPT_IDS = [[5, 6, 7], [8, 9, 10, 11, 12]]
# Async-engine starts are ~10 s each: the default suite runs it on the layout that has every
# real-model trait at once; the others are slow tests.
MODES = [
    pytest.param(name, mode, marks=[] if mode == "batched" or name == "qwen3_1_7b" else [pytest.mark.slow])
    for name in LAYOUT_NAMES
    for mode in ("batched", "async")
]


@pytest.fixture(scope="module")
def layout_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {name: make_tiny_model(root / name, init_std=0.3, **LAYOUTS[name]) for name in LAYOUT_NAMES}


def _on_policy_batch(model_dir: Path) -> EpisodeBatch:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [torch.tensor(p) for p in PROMPT_IDS]
    responses = [torch.tensor([20, 21, 22]), torch.tensor([23, 24])]
    lps = sequence_logprobs(model, prompts, responses)
    return EpisodeBatch.pack(
        [
            Episode(f"g{i}", p, r, lp, lp.clone(), float(i), 1.0 - 2 * i, 0)
            for i, (p, r, lp) in enumerate(zip(prompts, responses, lps))
        ]
    )


async def _trained_and_resumed(model_dir: Path, tmp: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A real trainer's weights after one step, and a fresh trainer's after loading its checkpoint."""
    from monarch.actor import this_proc

    from forge.actors.trainer import Trainer, TrainerConfig

    cfg = TrainerConfig(model_path=str(model_dir), lr=1e-2, checkpoint_dir=str(tmp / "ckpt"))
    tag = model_dir.name
    first = this_proc().spawn(f"trainer_{tag}", Trainer, cfg)
    second = this_proc().spawn(f"trainer_{tag}_resumed", Trainer, cfg)
    try:
        await first.setup.call_one()
        await first.train_step.call_one(_on_policy_batch(model_dir))
        trained, version = await first.weights.call_one()
        path = await first.save_checkpoint.call_one(1)
        await first.wait_checkpoint.call_one()  # written in the background
        await second.setup.call_one()
        step, resumed_version, _ = await second.load_checkpoint.call_one(path)
        resumed, _ = await second.weights.call_one()
        assert (step, version, resumed_version) == (1, 1, 1)
        return trained, resumed
    finally:
        await first.stop()
        await second.stop()


@pytest.fixture(scope="module")
async def trained(layout_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per layout: (the trainer's published weights, the resumed trainer's)."""
    return {
        name: await _trained_and_resumed(path, tmp_path_factory.mktemp(f"train-{name}"))
        for name, path in layout_dirs.items()
    }


@pytest.mark.parametrize("name", LAYOUT_NAMES)
async def test_resumed_trainer_publishes_the_same_weights(trained: dict[str, Any], name: str) -> None:
    """Save then load on every layout: same tensor names, values and version."""
    weights, resumed = trained[name]
    assert weights.keys() == resumed.keys()
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


def _hf_with(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The checkpoint's model with ``weights`` loaded (a tied head follows the embedding)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


@pytest.mark.parametrize("name, mode", MODES)
async def test_trainer_weights_sync_into_both_engine_modes_on_every_layout(
    layout_dirs: dict[str, Path], trained: dict[str, Any], name: str, mode: str
) -> None:
    """The published weights load (no missing-key error on a stored tied head) and the engine then
    samples with the trained model's logprobs, not the checkpoint's."""
    model_dir = layout_dirs[name]
    weights, _ = trained[name]
    if mode == "batched":
        engine: Any = VllmEngine.create(model_dir, max_model_len=128, seed=0, kv_cache_bytes=8 << 20)
    else:
        engine = await AsyncVllmEngine.create(model_dir, max_model_len=128, seed=0, kv_cache_bytes=8 << 20)
    try:
        update = engine.update_weights(weights, 1)
        if mode == "async":
            await update
        generate = engine.generate([torch.tensor(p) for p in PROMPT_IDS], n=2, temperature=1.0, max_tokens=6, seed=0)
        groups = await generate if mode == "async" else generate
    finally:
        engine.shutdown()
        if mode == "async":
            from multiprocessing import resource_tracker

            resource_tracker._resource_tracker._stop()
    completions = [c for group in groups for c in group]
    assert all(c.policy_version == 1 for c in completions)
    args = ([c.prompt_ids for c in completions], [c.token_ids for c in completions])
    want = sequence_logprobs(_hf_with(model_dir, weights), *args)
    old = sequence_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), *args)
    got = torch.cat([c.logprobs for c in completions])
    assert_close_to_scale(got, torch.cat(want), rel=1e-3, scale=1.0, what="vLLM vs transformers logprobs")
    assert max((o - w).abs().max().item() for o, w in zip(old, want)) > 1e-2  # the step changed them


# ----------------------------------------------------------------------------- the Qwen3 config on CPU
GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?", "answer": "24 #### 72"},
    {"question": "Weng earns $12 an hour. How much for 50 minutes?", "answer": "#### 10"},
    {"question": "A book costs $5 and a pen $2. What do 2 books and a pen cost?", "answer": "#### 12"},
    {"question": "Tom has 3 apples and eats one. How many are left?", "answer": "#### 2"},
]


@pytest.fixture
def gsm8k_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    return path


@pytest.mark.timeout(700)
def test_qwen3_config_runs_end_to_end_on_cpu_with_the_qwen3_layout(
    layout_dirs: dict[str, Path], gsm8k_file: Path, tmp_path: Path
) -> None:
    """configs/qwen3_1_7b.yaml as documented (model.path, data.path), on the Qwen3-1.7B-layout tiny
    model, without GPUs and sized down: two steps, a checkpoint, file weight sync, exit 0."""
    out = tmp_path / "out"
    overrides = [
        f"model.path={layout_dirs['qwen3_1_7b']}",
        f"data.path={gsm8k_file}",
        # Only what a CPU needs: no GPUs, a small KV cache, eager vLLM, fp32 sampling (no bf16
        # kernels on this CPU) and a tiny step.
        "policy.with_gpus=false",
        "reference.with_gpus=false",
        "trainer.with_gpus=false",
        "policy.kv_cache_bytes=16777216",
        "policy.engine_kwargs={enforce_eager: true}",
        "policy.dtype=float32",
        "policy.max_tokens=8",
        "steps=2",
        "prompts_per_step=2",
        "group_size=2",
        "trainer.checkpoint_every=2",
        f"logging.output_dir={out}",
        "logging.progress_bar=false",
        f"weight_sync.dir={tmp_path / 'weights'}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "apps.grpo.main", "--config", "configs/qwen3_1_7b.yaml", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # ~1 minute on an idle 2-core CPU; start-up alone took 160 s at a load of 25
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("mismatch_max" in r for r in rows)
    assert latest_checkpoint(out / "checkpoints") is not None  # written at the last step
