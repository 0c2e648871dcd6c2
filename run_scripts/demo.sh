#!/usr/bin/env bash
# The whole pipeline on the embedded model and the sample data, on CPU (its time on each CPU kind measured
# is in bench/RESULTS.md; emulate another ISA with: .venv/bin/python bench/isa.py avx2 -- bash run_scripts/demo.sh):
#   bash run_scripts/demo.sh [--dotted.key value ...]
#
# Installs Relay (run_scripts/install.sh, a no-op when nothing changed), then runs
# PT -> SFT -> RM -> PPO with configs/demo.yaml into outputs/demo/ and prints the summary
# (losses, RM held-out accuracy, PPO reward and KL, the gold table, final model, tensorboard
# command, the chat command that compares the base and final models) and a verdict. The gold
# table holds the greedy answers of the base, SFT and PPO models to 80 held-out questions
# (data/sample/gold/eval.jsonl), scored against their answer key: how
# often an answer opens with the house phrase and how often it states the right fact. PASS needs
# the RM's held-out accuracy, PPO's phrase rate above SFT's by gold.min_phrase_gain, and PPO's fact
# accuracy within gold.max_fact_drop of SFT's; WARNING names what failed (the exit status is 0
# whenever the pipeline ran). Re-running resumes: finished stages are skipped and the gold table
# is read from its cache (delete outputs/demo to start over). The retention table beside it scores the
# base, PT, SFT and PPO models on Relay's general tasks through lm-evaluation-harness (gold.benchmarks),
# each with its change against the base: what adapting to the sample domain cost in general ability.
set -euo pipefail
cd "$(dirname "$0")/.."
bash run_scripts/install.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$SECONDS
bash run_scripts/run_pipeline.sh configs/demo.yaml "$@"
echo "demo wall time: $((SECONDS - start)) s"
