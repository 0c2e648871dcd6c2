"""What of this process's environment a vLLM server is started with: the variables it keeps (`KEPT_ENV`,
`KEPT_PREFIXES`: paths, locale, threads, CUDA, its own VLLM_ settings) and those it never gets
(`DROPPED_VLLM_ENV`: settings that open routes or change what it trusts), applied by `filtered_env`
(pure). pipeline/modeling/vllm_server.py adds the guard, the key and the CPU defaults on top."""

from __future__ import annotations

from typing import Mapping

KEPT_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TERM",
        "TMPDIR",
        "TEMP",
        "TMP",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "CC",
        "CXX",
        "CPATH",
        "LIBRARY_PATH",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "PYTHONUNBUFFERED",
        "PYTHONHASHSEED",
        "PYTHONWARNINGS",
        "PYTHONDONTWRITEBYTECODE",
        "DO_NOT_TRACK",
    }
)
KEPT_PREFIXES = (
    "LC_",
    "XDG_",
    "HF_",
    "HUGGING_FACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "NVSHMEM_",
    "UCX_",
    "GLOO_",
    "HIP_",
    "ROCM_",
    "ROCR_",
    "HSA_",
    "OMP_",
    "KMP_",
    "MKL_",
    "ONEDNN_",
    "DNNL_",
    "ATEN_",
    "TORCH_",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "TRITON_",
    "VLLM_",
)
"""What the server's environment keeps of Relay's (`server_env`): the system's basics, caches and
tokens of Hugging Face, the accelerator's, thread and instruction-set caps, compilers and vLLM's own."""
DROPPED_VLLM_ENV = frozenset(
    {
        # the development routes: /collective_rpc, /sleep, /reset_prefix_cache, /server_info, ...
        "VLLM_SERVER_DEV_MODE",
        "VLLM_API_KEY",  # the guard holds the key (a stray one would only half-key the server)
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",  # /v1/load_lora_adapter: weights from any path, at runtime
        "VLLM_TORCH_PROFILER_DIR",  # /start_profile, /stop_profile
        "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",  # answers in the log
        "VLLM_ALLOW_INSECURE_SERIALIZATION",  # pickle between processes
        "VLLM_ENABLE_COHERE_API",
        "VLLM_ENABLE_RESPONSES_API_STORE",  # more routes
        "VLLM_USE_RUST_FRONTEND",
        "VLLM_RUST_FRONTEND_PATH",  # another HTTP front: without the guard
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
    }
)
"""vLLM variables Relay's environment may carry by chance that open routes or change what the
server trusts: dropped, and set by `server_env` where Relay means them."""


def filtered_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the server keeps of `environ` (KEPT_ENV, KEPT_PREFIXES, less DROPPED_VLLM_ENV) (pure)."""
    return {
        k: v for k, v in environ.items() if (k in KEPT_ENV or k.startswith(KEPT_PREFIXES)) and k not in DROPPED_VLLM_ENV
    }
