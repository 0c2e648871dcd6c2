#!/usr/bin/env bash
# Continued pretraining with sensible defaults:
#   NPROC=2 bash run_scripts/run_pt.sh [--train.max_steps 50 ...]     (extra args go to stages/pretrain.py)
# NPROC processes via torchrun (default 1); CONFIG overrides the YAML (default configs/pt.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-configs/pt.yaml}"
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m pipeline.engine.launch --standalone --nproc_per_node "$NPROC" stages/pretrain.py --config "$CONFIG" "$@"
