#!/usr/bin/env bash
# Installs Relay into .venv (skipped when nothing changed) and runs the test suite, offline.
#   bash run_scripts/test.sh [pytest args]
# The tests run in pytest-xdist workers, a test module to a worker, the longest modules first, the
# cores split between them (tests/conftest.py): 2 workers where the machine has 2 or more cores
# (one process uses about one core on average; bench/RESULTS.md). RELAY_TEST_WORKERS=N sets N; 1
# runs one process.
# The stage scripts, ranks and driver runs the tests start are forked from a server that has imported
# torch, transformers, peft and accelerate once (tests/forkserver.py: the same process otherwise);
# RELAY_TEST_FORK=0 starts each with the real interpreter instead.
# vLLM's side environment (run_scripts/install_vllm.sh; a no-op when present) builds in the
# background from the start, beside Relay's own install and then the tests; tests/test_vllm.py runs
# late (tests/conftest.py) and waits for it, failing (not skipping) when the install failed.
# RELAY_VLLM_INSTALL=0: no install (those tests then skip where the environment is absent).
set -euo pipefail
cd "$(dirname "$0")/.."
# Every temporary file of the run (pytest's folders, the logs torchrun leaves, vLLM's sockets, the
# fork servers') goes into one folder, removed when the run passes and named when it fails.
TMPDIR=$(mktemp -d "${TMPDIR:-/tmp}/relay-tests.XXXXXX")
export TMPDIR
vllm_pid=""
finish() {  # on every exit, a failed install included
  local code=$?
  # a run that never reached the vLLM tests (a selection, a failed install) leaves no half-made install running
  if [ -n "$vllm_pid" ] && [ ! -f "$RELAY_VLLM_INSTALL_STATUS.rc" ]; then
    kill -- "-$vllm_pid" 2>/dev/null || true
  fi
  if [ "$code" = 0 ]; then
    rm -rf "$TMPDIR"
  else
    echo "test.sh: this run's temporary files are in $TMPDIR" >&2
  fi
}
trap finish EXIT
if [ "${RELAY_VLLM_INSTALL:-1}" != 0 ]; then
  status=$(mktemp -d "$TMPDIR/relay-vllm-install.XXXXXX")/install
  # Started first, beside the main install (mostly one core: pip), not beside the tests, which use
  # every core. Its own session, so the whole install (pip included) can be stopped if pytest ends first.
  setsid bash -c 'bash run_scripts/install_vllm.sh >"$1.log" 2>&1; echo $? >"$1.rc.tmp"; mv "$1.rc.tmp" "$1.rc"' _ "$status" &
  vllm_pid=$!
  export RELAY_VLLM_INSTALL_STATUS=$status  # where the tests read how the install ended (.rc, .log)
  [ -z "${RELAY_VLLM_VENV:-}" ] || export RELAY_VLLM_PYTHON=$RELAY_VLLM_VENV/bin/python
fi
bash run_scripts/install.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
workers=${RELAY_TEST_WORKERS:-$([ "$(nproc)" -ge 2 ] && echo 2 || echo 1)}
parallel=()
[ "$workers" -le 1 ] || parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
# The linter and the formatter's check (pyproject.toml [tool.ruff]); a finding fails the command,
# after the tests have run.
lint=0
.venv/bin/ruff check --quiet . || lint=1
.venv/bin/ruff format --check --quiet . || lint=1
[ "$lint" = 0 ] || echo "test.sh: ruff found problems (above): ruff check --fix . && ruff format ." >&2
code=0
# pytest keeps its assertion-rewritten test modules as bytecode only where Python may write bytecode:
# with PYTHONDONTWRITEBYTECODE set, every worker would rewrite and compile every test module again at
# every run. The run's own processes write bytecode too (what install.sh did not compile: little).
PYTHONDONTWRITEBYTECODE='' .venv/bin/python -m pytest -q ${parallel[@]+"${parallel[@]}"} "$@" tests || code=$?
[ "$code" != 0 ] || code=$lint
exit $code
