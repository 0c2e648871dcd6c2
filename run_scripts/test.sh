#!/usr/bin/env bash
# Installs Relay into .venv (skipped when nothing changed) and runs the test suite, offline.
#   bash run_scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash run_scripts/install.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@" tests
