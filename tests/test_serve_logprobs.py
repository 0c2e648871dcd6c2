"""`relay serve`'s `logprobs` / `top_logprobs` (pipeline/tools/serve.py, serve_batch.py,
openai_protocol.py) against an outside reference: the official `openai` client parses the answer
into its `ChatCompletion`, and every returned log-prob equals transformers' own log_softmax of the
same tiny model's logits at that position (teacher-forced over the prompt and the answer so far)
within 1e-4. The server runs slices of 3 tokens, so an answer's log-probs continue across batches."""

from __future__ import annotations

import socket
import threading
import time

import openai
import pytest
import torch
from test_serve import chat  # noqa: F401  (a fixture: the tiny model loaded for relay chat)

from pipeline.tools.chat import prompt_ids
from pipeline.tools.serve import Server, make_app

HI = [{"role": "user", "content": "Tell me a story about a cat."}]
K = 5


@pytest.fixture(scope="module")
def client(chat):  # noqa: F811  (the fixture imported from test_serve)
    """The openai client of a live server on 127.0.0.1 whose batches run 3 tokens per row."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = make_app(Server(chat, "tiny", max_new_tokens=8, slice_tokens=3, window=0.02))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="unused", max_retries=0)
    uv.should_exit = True
    thread.join(timeout=10)


def ask(client, **kwargs):
    return client.chat.completions.create(
        **{"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 0, **kwargs}
    )


def reference(chat, content) -> list[int]:  # noqa: F811
    """The ids of a returned answer, checked entry by entry against transformers: at each position
    every top_logprobs entry, and the chosen token, is a token whose text and log_softmax (of the
    model's logits after the prompt and the answer's ids so far) match within 1e-4; returns the ids."""
    model, tokenizer = chat.model, chat.tokenizer
    ids = list(prompt_ids(tokenizer, HI))
    chosen = []
    for entry in content:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)

        def match(text: str, value: float) -> int:
            close = torch.nonzero((logp - value).abs() < 1e-4).flatten().tolist()
            found = [i for i in close if tokenizer.decode([i]) == text]
            assert found, (text, value, [(tokenizer.decode([i]), float(logp[i])) for i in logp.topk(K).indices])
            return found[0]

        assert len(entry.top_logprobs) == K
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        for top in entry.top_logprobs:
            match(top.token, top.logprob)
            assert top.bytes == list(top.token.encode("utf-8"))
        token_id = match(entry.token, entry.logprob)
        chosen.append(token_id)
        ids.append(token_id)
    return chosen


def test_greedy_logprobs_equal_transformers_log_softmax_and_the_client_parses_them(client, chat):  # noqa: F811
    answer = ask(client, logprobs=True, top_logprobs=K)
    (choice,) = answer.choices
    content = choice.logprobs.content
    assert len(content) == answer.usage.completion_tokens > 3  # more than one slice
    ids = reference(chat, content)
    eos = chat.tokenizer.eos_token_id
    text_ids = ids[:-1] if ids[-1] == eos else ids
    assert chat.tokenizer.decode(text_ids, skip_special_tokens=True) == choice.message.content
    assert all(e.logprob == e.top_logprobs[0].logprob for e in content)  # greedy: the most likely token
    plain = ask(client)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_logprobs_are_the_raw_distribution_whatever_the_temperature(client, chat):  # noqa: F811
    """Sampled at temperature 2 with n=2: each choice's log-probs are the model's own, before the
    temperature (vLLM's default), so the first token's top list equals the greedy request's."""
    sampled = ask(client, logprobs=True, top_logprobs=K, temperature=2.0, n=2, seed=7)
    greedy = ask(client, logprobs=True, top_logprobs=K, max_tokens=1)
    first = [(t.token, round(t.logprob, 4)) for t in greedy.choices[0].logprobs.content[0].top_logprobs]
    for choice in sampled.choices:
        assert [(t.token, round(t.logprob, 4)) for t in choice.logprobs.content[0].top_logprobs] == first
        reference(chat, choice.logprobs.content)
    assert sum(len(c.logprobs.content) for c in sampled.choices) == sampled.usage.completion_tokens
    zero = ask(client, logprobs=True, max_tokens=2).choices[0].logprobs.content
    assert [e.top_logprobs for e in zero] == [[], []]  # logprobs alone: the chosen tokens only


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "stream": True}, "logprobs"),
    ],
)
def test_bad_logprobs_requests_are_one_line_openai_400s(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, **kwargs)
    error = caught.value.body
    assert error["param"] == param and "\n" not in error["message"], error
