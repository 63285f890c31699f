"""``scripts/gpu_check.py``: without CUDA it refuses with a clear message (exit 2); with
``--allow-cpu`` it runs every check on CPU with gloo and prints one JSON line that passes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    # Imported by path (scripts/ is no package); the FSDP ranks it spawns import it the same way.
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(SCRIPT.parent))
    sys.modules.pop("gpu_check", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the checks instead")
def test_without_cuda_it_exits_2_saying_why_and_how_to_run_on_cpu(gpu_check, capsys):
    assert gpu_check.main([]) == 2
    out, err = capsys.readouterr()
    assert "no CUDA device is visible" in err and "--allow-cpu" in err
    assert json.loads(out) == {"ok": False, "error": err.split("gpu_check: ", 1)[1].strip()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the checks instead")
def test_allow_cpu_runs_every_check_and_prints_one_passing_json_line():
    # As a user runs it: its own process (its FSDP ranks and their resource tracker end with it).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--allow-cpu", "--world-size", "2"], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout
    report = json.loads(lines[0])
    checks = report["checks"]
    assert report["ok"] and all(c.get("ok", True) for c in checks.values())
    assert checks["fsdp_step"]["backend"] == "gloo" and checks["fsdp_step"]["param_share_per_rank"] == [0.5, 0.5]
    assert (
        checks["fsdp_step"]["max_abs_weight_diff_per_lr"] <= 1e-3
        and checks["fsdp_step"]["noise_moved_fraction"] <= 0.01
    )
    assert checks["logprobs"]["fp32_max_abs_diff"] <= 1e-4
    assert checks["grpo_backward"]["ratio_mean"] == pytest.approx(1.0)
    assert report["publish_bytes_per_s"] > 0 and checks["fsdp_step"]["publish_gathered"]["bytes_per_s"] > 0
