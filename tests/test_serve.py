"""`relay serve` (pipeline/tools/serve.py): a real HTTP request on localhost gets an OpenAI
chat.completion whose text is what `relay chat` answers for the same conversation."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from pipeline.tools.chat import Generation, load_chat_model, reply
from pipeline.tools.serve import RequestError, completion_request, main, make_server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    chat = load_chat_model(str(tiny_model_dir))
    srv = make_server(chat, "tiny", port=0, max_new_tokens=8)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield chat, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_chat_completion_over_http_matches_chat(server):
    chat, base = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    status, body = post(f"{base}/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 6})
    assert status == 200
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["content"] == reply(chat, messages, Generation(max_new_tokens=6))  # greedy, same template
    usage = body["usage"]
    assert usage["completion_tokens"] <= 6 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
        assert json.loads(response.read())["data"][0]["id"] == "tiny"


def test_bad_requests_are_400_with_a_reason(server):
    _, base = server
    status, body = post(f"{base}/v1/chat/completions", {"messages": []})
    assert status == 400 and body["error"]["message"] == "'messages' must be a non-empty list"
    status, body = post(f"{base}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert status == 400 and "stream" in body["error"]["message"]


def test_completion_request_defaults():
    messages, settings = completion_request({"messages": [{"role": "user", "content": "x"}]}, 32)
    assert messages == [{"role": "user", "content": "x"}]
    assert settings == {"max_new_tokens": 32, "temperature": 0.0, "top_p": 1.0}
    with pytest.raises(RequestError, match=r"messages\[0\]"):
        completion_request({"messages": [{"role": "bot", "content": "x"}]}, 32)


def test_serve_refuses_a_reward_model(tiny_reward_dir, capsys):
    assert main([str(tiny_reward_dir), "--backend", "transformers"]) == 2
    assert "is a reward model" in capsys.readouterr().err
