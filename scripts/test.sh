#!/usr/bin/env bash
# Installs what the tests need (first run only), then runs them.
#   scripts/test.sh            the default suite (CI; its run time is in docs/benchmarks.md)
#   scripts/test.sh --slow     only the slow tests
#   scripts/test.sh -k batch   any other pytest arguments pass through
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
args=()
for a in "$@"; do
    if [ "$a" = "--slow" ]; then args+=(-m slow); else args+=("$a"); fi
done
# Lint and format are part of the test: a violation fails the run (ruff's settings are in pyproject.toml).
.venv/bin/ruff format --check --quiet . || { echo "[forge] ruff format: run '.venv/bin/ruff format .'"; exit 1; }
.venv/bin/ruff check --quiet .
# pytest exits non-zero on any failure, and with 5 when no test ran: both fail the run.
exec .venv/bin/python -m pytest -p no:cacheprovider -ra "${args[@]}"
