#!/usr/bin/env bash
# Runs PT -> SFT -> RM -> PPO, each stage's merged model the next one's base.
#   bash run_scripts/run_pipeline.sh [configs/pipeline.yaml] [--from sft | --only rm] [--dotted.key value ...]
#
# Launch: NPROC processes per node (default 1) with torchrun; multi-node through NNODES,
# NODE_RANK, MASTER_ADDR, MASTER_PORT (output_root must then be on a shared filesystem). With
# NPROC=1 and NNODES unset a stage runs as plain python, which saves torchrun's start-up time and
# behaves the same (one process, no process group). Set TORCHRUN_ALWAYS=1 to use torchrun anyway.
# A stage whose merged/manifest.json is complete is skipped, so re-running after a crash resumes
# at the first unfinished stage (and inside it, from the stage's own checkpoints). A PPO output
# trained against another reward model than the current RM folder is stale (delete it to rebuild).
# After the stages, `driver summarize` computes the gold table when the config has `gold.data`
# (cached in output_root/gold/ by weights hash), writes summary.json and prints the verdict.
set -euo pipefail
for arg in "$@"; do
  if [[ $arg == -h || $arg == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
  fi
done
# A config path is taken relative to where the script is called from; everything else (stage
# scripts, data paths in the YAMLs, output_root) relative to the repository root.
CONFIG=configs/pipeline.yaml
if [[ $# -gt 0 && $1 != --* ]]; then CONFIG=$(realpath "$1"); shift; fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

driver() { "$PY" -m pipeline.tools.driver "$@"; }

launch() {  # run in the background (&): exec makes the stage itself the process the script waits for
  if [[ ${NPROC:-1} == 1 && -z ${NNODES:-} && -z ${TORCHRUN_ALWAYS:-} ]]; then
    exec "$PY" "$@"
  else
    exec "$PY" -m pipeline.engine.launch --nproc_per_node "${NPROC:-1}" --nnodes "${NNODES:-1}" \
      --node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:-127.0.0.1}" \
      --master_port "${MASTER_PORT:-29500}" "$@"
  fi
}

# A stage runs in the background and this script waits for it, so a SIGTERM sent to the script
# (a scheduler preempting the job) reaches the stage, which saves a checkpoint and exits 143;
# Ctrl-C reaches the stage from the terminal by itself, and the script waits for it to save.
# driver.log then records which stage stopped and why, and the script exits with its code. A
# SIGTERM that comes while no stage runs (the driver between stages, the summary) is kept: the
# script stops before the next stage starts, or after the summary, and exits 143 too.
child=
stop=
trap 'stop=1; [[ -n $child ]] && kill -TERM "$child" 2>/dev/null || true' TERM
trap ':' INT

stop_between() {  # a SIGTERM that came while no stage ran: said in driver.log, exit 143
  if [[ -n $stop ]]; then
    driver stopped "$CONFIG" - 143 "$@" || true
    exit 143
  fi
}

stages=$(driver stages "$CONFIG" "$@")
for stage in $stages; do
  stop_between "$@"
  plan=$(driver prepare "$CONFIG" "$stage" "$@")
  stop_between "$@"
  mapfile -t argv <<< "$plan"
  if [[ ${argv[0]} == skip ]]; then
    continue
  fi
  echo "=== $stage ==="
  launch "${argv[@]}" &
  child=$!
  while :; do
    wait "$child" && rc=0 || rc=$?
    kill -0 "$child" 2>/dev/null || break
  done
  child=
  if (( rc != 0 )); then
    driver stopped "$CONFIG" "$stage" "$rc" "$@" || true
    exit "$rc"
  fi
  finished=$(driver finish "$CONFIG" "$stage" "$@")
  if [[ $finished == stopped ]]; then  # RELAY_STOP_AFTER_STEP: saved without merging, as asked
    exit 0
  fi
done
stop_between "$@"
driver summarize "$CONFIG" "$@"
report_dir=$(driver report-dir "$CONFIG" "$@")
if [[ -n $report_dir ]]; then
  "$PY" -m pipeline.tools.report "$report_dir"
fi
stop_between "$@"
