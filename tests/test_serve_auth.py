"""`relay serve --api-key` (issue 32), driven through its command line and the official `openai`
client: the right key is served, a wrong or missing one gets OpenAI's 401 (the client raises its
AuthenticationError), /health stays open and /v1/models needs the key as in vLLM's server; the key
can come from RELAY_API_KEY (out of `ps`) and goes to vLLM as VLLM_API_KEY."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

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
        assert serve.main([str(tiny_model_dir), "--backend", "transformers", "--name", "tiny", "--max-new-tokens", "4"]) == 0
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


@pytest.mark.parametrize("key,code", [("sk-wrong", "invalid_api_key"), (KEY + "x", "invalid_api_key"), (KEY[:-1], "invalid_api_key")])
def test_wrong_key_is_an_openai_401(served, key, code):
    with pytest.raises(openai.AuthenticationError) as err:
        ask(client(served, key))
    assert err.value.status_code == 401 and err.value.body["code"] == code
    with pytest.raises(openai.AuthenticationError):
        client(served, key).models.list()


def test_missing_key_is_an_openai_401_and_health_stays_open(served):
    # The openai client always sends its key, so "none" is a request without the header.
    status, body = raw(served + "/v1/models", {})
    assert status == 401 and body["error"]["code"] == "missing_api_key" and body["error"]["type"] == "invalid_request_error"
    assert raw(served + "/health", {}) == (200, {})
    assert raw(served + "/v1/models", {"Authorization": f"Bearer {KEY}"})[0] == 200


def test_key_error_compares_whole_header():
    assert serve.key_error(f"Bearer {KEY}", KEY) is None
    assert serve.key_error(KEY, KEY).code == "invalid_api_key"  # no scheme
    assert serve.key_error(None, KEY).code == "missing_api_key"


def test_vllm_backend_gets_the_key_in_its_environment(monkeypatch, tiny_model_dir):
    calls = []
    real = serve.importlib.util.find_spec
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(serve.subprocess, "call", lambda cmd, env=None: calls.append((cmd, env)) or 0)
    assert serve.main([str(tiny_model_dir), "--backend", "vllm", "--api-key", KEY]) == 0
    (cmd, env), = calls
    assert env["VLLM_API_KEY"] == KEY and KEY not in " ".join(cmd)
