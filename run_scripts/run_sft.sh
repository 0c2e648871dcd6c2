#!/usr/bin/env bash
# Multi-turn multitask SFT with sensible defaults:
#   NPROC=2 bash run_scripts/run_sft.sh [--model.path outputs/pt/merged --train.max_steps 50 ...]
# NPROC processes via torchrun (default 1); CONFIG overrides the YAML (default configs/sft.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-configs/sft.yaml}"
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m pipeline.engine.launch --standalone --nproc_per_node "$NPROC" stages/sft.py --config "$CONFIG" "$@"
