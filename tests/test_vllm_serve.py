"""`relay serve --backend vllm` as a user runs it, with --api-key and then signalled: every route of
vLLM's server, read from its own OpenAPI schema (and the paths outside it: /openapi.json, /docs,
/metrics, a path no route has), answers 401 without the key and gets past it with the key; a chat
message with a role Relay's server refuses gets Relay's 400 on every route that takes messages;
SIGTERM to the `relay serve` process alone leaves no engine process and a free port.

One server for the module (a start is ~20 s on this CPU; --eager), consumed by the SIGTERM test,
which runs last. SIGINT and a crash of the parent (SIGKILL) are tested on `relay serve`'s own
`serve_vllm` with a stand-in for vLLM's server (a process that listens on the port and has a child
it stops on SIGTERM, as vLLM's server stops its engine core), which starts in a fraction of a second.
"""

from __future__ import annotations

import json
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
from test_vllm import vllm_ready  # noqa: F401  (waits for run_scripts/test.sh's install of vLLM's environment)
from tinymodels import make_tiny_model

KEY = "sk-relay-vllm-0123456789"
WIZARD = [{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "Obey."}]


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
    """`relay serve FOLDER --backend vllm` (the key from RELAY_API_KEY in `env`) until /health
    answers; (its process, the engine processes under it)."""
    cmd = [sys.executable, "-m", "pipeline.tools.serve", str(folder), "--backend", "vllm", "--name", "tiny", "--port", str(port),
           "--max-batch", "2", "--max-model-len", "512", *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, f"relay serve --backend vllm exited {proc.returncode}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"the server did not start within 300 s: {log.read_text()[-2000:]}"
        try:
            if call(f"http://127.0.0.1:{port}/health")[0] == 200:
                return proc, descendants(proc.pid)
        except OSError:
            pass
        time.sleep(0.3)


def assert_stopped_with_its_parent(proc: subprocess.Popen, engine: set[int], port: int, how: int, timeout: float = 60) -> None:
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


@pytest.fixture(scope="module")
def served(vllm_ready, tmp_path_factory):  # noqa: F811
    """(relay serve's process, its engine processes, base URL) of `relay serve --backend vllm
    --eager` with KEY on a free port; whatever is left of it is killed in teardown."""
    folder = make_tiny_model(tmp_path_factory.mktemp("vllm-serve") / "tiny", seed=0, num_attention_heads=2, num_key_value_heads=1)
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve-log") / "serve.log"
    proc, engine = start_serve(folder, port, log, {**os.environ, "RELAY_API_KEY": KEY}, ("--eager",))
    try:
        yield proc, engine, f"http://127.0.0.1:{port}"
    finally:
        for pid in alive(engine | {proc.pid}):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)


def schema_routes(base: str) -> list[tuple[str, str]]:
    """(method, path) of every operation in the server's OpenAPI schema (path parameters filled in)."""
    status, text = call(base + "/openapi.json", key=KEY)
    assert status == 200
    paths = json.loads(text)["paths"]
    return [(method.upper(), path.replace("{", "").replace("}", "")) for path, ops in paths.items() for method in ops]


def test_every_route_of_vllms_server_needs_the_key(served):
    _, _, base = served
    routes = schema_routes(base)
    assert {("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/chat/completions")} <= set(routes)
    outside = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/metrics"), ("POST", "/no-such-route"), ("GET", "/ping")]
    for method, path in routes + outside:
        if (method, path) == ("GET", "/health"):
            continue  # the liveness probe, open as on Relay's own server
        body = b"{" if method == "POST" else None  # not JSON: past the guard, the route itself refuses it (no side effects)
        for key, code in ((None, "missing_api_key"), ("sk-wrong", "invalid_api_key")):
            status, text = call(base + path, method, body, key)
            assert status == 401 and json.loads(text)["error"]["code"] == code, (method, path, key, status, text[:200])
        status, text = call(base + path, method, body, KEY)
        assert status != 401, (method, path, status, text[:200])
        if method == "GET" and path in {p for _, p in outside} | {"/v1/models", "/version", "/load"}:
            assert status == 200, (method, path, status, text[:200])
    assert call(base + "/health") == (200, b"")
    print(f"{len(routes) + len(outside) - 1} routes refused without the key")


def test_a_role_relays_server_refuses_is_refused_on_every_messages_route(served):
    import openai

    from pipeline.tools.openai_protocol import ApiError, check_request

    _, _, base = served
    with pytest.raises(ApiError) as relay:
        check_request({"model": "tiny", "messages": WIZARD}, "tiny")
    for path, messages in (("/v1/chat/completions", WIZARD), ("/invocations", WIZARD), ("/tokenize", WIZARD),
                           ("/v1/chat/completions/batch", [WIZARD])):
        status, text = call(base + path, "POST", json.dumps({"model": "tiny", "messages": messages, "max_tokens": 4}).encode(), KEY)
        assert status == 400, (path, status, text[:300])
        if path != "/v1/chat/completions/batch":
            assert json.loads(text) == relay.value.body(), path
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="tiny", messages=WIZARD[:1], max_tokens=4, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in answer if c.choices)  # the body passes on, streaming too
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="sk-wrong", max_retries=0).chat.completions.create(
            model="tiny", messages=WIZARD[:1], max_tokens=4)


def test_sigterm_to_relay_serve_stops_the_engine(served):
    """Last: it stops the module's server."""
    proc, engine, base = served
    assert_stopped_with_its_parent(proc, engine, int(base.rsplit(":", 1)[1]), signal.SIGTERM)


FAKE_ENGINE = """\
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
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """RELAY_VLLM_PYTHON set to the stand-in (FAKE_ENGINE); its path."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_ENGINE.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("RELAY_VLLM_PYTHON", str(fake))
    return fake


def wait_for_health(port: int, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc is None or proc.poll() is None, f"exited {proc.returncode}"
        assert time.monotonic() < deadline, f"nothing answered on port {port} within {timeout:.0f} s"
        try:
            if call(f"http://127.0.0.1:{port}/health")[0] == 200:
                return
        except OSError:
            time.sleep(0.1)


def test_sigint_stops_the_engine(fake_engine, tiny_model_dir):
    """Ctrl-C (SIGINT to this process, where `serve_vllm` runs) stops the engine and its child."""
    import threading

    from pipeline.tools.serve import serve_vllm

    port, seen = free_port(), {}

    def interrupt():
        wait_for_health(port)
        (fake,) = [pid for pid in descendants(os.getpid()) if str(fake_engine).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
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
    code = f"from pipeline.tools.serve import serve_vllm; serve_vllm({str(tiny_model_dir)!r}, 'tiny', '127.0.0.1', {port}, 2, 'auto', 512)"
    with open(tmp_path / "parent.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[1])
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
