#!/usr/bin/env bash
# Installs Relay from a bundle (relay bundle --out DIR) into a Python that already has CUDA torch,
# transformers, accelerate and peft; run through `bash run_scripts/install.sh --bundle DIR`.
#
#   PYTHON=python3 bash run_scripts/install_bundle.sh DIR [--target SITE]
#
# Everything is --no-deps --no-index: nothing is fetched, nothing the node has is replaced (torch is
# checked before and after). Without --target, Relay itself is installed editable (the `relay`
# command); with it, the wheels go to SITE and Relay runs from this tree: PYTHONPATH=SITE:<repo>.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bundle=${1:?usage: install.sh --bundle DIR [--target SITE]}
target=""
if [ "${2:-}" = "--target" ]; then target=${3:?--target needs a folder}; fi
die() { echo "install.sh --bundle: $*" >&2; exit 1; }
torch_version() { "$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null; }
torch_before=$(torch_version) \
  || die "$PY has no torch: this mode installs into a Python that already has (CUDA) torch"
"$PY" -m pipeline.tools.bundle --check "$bundle" --budget-mib 1e9 >/dev/null || die "$bundle is not a complete bundle (see above)"
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
wheels=$("$PY" -c 'import json, sys; print(" ".join(sys.argv[1] + "/" + w["file"] for w in json.load(open(sys.argv[1] + "/bundle.json"))["wheels"]))' "$bundle")
if [ -n "$target" ]; then
  # shellcheck disable=SC2086
  pip install --no-index --no-deps --no-compile --upgrade --target "$target" $wheels
  export PYTHONPATH="$target:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  # shellcheck disable=SC2086
  pip install --no-index --no-deps $wheels
  pip install --no-index --no-deps --no-build-isolation -e .
fi
torch_after=$(torch_version)
[ "$torch_before" = "$torch_after" ] || die "torch changed from $torch_before to $torch_after (it must never be replaced)"
# Exit 3: installed, but an import or a version floor failed (compat's lines say which).
"$PY" -m pipeline.tools.compat || { echo "install.sh --bundle: installed, but Relay's imports report problems (above)" >&2; exit 3; }
