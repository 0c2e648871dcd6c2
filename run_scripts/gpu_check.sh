#!/usr/bin/env bash
# The GPU check: on a CUDA machine, in one device window of 10 minutes, install Relay from an offline
# bundle, then run the check's parts, the most informative first, each under a time budget of its own
# (bench/gpu.py: PARTS), and write OUTDIR/gpu_check.md (markdown for bench/RESULTS.md, the device
# named) after every part: a run cut off at any point leaves the report of what it finished.
#
#   bash run_scripts/gpu_check.sh OUTDIR [--bundle DIR] [--dry-run]
#
# --bundle DIR: install from `relay bundle --out DIR` first (into a folder of its own: the node's
# Python and its torch are left as they are); without it Relay must already be importable.
# --dry-run (any machine): list each run's parts with their budgets and the budget sums, and check
# the bundle is complete; nothing runs.
# GPU_CHECK_PARTS picks what runs: first (the default: install and versions, Relay's SFT profiled,
# tests/test_gpu.py, tests/test_fsdp.py, decoding), second (the ZeRO, QLoRA, vLLM and two-GPU
# tests), third (the TRL comparison, the 1.5B QLoRA merge, PPO, GRPO), fourth (compiled decoding;
# GRPO sampling on vLLM with its default options, where vLLM is installed), or part
# names (e.g. GPU_CHECK_PARTS="fsdp-tests decode"); one window each. GPU_CHECK_S_<PART> (e.g.
# GPU_CHECK_S_FSDP_TESTS=300) sets one part's budget in seconds, GPU_CHECK_TOTAL_S the whole run's
# (default: the sum of its parts'). A part a budget cuts off is reported as cut off, its tests never
# reached as not run; parts that only skip on one GPU (two-GPU tests) are not started there.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash run_scripts/gpu_check.sh OUTDIR [--bundle DIR] [--dry-run]"
out="" bundle="" dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=${2:?--bundle needs a folder}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1; $usage" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "gpu_check.sh: one OUTDIR only; $usage" >&2; exit 2; }; out=$1; shift ;;
  esac
done
[ -n "$out" ] || { echo "$usage" >&2; exit 2; }
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 1 ]; then
  exec "$PY" bench/gpu.py plan ${bundle:+--bundle "$bundle"}
fi
# GPU_CHECK_ON_CPU=1 runs the whole plumbing on a CPU (the tests skip, the benchmarks run --tiny):
# a check of this script itself, never a result.
tiny=()
if [ "${GPU_CHECK_ON_CPU:-0}" = 1 ]; then
  tiny=(--tiny)
else
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { echo "gpu_check.sh: $PY sees no CUDA device (on a CPU machine: --dry-run)" >&2; exit 2; }
fi
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/device.txt" || true
# A cache of its own: the bundle's tokenizer becomes the embedded model there (tokenizer only);
# removed when the check ends, also when it is stopped (SIGTERM/SIGINT are passed on to the check,
# which writes its report and exits 124).
work=$(mktemp -d "${TMPDIR:-/tmp}/relay-gpu-check.XXXXXX")
export RELAY_CACHE="$work/cache" RELAY_TOKEN_CACHE="$work/tokens"
"$PY" bench/gpu.py check --out "$out" ${bundle:+--bundle "$bundle"} --parts "${GPU_CHECK_PARTS:-first}" ${tiny[@]+"${tiny[@]}"} &
check=$!
trap 'kill -TERM "$check" 2>/dev/null' TERM INT
wait "$check"; rc=$?
while kill -0 "$check" 2>/dev/null; do wait "$check"; rc=$?; done
rm -rf "$work"
exit "$rc"
