"""`relay serve --backend vllm`: vLLM's own OpenAI-compatible server on a model folder, from the
environment pipeline.modeling.vllm_server finds, with the tool-call parser the folder's template
needs and Relay's key guard on every route (the server's environment carries the key, never its
command line); stopped with its whole process group however this process ends. pipeline/tools/serve.py
chooses the backend and parses the command line."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Optional

from pipeline.tools.openai_protocol import ROLES


def vllm_command(folder: str, host: str, port: int, python: str = sys.executable, opts=None) -> list[str]:
    """vLLM's own OpenAI-compatible server on `folder` (pipeline.modeling.vllm_server's command
    line), with the tool-call parser that reads the folder's call layout when its template
    renders tools (serve_tools.vllm_tool_flags)."""
    from pipeline.modeling.vllm_server import ServerOptions, server_command
    from pipeline.tools.serve_tools import vllm_tool_flags

    return server_command(python, folder, host, port, opts or ServerOptions(name=Path(folder).name)) + vllm_tool_flags(
        folder
    )


class Stopped(Exception):
    """A signal asked `relay serve` to stop."""


def serve_vllm(
    folder: str,
    name: str,
    host: str,
    port: int,
    max_batch: int,
    dtype: str,
    max_model_len: int,
    api_key: Optional[str] = None,
    eager: bool = False,
) -> int:
    """`vllm_command` until it exits or this process is asked to stop (SIGTERM, SIGINT, SIGHUP),
    from the environment pipeline.modeling.vllm_server finds (bench/.venv-vllm on a CPU:
    run_scripts/install_vllm.sh). The API key and Relay's chat roles go to the server's guard in
    its environment, never on its command line. Either way out, the server's whole process group
    is stopped before this returns."""
    from pipeline.modeling.vllm_env import DROPPED_VLLM_ENV
    from pipeline.modeling.vllm_server import ServerOptions, launch, server_env, stop_group, vllm_python

    python = vllm_python()
    if python is None:
        print(
            "error: --backend vllm: vLLM is not installed (bash run_scripts/install_vllm.sh makes bench/.venv-vllm; "
            "or pip install vllm on a CUDA machine)",
            file=sys.stderr,
        )
        return 2
    dtypes = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    opts = ServerOptions(
        name=name,
        max_num_seqs=max_batch,
        dtype=dtypes[dtype],
        max_model_len=max_model_len,
        eager=eager,
        roles=tuple(ROLES),
    )
    dropped = sorted(DROPPED_VLLM_ENV & set(os.environ))
    if dropped:
        print(
            f"note: not passed to vLLM (they open routes or change what it trusts): {', '.join(dropped)}",
            file=sys.stderr,
        )
    guard = (
        "API key required on every route but GET /health"
        if api_key
        else "no API key: anyone who reaches the port can use it"
    )
    print(
        f"serving {folder} as '{name}' (vLLM, {python}) on http://{host}:{port}/v1, {guard}  (Ctrl-C stops)",
        file=sys.stderr,
    )

    def stop(signum, frame):
        raise Stopped(signum)

    asked = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.signal(sig, stop) for sig in asked}
    proc = None
    try:
        proc = launch(vllm_command(folder, host, port, python, opts), server_env(opts, api_key))
        return proc.wait()
    except Stopped:
        return 0
    finally:
        for sig in asked:  # a second Ctrl-C must not cut the stop short: it ends in SIGKILL anyway
            signal.signal(sig, signal.SIG_IGN)
        if proc is not None:
            stop_group(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
