"""vLLM's OpenAI-compatible server as a subprocess, for `relay serve --backend vllm` and the
`vllm` generation backend of the RL stages.

vLLM runs in its own environment (run_scripts/install_vllm.sh makes $RELAY_VLLM_VENV, default
bench/.venv-vllm): it pins transformers (vllm-cpu 0.32.0: >=5.16.1,<5.20) below the project's, so it
cannot be imported beside Relay; it is reached over HTTP on 127.0.0.1 instead. The interpreter is,
in order, $RELAY_VLLM_PYTHON, that environment's bin/python (once install_vllm.sh has finished
there), or this one when it can import vllm (a CUDA machine with `pip install vllm` in the main
environment).

On a CPU the server is kept small (the machine is shared): a 1 GiB KV cache
(VLLM_CPU_KVCACHE_SPACE), a short context, few sequences at once, fp32, and the model run inside
the engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0 there: vLLM's default on a CPU is one
more process, the worker, whose message queue the engine core polls). On a few cores that process
costs seconds of every start and a share of the decode rate (bench/RESULTS.md).

Every route needs a key. vLLM's own key covers /v1 only (/invocations, /tokenize, the development
routes answer without it), so the server runs Relay's guard (vllm_side/relay_vllm_guard.py, an
ASGI middleware outside all of vLLM's app): `relay serve --api-key` gives it the user's key,
`VLLMServer` a random one per server, which `post` sends. The server's environment is Relay's
filtered (`server_env`): system, locale, Hugging Face, accelerator, thread and compiler variables
and vLLM's own, less those that open routes or change what the server trusts
(VLLM_SERVER_DEV_MODE, VLLM_API_KEY, ...), which Relay sets itself when it means to; other
programs' secrets and torchrun's rank variables stay out.

The server dies with the process that started it (`launch`): its own process group, stopped
whole (`stop_group`), and on Linux PR_SET_PDEATHSIG, so a parent killed outright (SIGKILL, a
crash) still takes it down: vLLM stops its children (engine core, resource tracker) on SIGTERM.
Its temporary files (the engine's IPC sockets, its process group's rendezvous file) go to a folder
of its own, removed when it is stopped (or at the next start, where its parent was killed outright);
torch's compile cache stays where it was (`launch`).
"""

from __future__ import annotations

import ctypes
import getpass
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from pipeline.modeling.vllm_env import filtered_env

ROOT = Path(__file__).resolve().parents[2]
SIDE_VENV = ROOT / "bench" / ".venv-vllm"
"""Where run_scripts/install_vllm.sh makes vLLM's environment unless RELAY_VLLM_VENV names another."""
INSTALLED_MARKER = ".relay-installed"
"""install_vllm.sh's stamp: written last, so a half-made environment lacks it."""
GUARD_DIR = Path(__file__).resolve().parent / "vllm_side"
"""The only folder of Relay's on the server's PYTHONPATH: the guard it loads as middleware."""
GUARD = "relay_vllm_guard.Guard"
KEY_ENV, ROLES_ENV = "RELAY_VLLM_KEY", "RELAY_VLLM_ROLES"
"""The guard's key and the chat roles it accepts, in the server's environment (vllm_side/relay_vllm_guard.py)."""


class VLLMError(RuntimeError):
    """vLLM is not installed, or its server did not start."""


def side_venv() -> Path:
    """vLLM's own environment: $RELAY_VLLM_VENV (a relative path from the repository root, where
    install_vllm.sh runs) or bench/.venv-vllm."""
    named = os.environ.get("RELAY_VLLM_VENV", "").strip()
    return ROOT / named if named else SIDE_VENV


def vllm_python() -> Optional[str]:
    """The interpreter that runs vLLM (see the module docstring), or None when there is none."""
    if os.environ.get("RELAY_VLLM_PYTHON"):
        return os.environ["RELAY_VLLM_PYTHON"]
    venv = side_venv()
    if (venv / INSTALLED_MARKER).exists():
        return str(venv / "bin" / "python")
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


ERROR_LINE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")
ERROR_ECHOES = ("EngineDeadError", "EngineCore encountered an issue")
"""Error lines that only echo an earlier one (the API process telling of the engine core's death)."""


def last_error(log: Path, tail_bytes: int = 262144) -> str:
    """The last "SomethingError: message" line in the end of a server's log that is not an echo of
    an earlier one (ERROR_ECHOES), cut to 300 characters; "" when there is none or no log."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - tail_bytes))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        found = ERROR_LINE.search(line)
        if found and not any(echo in line for echo in ERROR_ECHOES):
            return f"{found.group(1).rsplit('.', 1)[-1]}: {found.group(2).strip()}"[:300]
    return ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class ServerOptions:
    """How the vLLM server is started (the command line `server_command` builds)."""

    name: str
    """The model name clients use."""
    max_model_len: int = 1024
    max_num_seqs: int = 8
    dtype: str = "auto"
    """'auto' is fp32 on a CPU (the trainer's dtype there) and the checkpoint's on a GPU."""
    enable_lora: bool = False
    max_lora_rank: int = 16
    seed: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: Optional[float] = None
    """On a GPU, the share of its memory the engine may take (None: vLLM's own); not passed on a CPU,
    whose vLLM build reads it as a share of host memory."""
    dev_mode: bool = False
    """vLLM's development endpoints (/collective_rpc, /reset_prefix_cache): the RL backend's
    full fine-tuning weight sync. Only ever on 127.0.0.1."""
    sleep_mode: bool = False
    """--enable-sleep-mode and the development endpoints /sleep, /wake_up (CUDA only): the RL backend
    frees the engine's GPU memory while the trainer updates."""
    roles: tuple[str, ...] = ()
    """The chat roles the guard accepts (Relay's server's, for `relay serve`); empty: vLLM checks alone."""
    eager: Optional[bool] = None
    """--enforce-eager: no torch.compile of the model. None: eager on a CPU, compiled on a GPU. On a
    CPU the compile cache never loads back ('function' object has no attribute 'finalize_loading'),
    so every start compiles again, which costs more than the compiled decode saves in a run's
    sampling, a gold table or a chat (start and decode times in bench/RESULTS.md); a long-lived
    `relay serve --backend vllm` compiles unless --eager. An eager server on a CPU compiles nothing
    at all (`server_env`: TORCHDYNAMO_DISABLE): vLLM still compiles a sampler helper (the ranks of
    the sampled tokens' log-probs) on the first request that asks for log-probs, which on a CPU
    costs a C++ build the first time and a cache lookup at every start after, for an eager op on
    a few rows."""
    extra: list[str] = field(default_factory=list)


def server_command(python: str, folder: str, host: str, port: int, opts: ServerOptions) -> list[str]:
    """The `vllm serve` command line (vLLM's OpenAI API server module). `--generation-config vllm`
    keeps a checkpoint's generation_config.json (a shipped repetition_penalty, ...) from
    changing what requests sample."""
    dtype = opts.dtype if opts.dtype != "auto" or on_gpu() else "float32"
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder,
        "--served-model-name",
        opts.name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(opts.max_model_len),
        "--max-num-seqs",
        str(opts.max_num_seqs),
        "--dtype",
        dtype,
        "--seed",
        str(opts.seed),
        "--generation-config",
        "vllm",
        "--tensor-parallel-size",
        str(opts.tensor_parallel_size),
        "--middleware",
        GUARD,
    ]
    if opts.enable_lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(opts.max_lora_rank), "--max-loras", "1"]
    if opts.sleep_mode:
        cmd += ["--enable-sleep-mode"]
    if opts.gpu_memory_utilization is not None and on_gpu():
        cmd += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    if runs_eager(opts):
        cmd += ["--enforce-eager"]
    return cmd + list(opts.extra)


def runs_eager(opts: ServerOptions) -> bool:
    """Whether the server `opts` starts with --enforce-eager (`ServerOptions.eager`)."""
    return opts.eager if opts.eager is not None else not on_gpu()


def server_env(
    opts: ServerOptions, key: Optional[str] = None, environ: Optional[Mapping[str, str]] = None
) -> dict[str, str]:
    """The environment the server `opts` runs in: `environ` (default: this process's) filtered,
    the guard on its path with `key` (None: no key) and `opts.roles`, small on a CPU with the model
    in the engine-core process (the module docstring) and, eager there, no compiles at all
    (`ServerOptions.eager`), offline, and for the RL backend allowed to
    load adapters at runtime (/v1/load_lora_adapter) and to reach the development endpoints."""
    env = filtered_env(os.environ if environ is None else environ)
    env["PYTHONPATH"] = str(
        GUARD_DIR
    )  # the guard alone: Relay's tree (and its transformers) stays out of vLLM's environment
    if key:
        env[KEY_ENV] = key
    if opts.roles:
        env[ROLES_ENV] = json.dumps(list(opts.roles))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if opts.tensor_parallel_size == 1 and not on_gpu():
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if runs_eager(opts) and not on_gpu():
        env.setdefault("TORCHDYNAMO_DISABLE", "1")  # ServerOptions.eager
    if opts.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if opts.dev_mode or opts.sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


PR_SET_PDEATHSIG = 1


def _die_with_parent():
    """A preexec_fn that has the kernel send the child SIGTERM when the thread that started it
    ends (Linux; None elsewhere, or from a thread other than the main one, whose end is not the
    process's: the child would die with a worker thread)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


class ServerProcess(subprocess.Popen):
    """A server's process (`launch`) with its temporary folder (`scratch`), which `stop_group` removes."""

    scratch: Optional[str] = None


def temp_root(env: Mapping[str, str]) -> str:
    """The temporary folder a process started with `env` would use (Python's `tempfile` order:
    TMPDIR, TEMP, TMP, then this process's own choice)."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        if env.get(name) and os.path.isdir(env[name]):
            return env[name]
    return tempfile.gettempdir()


SCRATCH_PREFIX = "relay-vllm-"
SOCKET_PATH_MAX = 107
"""The longest Unix socket path (sockaddr_un.sun_path less its NUL, Linux)."""
SOCKET_NAME = 36
"""vLLM's IPC socket names (a uuid4), in its temporary folder."""
SHORT_ROOT = "/tmp"
"""Where a server's temporary folder goes when the user's temporary folder is too deep for its sockets."""


def scratch_parent(root: str) -> str:
    """`root`, or SHORT_ROOT where a folder in `root` would make vLLM's socket paths too long
    (then `root` itself where SHORT_ROOT is missing: vLLM says why it cannot start)."""
    longest = len(os.path.join(root, SCRATCH_PREFIX + "x" * 8, "x" * SOCKET_NAME))
    if longest <= SOCKET_PATH_MAX or not os.access(SHORT_ROOT, os.W_OK):
        return root
    return SHORT_ROOT


OWNER = ".relay-server"
"""The file in a server's temporary folder that names its process group and PID namespace (`launch`)."""


def pid_namespace() -> str:
    """This process's PID namespace ('' where unknown): a process group id means something only in it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def discard_stale_scratch(parent: str) -> None:
    """Remove the temporary folders (`launch`) in `parent` whose servers have ended without being
    stopped (their parent killed outright: no `stop_group` ran): this user's, named by `OWNER` in
    this PID namespace, whose process group has no process left. A folder of a server still
    running, another user's or one not yet named is kept."""
    here = pid_namespace()
    for folder in Path(parent).glob(SCRATCH_PREFIX + "*"):
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            group, namespace = (folder / OWNER).read_text().split(" ", 1)
            pgid = int(group)
        except (OSError, ValueError):
            continue
        if here and namespace == here and not group_alive(pgid):
            shutil.rmtree(folder, ignore_errors=True)


def inductor_cache_dir(root: str) -> str:
    """torch's default compile cache folder under the temporary folder `root`
    (torch/_inductor/runtime/cache_dir_utils.py `default_cache_dir`)."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(root, "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def launch(cmd: list[str], env: dict[str, str], **popen) -> ServerProcess:
    """Start `cmd` in a process group of its own (`stop_group` stops it whole; a Ctrl-C at the
    terminal reaches the parent only, which stops it) that dies with this process (`_die_with_parent`),
    with a temporary folder of its own (vLLM leaves its engine's IPC sockets and a rendezvous file
    in it at every start; under SHORT_ROOT where the user's is too deep for a socket's path,
    `scratch_parent`; the folder names its server's group, so that the next start removes it where
    the server's parent was killed outright, `discard_stale_scratch`), torch's compile cache kept
    where it was (TORCHINDUCTOR_CACHE_DIR unless set: a GPU server's compiled kernels, a CPU server's
    sampler helper, load back at the next start)."""
    root = temp_root(env)
    parent = scratch_parent(root)
    discard_stale_scratch(parent)
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=parent)
    env = {**env, "TMPDIR": scratch, "TEMP": scratch, "TMP": scratch}
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir(root))
    try:
        proc = ServerProcess(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent(), **popen)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    proc.scratch = scratch
    try:
        (Path(scratch) / OWNER).write_text(f"{proc.pid} {pid_namespace()}")
    except OSError:  # the folder stays unnamed: only its own stop removes it
        pass
    return proc


def discard_scratch(proc: subprocess.Popen) -> None:
    """Remove the temporary folder of `proc` (`launch`), once its group has ended."""
    scratch = getattr(proc, "scratch", None)
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still running (zombies, which hold nothing, aside)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def stop_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop `proc`'s process group (`launch`): SIGTERM, `grace` seconds for it and its children
    to exit (vLLM's resource tracker cleans up after the server), then SIGKILL to whatever is left;
    then its temporary folder goes."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    discard_scratch(proc)


class VLLMServer:
    """A running vLLM server: `with VLLMServer(folder, opts) as server: server.base_url ...`, keyed
    on every route with `key` (default: a random one of its own, which `post` sends). Stopping
    kills its whole process group (vLLM starts an engine-core child process); so does the end of
    the process that started it (`launch`)."""

    def __init__(
        self,
        folder: str,
        opts: ServerOptions,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        python: Optional[str] = None,
        log_path: Optional[Path] = None,
        start_timeout: float = 600.0,
        key: Optional[str] = None,
    ):
        self.python = python or vllm_python()
        if self.python is None:
            raise VLLMError(
                "vLLM is not installed: run bash run_scripts/install_vllm.sh (or pip install vllm on a CUDA machine)"
            )
        self.folder, self.opts, self.host = folder, opts, host
        self.port = port or free_port()
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.key = key or secrets.token_urlsafe(32)
        self.proc: Optional[subprocess.Popen] = None

    @property
    def headers(self) -> dict[str, str]:
        """What every request to the server carries (its key)."""
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "VLLMServer":
        cmd = server_command(self.python, self.folder, self.host, self.port, self.opts)
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = launch(cmd, server_env(self.opts, self.key), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise VLLMError(
                    f"the vLLM server on {self.folder} exited with code {self.proc.returncode} while starting"
                    + self.where()
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise VLLMError(f"the vLLM server on {self.folder} did not answer within {self.start_timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            stop_group(self.proc)
        else:  # it ended by itself (vLLM stops its children as it exits)
            discard_scratch(self.proc)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def where(self) -> str:
        """Where a failure of the server is told: "; its log: PATH" and the last error the log
        names (vLLM's own HTTP answer to a dead engine only says to look above its stack trace)."""
        if not self.log_path:
            return ""
        cause = last_error(Path(self.log_path))
        return f"; its log: {self.log_path}" + (f" (last error: {cause})" if cause else "")

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        """POST JSON to the server; the parsed answer (or {} for an empty one).

        Raises:
            VLLMError: an HTTP error, with the server's message.
        """
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **self.headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as err:
            told = err.read().decode(errors="replace")[:500]
            where = self.where() if err.code >= 500 else ""  # a server's failure, not the request's
            raise VLLMError(f"vLLM {path}: HTTP {err.code}: {told}{where}") from None
        try:
            return json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            return {"text": text.decode(errors="replace")}


def completion_ids(
    server: VLLMServer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: list[int],
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
) -> list[list[int]]:
    """The ids a server (`server.opts.name`) answers each prompt with, cut before the first of
    `eos_ids` (greedy at temperature 0); one request per prompt, `server.opts.max_num_seqs` at a
    time, so vLLM batches them. For the gold table (`python -m pipeline.tools.gold --backend vllm`)
    and `relay chat --backend vllm`.

    Raises:
        VLLMError: the server refused a request (its message).
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: list[int]) -> list[int]:
        body = {
            "model": server.opts.name,
            "prompt": list(prompt),
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop_token_ids": list(eos_ids),
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if seed is not None:
            body["seed"] = seed
        (choice,) = server.post("/v1/completions", body)["choices"]
        ids = list(choice.get("token_ids") or [])
        return ids[: next((i for i, t in enumerate(ids) if t in eos_ids), len(ids))]

    with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), server.opts.max_num_seqs))) as pool:
        return list(pool.map(one, prompts))


def prompt_topk(server: VLLMServer, sequences: list[list[int]], k: int) -> list[list[Optional[dict[int, float]]]]:
    """Per sequence, per position p: the server's top-k {token id: log-prob} of the token at p
    given the tokens before it (None at p 0), its prompt log-probs (vLLM's raw log-probs:
    temperature 1). One /v1/completions request per sequence (1 token generated and dropped),
    `server.opts.max_num_seqs` at a time. For a served distillation teacher.

    Raises:
        VLLMError: the server refused a request (its message).
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(ids: list[int]) -> list[Optional[dict[int, float]]]:
        body = {"model": server.opts.name, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0}
        (choice,) = server.post("/v1/completions", {**body, "prompt_logprobs": k})["choices"]
        out: list[Optional[dict[int, float]]] = []
        for position in choice["prompt_logprobs"]:
            # each position also reports the token actually there, at its own rank when below the top k
            ranked = sorted(((v["rank"], int(t), v["logprob"]) for t, v in (position or {}).items()))
            out.append({t: lp for rank, t, lp in ranked[:k] if rank <= k} if position is not None else None)
        return out

    # vllm-cpu 0.32's LoRA logits path fails on the prompt log-probs of two requests in one step
    # (punica_cpu add_lora_logits: an einsum of the requests' indices against the prompt's rows,
    # which kills the engine): a server with runtime LoRA on gets one request at a time
    at_once = 1 if server.opts.enable_lora else server.opts.max_num_seqs
    with ThreadPoolExecutor(max_workers=max(1, min(len(sequences), at_once))) as pool:
        return list(pool.map(one, sequences))
