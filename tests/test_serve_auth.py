"""`relay serve --api-key`, driven through its command line and the official `openai` client: the
right key is served, a wrong or missing one gets OpenAI's 401 (the client raises its
AuthenticationError), GET /health stays open and every other route needs the key; the key can come
from RELAY_API_KEY (out of `ps`). With --backend vllm it goes to Relay's guard inside vLLM's app
(pipeline/modeling/vllm_side/relay_vllm_guard.py), tested here on a small ASGI app in Relay's own
environment: every path, method and websocket needs the key, a chat message with a role Relay's
server refuses gets Relay's 400, and the body reaches the app unchanged. The vLLM server's
environment is filtered (`server_env`). The real vLLM server behind the guard: tests/test_vllm_serve.py."""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from fastapi import Request, WebSocket  # module level: FastAPI resolves the test app's (postponed) annotations here

from pipeline.tools import serve

KEY = "sk-relay-test-0123456789"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """The base URL of `relay serve TINY` started with the key in RELAY_API_KEY (uvicorn on a free
    port in a thread instead of the blocking `run`)."""
    import uvicorn

    started: dict = {}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    def run_in_thread(app, host, port, sock_=None):
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not uv.started:
            time.sleep(0.02)
        started["uv"] = uv

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(serve.API_KEY_ENV, KEY)
        mp.setattr(serve, "run", run_in_thread)
        assert (
            serve.main([str(tiny_model_dir), "--backend", "transformers", "--name", "tiny", "--max-new-tokens", "4"])
            == 0
        )
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    started["uv"].should_exit = True


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def raw(url: str, headers: dict) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ask(c: openai.OpenAI):
    return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)


def test_right_key_is_served(served):
    c = client(served, KEY)
    assert ask(c).choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in c.models.list()] == ["tiny"]


@pytest.mark.parametrize(
    "key,code", [("sk-wrong", "invalid_api_key"), (KEY + "x", "invalid_api_key"), (KEY[:-1], "invalid_api_key")]
)
def test_wrong_key_is_an_openai_401(served, key, code):
    with pytest.raises(openai.AuthenticationError) as err:
        ask(client(served, key))
    assert err.value.status_code == 401 and err.value.body["code"] == code
    with pytest.raises(openai.AuthenticationError):
        client(served, key).models.list()


def test_missing_key_is_an_openai_401_and_health_stays_open(served):
    # The openai client always sends its key, so "none" is a request without the header.
    status, body = raw(served + "/v1/models", {})
    assert (
        status == 401
        and body["error"]["code"] == "missing_api_key"
        and body["error"]["type"] == "invalid_request_error"
    )
    assert raw(served + "/health", {}) == (200, {})
    assert raw(served + "/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 200
    for path in ("/openapi.json", "/docs", "/no-such-route"):  # every route, not only /v1's
        assert raw(served + path, {})[0] == 401, path
    assert raw(served + "/openapi.json", {"Authorization": f"Bearer {KEY}"})[0] == 200


def test_a_method_no_route_takes_needs_the_key_too_then_is_a_405_naming_the_methods(served):
    """OPTIONS passed without the key and got a 405 pointing at POST /v1/chat/completions. This
    server answers no CORS preflight (vLLM's lets OPTIONS through for its CORS middleware), so
    OPTIONS is one more method: the key first, like every route, then the path's own methods."""
    for method, path, allowed in [
        ("OPTIONS", "/v1/models", "GET"),
        ("PUT", "/v1/models", "GET"),
        ("OPTIONS", "/v1/chat/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
    ]:
        for headers, code in [({}, "missing_api_key"), ({"Authorization": "Bearer sk-wrong"}, "invalid_api_key")]:
            status, body, _ = sent(method, served + path, headers)
            assert status == 401 and body["error"]["code"] == code, (method, path, headers)
        status, body, answer_headers = sent(method, served + path, {"Authorization": f"Bearer {KEY}"})
        assert status == 405 and answer_headers["Allow"] == allowed, (method, path, body)
        assert body["error"]["message"] == f"{path} does not take {method}; it takes {allowed}"


def sent(method: str, url: str, headers: dict) -> tuple[int, dict, Any]:
    """(status, JSON body, headers) of a `method` request."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers, method=method), timeout=30) as answer:
            return answer.status, json.loads(answer.read()), answer.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


def test_key_error_compares_whole_header():
    assert serve.key_error(f"Bearer {KEY}", KEY) is None
    assert serve.key_error(KEY, KEY).code == "invalid_api_key"  # no scheme
    assert serve.key_error(None, KEY).code == "missing_api_key"


def test_vllm_backend_gets_the_key_and_roles_in_its_environment(monkeypatch, tiny_model_dir):
    """The key and Relay's roles reach the guard through the server's environment, never its
    command line; the server is started in its own process group and stopped whole on the way out."""
    from pipeline.modeling import vllm_server
    from pipeline.tools.openai_protocol import ROLES

    calls, stopped = [], []

    class Proc:
        pid = 0

        def wait(self):
            return 0

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(vllm_server, "launch", lambda cmd, env: calls.append((cmd, env)) or Proc())
    monkeypatch.setattr(vllm_server, "stop_group", stopped.append)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert serve.main([str(tiny_model_dir), "--backend", "vllm", "--api-key", KEY]) == 0
    ((cmd, env),) = calls
    assert env[vllm_server.KEY_ENV] == KEY and KEY not in " ".join(cmd) and "VLLM_API_KEY" not in env
    assert cmd[cmd.index("--middleware") + 1] == vllm_server.GUARD and env["PYTHONPATH"] == str(vllm_server.GUARD_DIR)
    assert json.loads(env[vllm_server.ROLES_ENV]) == list(ROLES) and "VLLM_SERVER_DEV_MODE" not in env
    assert len(stopped) == 1


def test_server_env_keeps_what_vllm_needs_and_drops_what_opens_routes():
    from pipeline.modeling.vllm_server import ServerOptions, server_env

    environ = {
        "PATH": "/bin",
        "HOME": "/root",
        "HF_HOME": "/hf",
        "CUDA_VISIBLE_DEVICES": "1",
        "OMP_NUM_THREADS": "2",
        "VLLM_CPU_KVCACHE_SPACE": "3",
        "VLLM_ATTENTION_BACKEND": "X",
        "LC_ALL": "C.UTF-8",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_API_KEY": "stray",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_TORCH_PROFILER_DIR": "/p",
        "VLLM_USE_RUST_FRONTEND": "1",
        "RELAY_API_KEY": KEY,
        "OPENAI_API_KEY": "sk-x",
        "AWS_SECRET_ACCESS_KEY": "s",
        "WANDB_API_KEY": "w",
        "PYTHONPATH": "/relay",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "LOCAL_RANK": "1",
    }
    env = server_env(ServerOptions(name="m"), "k", environ)
    kept = {k for k in environ if k in env}
    assert kept == {
        "PATH",
        "HOME",
        "HF_HOME",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_ATTENTION_BACKEND",
        "LC_ALL",
        "PYTHONPATH",
    }
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["PYTHONPATH"] != "/relay" and env["RELAY_VLLM_KEY"] == "k"
    # Set where Relay means them: the RL backend's runtime LoRA and full-weight sync.
    rl = server_env(ServerOptions(name="m", enable_lora=True, dev_mode=True), "k", environ)
    assert rl["VLLM_SERVER_DEV_MODE"] == "1" and rl["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "RELAY_VLLM_KEY" not in server_env(ServerOptions(name="m"), None, environ)


def test_vllm_servers_get_a_key_of_their_own_and_send_it(tmp_path):
    from pipeline.modeling.vllm_server import ServerOptions, VLLMServer

    a, b = (VLLMServer(str(tmp_path), ServerOptions(name="m"), python="python") for _ in range(2))
    assert a.key != b.key and len(a.key) >= 32 and a.headers == {"Authorization": f"Bearer {a.key}"}


# ------------------------------------------------------------------------------------------
# Relay's guard inside vLLM's app, on a small app of the same shape (routes, a mount, a websocket)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guard_module():
    from pipeline.modeling.vllm_server import GUARD_DIR

    spec = importlib.util.spec_from_file_location("relay_vllm_guard", GUARD_DIR / "relay_vllm_guard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def guarded(guard_module):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from starlette.responses import PlainTextResponse, StreamingResponse

    from pipeline.tools.openai_protocol import ROLES

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/chat/completions")
    @app.post("/invocations")
    async def echo(request: Request):
        return StreamingResponse(iter([await request.body()]))

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        await ws.accept()
        await ws.send_text("open")
        await ws.close()

    app.mount("/metrics", PlainTextResponse("metrics"))
    app.add_middleware(guard_module.Guard, key=KEY, roles=tuple(ROLES))
    return TestClient(app)


def test_guard_needs_the_key_on_every_route_but_health(guarded):
    from starlette.websockets import WebSocketDisconnect

    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/invocations"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("POST", "/tokenize"),
        ("GET", "/no-such-route"),
        ("POST", "/health"),
        ("HEAD", "/health"),
    ]:
        for headers, code in [
            ({}, "missing_api_key"),
            ({"Authorization": "Bearer sk-wrong"}, "invalid_api_key"),
            ({"Authorization": KEY}, "invalid_api_key"),
        ]:
            answer = guarded.request(method, path, headers=headers)
            assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", (method, path, headers)
            if method != "HEAD":
                assert answer.json()["error"]["code"] == code
        assert guarded.request(method, path, headers=auth).status_code != 401, (method, path)
    assert guarded.get("/health").status_code == 200 and guarded.options("/invocations").status_code != 401
    assert guarded.get("/metrics", headers=auth).text == "metrics"
    with pytest.raises(WebSocketDisconnect):
        with guarded.websocket_connect("/v1/realtime") as ws:
            ws.receive_text()
    with guarded.websocket_connect("/v1/realtime", headers=auth) as ws:
        assert ws.receive_text() == "open"


def test_guard_refuses_the_roles_relays_server_refuses_and_passes_the_body_on(guarded):
    from pipeline.tools.openai_protocol import ApiError, check_request

    auth = {"Authorization": f"Bearer {KEY}"}
    wizard = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}
    with pytest.raises(ApiError) as relay:
        check_request(wizard, "m")
    for path in ("/v1/chat/completions", "/invocations"):
        answer = guarded.post(path, json=wizard, headers=auth)
        assert answer.status_code == 400 and answer.json() == relay.value.body(), path
    batch = guarded.post(
        "/v1/chat/completions", json={"messages": [[{"role": "user", "content": "a"}], [{"role": "x"}]]}, headers=auth
    )
    assert batch.status_code == 400 and batch.json()["error"]["param"] == "messages[1][0].role"
    good = (
        json.dumps({"model": "m", "messages": [{"role": r, "content": "c"} for r in ("developer", "system", "user")]})
        + " " * 70000
    )
    answer = guarded.post("/v1/chat/completions", content=good.encode(), headers=auth)  # several receive() messages
    assert answer.status_code == 200 and answer.text == good
    for body in (b"{not json", b'{"messages": "text"}', b"[1, 2]"):  # vLLM's own errors
        assert guarded.post("/invocations", content=body, headers=auth).content == body
