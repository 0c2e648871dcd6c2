#!/usr/bin/env bash
# PPO against the reward model with sensible defaults:
#   NPROC=2 bash run_scripts/run_ppo.sh [--model.path outputs/sft/merged --reward_model.path outputs/rm/merged ...]
# NPROC processes via torchrun (default 1); CONFIG overrides the YAML (default configs/ppo.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-1}"
CONFIG="${CONFIG:-configs/ppo.yaml}"
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m pipeline.engine.launch --standalone --nproc_per_node "$NPROC" stages/ppo.py --config "$CONFIG" "$@"
