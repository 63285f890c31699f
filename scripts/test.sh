#!/usr/bin/env bash
# Installs what the tests need (first run only), then runs them.
#   scripts/test.sh            the default suite (CI; its run time is in docs/benchmarks.md)
#   scripts/test.sh --slow     only the slow tests
#   scripts/test.sh --slurm    only the slurm tests, on a two-node Slurm started on this machine
#                              (scripts/slurm_cluster.sh; installs slurm-wlm and munge if root)
#   scripts/test.sh -k batch   any other pytest arguments pass through
# Without --slurm nothing is installed system-wide and no daemon is started.
# Skips are not passes: a skipped end-to-end module or test (tests/integration, e.g. vLLM failed to
# import) or a test that skipped itself on this machine (not root) fails the run, naming each with
# its reason (tests/skip_policy.py). On a machine without vLLM or root, FORGE_ALLOW_SKIPS=1 lets
# them pass (still listed). Every run ends with the skip count and the 20 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
args=()
slurm=0
for a in "$@"; do
    case "$a" in
        --slow) args+=(-m slow) ;;
        --slurm) slurm=1; args+=(-m slurm) ;;
        *) args+=("$a") ;;
    esac
done
# Lint and format are part of the test: a violation fails the run (ruff's settings are in pyproject.toml).
.venv/bin/ruff format --check --quiet . || { echo "[forge] ruff format: run '.venv/bin/ruff format .'"; exit 1; }
.venv/bin/ruff check --quiet .
# pytest exits non-zero on any failure, on a skip the run does not allow, and with 5 when no test ran:
# all fail the run.
if [ "$slurm" = 1 ]; then
    # The cluster lives for these tests only: started fresh, stopped (daemons, jobs) at the end.
    bash scripts/slurm_cluster.sh stop
    trap 'bash scripts/slurm_cluster.sh stop' EXIT
    bash scripts/slurm_cluster.sh start
    eval "$(bash scripts/slurm_cluster.sh env)"
    .venv/bin/python -m pytest -p no:cacheprovider -ra --durations=20 "${args[@]}"
    exit
fi
exec .venv/bin/python -m pytest -p no:cacheprovider -ra --durations=20 "${args[@]}"
