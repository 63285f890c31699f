#!/usr/bin/env bash
# Installs what the apps need (first run only), then shows a CPU run learning for real:
#   1. SFT of a random-init 2.6 M-parameter model on 3-digit addition until its held-out greedy
#      accuracy first reaches 0.2 (configs/sft_addition.yaml);
#   2. GRPO from that model with an exact-match reward (configs/grpo_addition.yaml), the held-out
#      accuracy measured beside training;
#   3. both runs' held-out accuracy against wall seconds in outputs/sft_then_grpo.png.
# key=value overrides after the command go to both runs (e.g. seed=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m apps.sft.main --config configs/sft_addition.yaml logging.output_dir=outputs/sft_addition "$@"
.venv/bin/python -m apps.grpo.main --config configs/grpo_addition.yaml model.path=outputs/sft_addition/final_model \
    logging.output_dir=outputs/grpo_addition "$@"
.venv/bin/python scripts/plot_eval_curves.py --run SFT=outputs/sft_addition --run GRPO=outputs/grpo_addition \
    --out outputs/sft_then_grpo.png
