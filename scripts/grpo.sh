#!/usr/bin/env bash
# Installs what the app needs (first run only), then trains GRPO.
#   scripts/grpo.sh                                   the tiny CPU config (makes the tiny model)
#   scripts/grpo.sh trainer.lr=1e-3 group_size=4      key=value overrides
#   scripts/grpo.sh --config configs/qwen3_1_7b.yaml model.path=/path/to/Qwen3-1.7B \
#       data.path=/path/to/gsm8k/train.jsonl          (GPUs)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
config=configs/grpo_tiny.yaml
if [ "${1:-}" = "--config" ]; then config="$2"; shift 2; fi
exec .venv/bin/python -m apps.grpo.main --config "$config" "$@"
