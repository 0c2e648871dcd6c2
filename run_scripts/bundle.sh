#!/usr/bin/env bash
# Builds the offline bundle: the wheels Relay needs on top of an existing CUDA torch environment
# (default: CPython 3.12, manylinux x86_64). docs/install.md: "an offline GPU node".
#
#   bash run_scripts/bundle.sh --out .whl [--python-version 3.12] [--budget-mib N]
#
# Runs where PyPI is reachable, in Relay's .venv (DeepSpeed's sdist is built against its torch).
set -euo pipefail
cd "$(dirname "$0")/.."
bash run_scripts/install.sh
exec .venv/bin/python -m pipeline.tools.bundle "$@"
