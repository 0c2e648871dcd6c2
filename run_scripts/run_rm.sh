#!/usr/bin/env bash
# Pairwise reward model with sensible defaults:
#   NPROC=2 bash run_scripts/run_rm.sh [--model.path outputs/sft/merged --train.max_steps 50 ...]
# NPROC processes via torchrun (default 1); CONFIG overrides the YAML (default configs/rm.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-configs/rm.yaml}"
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m pipeline.engine.launch --standalone --nproc_per_node "$NPROC" stages/reward.py --config "$CONFIG" "$@"
