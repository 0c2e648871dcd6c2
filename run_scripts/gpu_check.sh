#!/usr/bin/env bash
# The GPU check: on a CUDA machine, in one command well under 10 minutes, install Relay from an
# offline bundle, run every GPU-marked test and the GPU benchmarks, and write one result file,
# OUTDIR/gpu_check.md (markdown for bench/RESULTS.md, the device named).
#
#   bash run_scripts/gpu_check.sh OUTDIR [--bundle DIR] [--dry-run]
#
# --bundle DIR: install from `relay bundle --out DIR` first (into a folder of its own: the node's
# Python and its torch are left as they are); without it Relay must already be importable.
# --dry-run (any machine): list what would run and check the bundle is complete; nothing runs.
# Time budgets in seconds (override in the environment): GPU_CHECK_TESTS_S (290) for all tests,
# GPU_CHECK_TEST_S (200) for one test, GPU_CHECK_BENCH_S (200) for all benchmarks; what a budget
# cuts off is reported as not run. GPU_CHECK_PARTS="tests bench" (default) picks the parts: a second
# device call can run the rest, e.g. GPU_CHECK_PARTS=tests GPU_CHECK_TESTS_S=540.
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
if [ "$dry" = 1 ]; then
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" bench/gpu.py plan ${bundle:+--bundle "$bundle"}
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
work=$(mktemp -d /tmp/relay-gpu-check.XXXXXX)
# A cache of its own: the bundle's tokenizer becomes the embedded model there (tokenizer only).
export RELAY_CACHE="$work/cache" RELAY_TOKEN_CACHE="$work/tokens"
started=$SECONDS
if [ -n "$bundle" ]; then
  bash run_scripts/install.sh --bundle "$bundle" --target "$work/site" >"$out/install.log" 2>&1
  code=$?  # 3: installed, but compat reports a problem: go on, the tests show what it breaks
  [ "$code" = 0 ] || [ "$code" = 3 ] \
    || { cat "$out/install.log"; echo "gpu_check.sh: the install from $bundle failed (above)" >&2; exit 1; }
  export PYTHONPATH="$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -m pipeline.tools.bundle --seed-cache "$bundle" >/dev/null
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -m pipeline.tools.compat >"$out/install.log" 2>&1
fi
cat "$out/install.log"
parts=" ${GPU_CHECK_PARTS:-tests bench} "
echo "gpu_check.sh: installed in $((SECONDS - started)) s; parts:$parts"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
files=()
[[ "$parts" == *" tests "* ]] && mapfile -t files < <("$PY" -c 'import sys; sys.path.insert(0, "."); from bench.gpu import GPU_TESTS; [print(a) for a, _ in GPU_TESTS]')
deadline=$((SECONDS + ${GPU_CHECK_TESTS_S:-290}))
export RELAY_COLLECTED="$work/collected.txt"
n=0
for spec in "${files[@]+"${files[@]}"}"; do
  left=$((deadline - SECONDS))
  n=$((n + 1))
  if [ "$left" -lt 20 ]; then echo "gpu_check.sh: not run (tests' time budget spent): $spec" | tee -a "$out/not_run.txt"; continue; fi
  # shellcheck disable=SC2086  # spec is "FILE [-k EXPR]"
  timeout -s INT -k 15 "$left" "$PY" -m pytest -q -p no:cacheprovider -p bench.gpu_collect -rfEs --timeout "${GPU_CHECK_TEST_S:-200}" \
    --junitxml "$work/tests-$n.xml" $spec 2>&1 | tee -a "$out/tests.log"
done
if [[ "$parts" == *" bench "* ]]; then
  echo "gpu_check.sh: benchmarks at $((SECONDS - started)) s (${GPU_CHECK_BENCH_S:-200} s budget)"
  timeout -s INT -k 15 $((${GPU_CHECK_BENCH_S:-200} + 30)) "$PY" bench/gpu.py run --out "$out/bench.json" \
    --budget "${GPU_CHECK_BENCH_S:-200}" ${tiny[@]+"${tiny[@]}"} 2>&1 | tee "$out/bench.log" | grep -v -i "warn" | tail -40
fi
junits=()
for f in "$work"/tests-*.xml; do [ -f "$f" ] && junits+=(--junit "$f"); done
"$PY" bench/gpu_report.py ${junits[@]+"${junits[@]}"} --bench "$out/bench.json" --log "$out/install.log" \
  --not-run "$out/not_run.txt" --collected "$work/collected.txt" --out "$out/gpu_check.md"
echo "gpu_check.sh: wrote $out/gpu_check.md in $((SECONDS - started)) s"
