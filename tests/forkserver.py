"""A fork server for the Python processes the tests start: stage scripts, ranks, torchrun, the driver.

Importing torch, transformers, peft and accelerate is most of what a tiny stage run costs on a CPU
(bench/RESULTS.md), and the suite starts hundreds of such processes. `python_for_tests()` returns the
path of a client (tests/forkclient.py) that a test uses where it would use `sys.executable`; each
command it runs is a child forked from a server that imported those libraries once, and is
otherwise the process a fresh interpreter would be:

- the same argv, working directory, environment, sys.path (the script's folder or '' first, then
  PYTHONPATH) and standard streams (the client's own, passed over the socket); `sys.executable` is
  the client, so torchrun's ranks and a driver's stages are forked in turn;
- Relay's own modules are not preloaded: they import in the child, reading the environment then;
- the client forwards its signals to the child and exits with the child's code or signal, so a
  driver, torchrun or a test that signals it sees what it would see with the real interpreter;
- a variable that a preloaded library reads at import (OMP_*, MKL_*, HF_*, TORCH_*, ...) that differs
  from the server's, or an interpreter option the client does not know, runs the real interpreter;
- two servers per pytest worker, with different string-hash seeds: ranks alternate between them
  (RANK's parity), so two ranks iterate a set of strings in different orders, as under torchrun.

The servers are single-threaded (a select loop), so forking them is safe; each stops when its pytest
worker does (its stdin closes), killing children whose client has gone. Each logs what it ran and
what it left to the real interpreter, and why (RELAY_TEST_FORK_LOGS=DIR keeps the logs there).
RELAY_TEST_FORK=0 turns it off (the real interpreter everywhere).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
IMPORT_TIME = (
    "OMP_", "MKL_", "KMP_", "GOMP_", "ONEDNN_", "DNNL_", "PYTORCH_", "TORCH_", "CUDA_", "HF_", "HUGGINGFACE_",
    "TRANSFORMERS_", "ACCELERATE_", "BNB_", "BITSANDBYTES_", "PEFT_", "PYTHON", "LD_", "RELAY_CPU_ISA",
    "TOKENIZERS_",
)  # fmt: skip
"""Prefixes of the variables read while the interpreter starts or the preloaded libraries import: a
request whose value differs from the server's runs the real interpreter."""
HANDLED = (
    "TORCHELASTIC_",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "KMP_DUPLICATE_LIB_OK",
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
)
"""Read only when a process group starts (torchrun sets them for its ranks) or when called
(torch.cuda.is_available reads PYTORCH_NVML_BASED_CUDA_CHECK each time; DeepSpeed's accelerator probe,
run by a test's first tiny model, leaves it set), or only when a second OpenMP runtime loads
(KMP_DUPLICATE_LIB_OK, which importing scikit-learn or an inductor compile sets in a test's process),
or applied by the child (PYTHON itself is the driver's interpreter, no interpreter setting)."""

_clients: dict[str, str] = {}


def python_for_tests() -> str:
    """The interpreter path for a test's child processes: the fork client (servers started on first
    use, for this pytest worker's lifetime), or sys.executable where RELAY_TEST_FORK=0 or on a GPU
    machine (CUDA after a fork is not the process a user runs)."""
    if os.environ.get("RELAY_TEST_FORK", "1") == "0" or _cuda():
        return sys.executable
    if "client" not in _clients:
        folder = Path(tempfile.mkdtemp(prefix="relay-fork-"))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # what every process the tests start runs with
        servers = [str(folder / f"server{index}.sock") for index in (0, 1)]
        for index, sock in enumerate(servers):
            logs = Path(os.environ.get("RELAY_TEST_FORK_LOGS", folder))  # a folder to keep them in
            logs.mkdir(parents=True, exist_ok=True)
            log = open(logs / f"server{index}-{os.getpid()}.log", "w")
            subprocess.Popen(
                [sys.executable, str(Path(__file__)), "serve", sock],
                stdin=subprocess.PIPE,  # closed when this process ends: the server then stops
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        client = folder / "python"
        lines = (
            "import sys",
            f"sys.path.insert(0, {str(TESTS)!r})",
            "import forkclient",
            f"forkclient.main({servers!r}, {sys.executable!r})",
        )
        client.write_text(f"#!{sys.executable} -S\n" + "".join(line + "\n" for line in lines))
        client.chmod(0o755)
        atexit.register(shutil.rmtree, folder, True)  # the servers stop on their own (stdin closed)
        _clients["client"] = str(client)
    return _clients["client"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------


def preload() -> None:
    """What a stage, a rank or torchrun imports from outside Relay (not Relay: module docstring)."""
    import accelerate  # noqa: F401
    import numpy  # noqa: F401
    import peft  # noqa: F401  (imports bitsandbytes where it is installed)
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.run  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401
    import transformers
    import transformers.models.llama.modeling_llama  # noqa: F401
    import yaml  # noqa: F401

    transformers.AutoModelForCausalLM, transformers.AutoModelForSequenceClassification, transformers.AutoTokenizer  # noqa: B018


def refusal(request: dict, base_env: dict, set_on_import: dict) -> str:
    """Why this server cannot run the request as a fresh interpreter would ('' when it can)."""
    env = request["env"]
    for key in set(env) | set(base_env) | set(set_on_import):
        if not key.startswith(IMPORT_TIME) or key.startswith(HANDLED) or key == "PYTHON":
            continue
        if key in set_on_import and env.get(key) in (None, set_on_import[key]):
            continue  # what the imports set (in the child too: `become`)
        if env.get(key) != base_env.get(key):
            return f"{key} differs"
    return ""


def become(request: dict, fds: list[int], client: str, base_path: list[str], set_on_import: dict) -> None:
    """Turn this forked child into the requested process (module docstring) and run it; never returns.
    It joins the client's process group where the client is in the server's session, else it leads a
    session of its own (torchrun starts each rank, the client, in a new session): either way a signal
    to the client's group reaches the client, which forwards it."""
    if request["sid"] == os.getsid(0):
        os.setpgid(0, request["pgid"])
    else:
        os.setsid()
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_on_import, **request["env"]})  # what the imports would have set, as they did here
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    argv = list(request["argv"])
    if argv[0] == "-u" or os.environ.get("PYTHONUNBUFFERED"):
        argv = argv[1:] if argv[0] == "-u" else argv
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.executable = client
    code = 0
    try:
        import runpy

        if argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            sys.modules.pop(argv[1], None)  # a preloaded module (torch.distributed.run) runs afresh as __main__
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *extra, *base_path]
            import types

            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = argv
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *extra, *base_path]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as end:
        if end.code is None:
            code = 0
        elif isinstance(end.code, int):
            code = end.code
        else:
            print(end.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finish(code)


def finish(code: int) -> None:
    """End as the interpreter does: non-daemon threads joined, atexit handlers, the files still open
    flushed (the interpreter's teardown closes them; `os._exit` would drop what they buffer), streams
    flushed."""
    import atexit
    import gc
    import io
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        for obj in gc.get_objects():  # the child's own objects: the server's are frozen, out of reach
            if issubclass(type(obj), io.IOBase):
                with contextlib.suppress(Exception):
                    if not obj.closed:
                        obj.flush()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        if code < 0:  # died of a signal (an uncaught KeyboardInterrupt: SIGINT), as the interpreter does
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the children, not the server
    base_env = dict(os.environ)
    try:
        preload()
    except BaseException:
        Path(path + ".failed").touch()  # its clients run the real interpreter
        raise
    import gc

    gc.collect()
    gc.freeze()  # the preloaded objects: out of every child's collections, shared with it unchanged
    import weakref

    for pending in weakref.finalize._registry.values():  # type: ignore[attr-defined]
        # The imports' finalizers (torch's operator libraries unregistering themselves): this process's
        # state, undone in memory only; run at every child's exit, they cost it more than the rest of
        # its exit (pages copied on write), and nothing outside the child would see them run.
        pending.atexit = False
    set_on_import = {k: v for k, v in os.environ.items() if base_env.get(k) != v}
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    client = str(Path(path).parent / "python")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    reading: dict[socket.socket, tuple[bytearray, list[int]]] = {}
    running: dict[int, socket.socket] = {}
    while True:
        watched = [listener, sys.stdin, *reading, *running.values()]
        ready, _, _ = select.select(watched, [], [], 0.05)
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                conn.close()
        for sock in ready:
            if sock is sys.stdin:
                if not os.read(sys.stdin.fileno(), 4096):  # the pytest worker ended
                    for pid in running:
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                    return
            elif sock is listener:
                conn, _ = listener.accept()
                reading[conn] = (bytearray(), [])
            elif sock in reading:
                buffer, fds = reading[sock]
                data, got, _, _ = socket.recv_fds(sock, 1 << 20, 3)
                buffer += data
                fds += got
                if not data:
                    del reading[sock]
                    sock.close()
                    continue
                if len(buffer) < 4 or len(buffer) < 4 + struct.unpack("!I", buffer[:4])[0]:
                    continue
                del reading[sock]
                request = json.loads(bytes(buffer[4:]))
                reason = refusal(request, base_env, set_on_import)
                print(f"{'real interpreter: ' + reason if reason else 'forked'}: {request['argv'][:4]}", flush=True)
                if reason:
                    sock.sendall(json.dumps({"fallback": reason}).encode() + b"\n")
                    sock.close()
                    for fd in fds:
                        os.close(fd)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other, (_, pending) in reading.items():
                        other.close()
                        for fd in pending:
                            os.close(fd)
                    for other in running.values():
                        other.close()
                    sock.close()
                    become(request, fds, client, base_path, set_on_import)
                for fd in fds:
                    os.close(fd)
                running[pid] = sock
                with contextlib.suppress(OSError):  # a client gone already: seen below, and its child killed
                    sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:  # a running child's client: readable only when it has gone (killed)
                pid = next((p for p, s in running.items() if s is sock), None)
                if pid is None:
                    continue  # its child ended and was reaped above, in this same round: its socket is closed
                try:
                    gone = not sock.recv(1)
                except OSError:  # reset: the client died with a reply of the server's unread
                    gone = True
                if gone:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
