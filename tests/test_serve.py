"""`relay serve` (pipeline/tools/serve.py) driven by the official `openai` client on 127.0.0.1
against a tiny random model: answers equal `relay chat`'s, streaming equals non-streaming, `n`,
`stop`, text-part content and the developer role work, every bad request is an OpenAI-style 4xx
and the server stays up; the batcher answers concurrent requests in one generate call without a
long one holding the short ones back, and ends a request at its time limit."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from pipeline.tools import serve_batch
from pipeline.tools.chat import Generation, load_chat_model, prompt_ids, reply
from pipeline.tools.serve import Server, main, make_app

LIMIT = 64 * 1024
HI = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    return load_chat_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def server(chat):
    """(openai client, base URL) of a live server on 127.0.0.1 (a free port)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = make_app(Server(chat, "tiny", max_new_tokens=8, max_request_bytes=LIMIT, window=0.02))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60), base
    uv.should_exit = True
    thread.join(timeout=10)


def raw(url: str, body: bytes | None = None) -> tuple[int, dict]:
    """(status, JSON body) of a request the openai client would not send."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ask(client, **kwargs):
    return client.chat.completions.create(
        **{"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 0, **kwargs}
    )


def streamed(client, **kwargs) -> tuple[dict[int, str], dict[int, str], object]:
    """(text per choice, finish reason per choice, usage) of a streamed request."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    used = None
    for part in ask(client, stream=True, stream_options={"include_usage": True}, **kwargs):
        used = part.usage or used
        for choice in part.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, used


def test_answer_equals_relay_chat_and_stream_equals_answer(server, chat):
    client, _ = server
    answer = ask(client)
    (choice,) = answer.choices
    assert choice.message.content.strip() == reply(chat, HI, Generation(max_new_tokens=8))  # greedy, same template
    assert choice.finish_reason in ("stop", "length") and answer.model == "tiny"
    assert answer.usage.prompt_tokens == len(prompt_ids(chat.tokenizer, HI)) and answer.usage.completion_tokens <= 8
    texts, reasons, used = streamed(client, n=2)
    assert texts == {0: choice.message.content, 1: choice.message.content}
    assert reasons == {0: choice.finish_reason, 1: choice.finish_reason}
    assert used.completion_tokens == 2 * answer.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_n_stop_text_parts_and_developer_role(server):
    client, _ = server
    full = ask(client).choices[0].message.content
    sampled = ask(client, n=3, temperature=1.0, top_p=0.9)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = ask(client, stop=[stop, "never appears"]).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
    texts, reasons, _ = streamed(client, stop=stop)
    assert texts == {0: full[: full.index(stop)]} and reasons == {0: "stop"}
    as_parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Tell me a story "}, {"type": "text", "text": "about a cat."}],
        }
    ]
    assert ask(client, messages=as_parts).choices[0].message.content == full
    system = ask(client, messages=[{"role": "system", "content": "Be brief."}] + HI)
    developer = ask(client, messages=[{"role": "developer", "content": "Be brief."}] + HI)
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens


BAD = [
    ({"max_tokens": -5}, 400, "max_tokens"),
    ({"max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),  # longer than the context
    ({"top_p": 5}, 400, "top_p"),
    ({"temperature": 3}, 400, "temperature"),
    ({"n": 0}, 400, "n"),
    ({"n": 99}, 400, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content",
    ),
    ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate"),
    ({"presence_penalty": 1.0}, 400, "presence_penalty"),
]


def test_every_bad_request_is_an_openai_error_and_the_server_stays_up(server):
    client, base = server
    for kwargs, status, param in BAD:
        with pytest.raises(openai.APIStatusError) as caught:
            ask(client, **kwargs)
        error = caught.value.body
        assert caught.value.status_code == status and error["param"] == param, (kwargs, error)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    malformed = [
        (b"not json", 400),
        (b"[1, 2]", 400),
        (b'{"model": "tiny", "messages": "' + b"x" * LIMIT + b'"}', 413),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400),
    ]
    for body, status in malformed:
        code, answer = raw(f"{base}/chat/completions", body)
        assert code == status and set(answer["error"]) == {"message", "type", "param", "code"}, (body[:40], answer)
    assert raw(f"{base}/nowhere")[1]["error"]["message"].startswith("no route GET")
    assert ask(client).choices[0].message.content  # still up


NOT_FINITE = [
    "temperature",
    "top_p",
    "max_tokens",
    "n",
    "seed",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
]
"""The numeric fields a request may carry: NaN or an infinity in any of them is a 400 naming it."""


def test_nan_and_infinity_are_a_400_naming_the_field(server):
    """Python's json reads NaN and Infinity, which a range check alone lets through (every
    comparison with NaN is False); vLLM's server answers 400 to them. The openai SDK refuses to
    serialise them, so the body goes as bytes: through the SDK's own client once (which reads the
    answer as its BadRequestError), then raw."""
    client, base = server
    with pytest.raises(ValueError):
        ask(client, top_p=float("nan"))
    nan_top_p = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}'
    with pytest.raises(openai.BadRequestError) as caught:
        client.post(
            "/chat/completions",
            content=nan_top_p,
            cast_to=object,
            options={"headers": {"Content-Type": "application/json"}},
        )
    assert caught.value.body["param"] == "top_p" and caught.value.body["code"] == "invalid_value"
    for key in NOT_FINITE:
        for word in ("NaN", "Infinity", "-Infinity"):
            body = f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], "{key}": {word}}}'
            status, answer = raw(f"{base}/chat/completions", body.encode())
            error = answer["error"]
            assert status == 400 and error["param"] == key and f"got {word}" in error["message"], (key, word, error)
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": NaN}}'
    assert raw(f"{base}/chat/completions", body)[1]["error"]["param"] == "logit_bias.5"


def test_extreme_values_inside_the_ranges_are_their_limits(server):
    """temperature 1e-300 is inside [0, 2] and top_p 1e-300 inside (0, 1]: both are answered (they
    were a 500 from a NaN in the sampler), as their limits: the greedy answer."""
    client, _ = server
    greedy = ask(client).choices[0].message.content
    assert ask(client, temperature=1e-300).choices[0].message.content == greedy
    assert ask(client, temperature=1.0, top_p=1e-300).choices[0].message.content == greedy
    assert [c.message.content for c in ask(client, temperature=1e-300, n=2).choices] == [greedy, greedy]


def concurrently(base: str, bodies: list[bytes]) -> list[tuple[int, dict]]:
    """(status, JSON body) of each request, all sent at once."""
    answers: list = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def send(i: int) -> None:
        start.wait()
        answers[i] = raw(f"{base}/chat/completions", bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return answers


def test_one_clients_bad_or_extreme_value_never_fails_the_request_beside_it(server):
    """The user test's report: a greedy request and a `top_p: NaN` one sent together both got 500;
    so did a greedy one beside `temperature: 1e-300`. Now the NaN is its own request's 400 and the
    greedy neighbour is answered; the tiny temperature is answered too."""
    client, base = server
    greedy = ask(client).choices[0].message.content
    good = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 0}).encode()
    nan = b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "top_p": NaN, "temperature": 1}'
    (status, answer), (bad_status, bad) = concurrently(base, [good, nan])
    assert status == 200 and answer["choices"][0]["message"]["content"] == greedy, answer
    assert bad_status == 400 and bad["error"]["param"] == "top_p", bad
    tiny_t = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 8, "temperature": 1e-300}).encode()
    for status, answer in concurrently(base, [good, tiny_t]):
        assert status == 200 and answer["choices"][0]["message"]["content"] == greedy, answer


def test_a_method_a_path_does_not_take_is_a_405_naming_the_ones_it_takes(server):
    _, base = server
    for method, path, allowed in [
        ("OPTIONS", "/models", "GET"),
        ("POST", "/models", "GET"),
        ("DELETE", "/models/tiny", "GET"),
        ("GET", "/chat/completions", "POST"),
    ]:
        request = urllib.request.Request(base + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        error = json.loads(caught.value.read())["error"]
        assert caught.value.code == 405 and caught.value.headers["Allow"] == allowed, (method, path)
        assert error["message"] == f"/v1{path} does not take {method}; it takes {allowed}"


# ------------------------------------------------------------------------------------------
# batching, without HTTP
# ------------------------------------------------------------------------------------------


def submit(batcher, chat, messages, max_new_tokens: int, timeout: float = 60.0, n: int = 1, top_p: float = 1.0) -> dict:
    """Queue a greedy job; returns its record: events with their arrival times, filled from the worker."""
    record: dict = {"events": [], "times": []}

    def emit(event):
        record["events"].append(event)
        record["times"].append(time.monotonic())

    job = serve_batch.Job(
        prompt=prompt_ids(chat.tokenizer, messages),
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        top_p=top_p,
        stops=[],
        deadline=time.monotonic() + timeout,
        emit=emit,
    )
    record["job"] = job
    batcher.submit(job)
    return record


def finished_at(record) -> float:
    return next(t for e, t in zip(record["events"], record["times"]) if e[0] == "finish")


def wait(records, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not all(any(e[0] in ("finish", "error") for e in r["events"]) for r in records):
        assert time.monotonic() < end, "the batcher did not answer"
        time.sleep(0.01)


def counted_generate(monkeypatch) -> list[int]:
    """The batcher's engine calls, recorded: the number of rows of each (the list it returns fills)."""
    calls: list[int] = []
    real = serve_batch.generate

    def counting(model, prompts, **kwargs):
        calls.append(len(prompts))
        return real(model, prompts, **kwargs)

    monkeypatch.setattr(serve_batch, "generate", counting)
    return calls


def test_waiting_requests_share_one_generate_call_and_short_ones_end_first(chat, monkeypatch):
    calls = counted_generate(monkeypatch)
    # no EOS ids: the random model must not stop early; a wide window gathers all five requests
    batcher = serve_batch.Batcher(chat.model, chat.tokenizer, [], chat.tokenizer.pad_token_id, max_batch=16, window=0.5)
    batcher.start()
    try:
        prompts = [[{"role": "user", "content": f"Question number {i}?" * (i + 1)}] for i in range(4)]
        long = submit(batcher, chat, HI, 40)
        short = [submit(batcher, chat, p, 3) for p in prompts]
        wait([long, *short])
    finally:
        batcher.stop()
    assert calls == [5, 1]  # all five in one call; the long row's last 8 tokens in a second slice
    assert all(finished_at(s) < finished_at(long) for s in short)
    for messages, record in zip(prompts, short):  # batched (left-padded) answers are each prompt's own greedy answer
        text = "".join(e[2] for e in record["events"] if e[0] == "delta")
        assert text.strip() == reply(chat, messages, Generation(max_new_tokens=3))


def test_a_request_arriving_during_a_long_answer_joins_the_next_slice(chat):
    batcher = serve_batch.Batcher(
        chat.model, chat.tokenizer, [], chat.tokenizer.pad_token_id, window=0.0, slice_tokens=4
    )
    batcher.start()
    try:
        long = submit(batcher, chat, HI, 60)
        while not long["events"]:
            time.sleep(0.005)
        short = submit(batcher, chat, [{"role": "user", "content": "Hi"}], 3)
        wait([long, short])
    finally:
        batcher.stop()
    assert finished_at(short) < finished_at(long)
    long_text = "".join(e[2] for e in long["events"] if e[0] == "delta")
    assert long["job"].completion_tokens == 60 and long["events"][-1] == ("finish", 0, "length")
    # slicing continues the row from its own tokens: the same greedy answer as one uninterrupted call
    assert long_text.strip() == reply(chat, HI, Generation(max_new_tokens=60))


def test_a_row_generate_fails_on_fails_only_its_own_request(chat, monkeypatch):
    """A job the engine refuses (a NaN top_p that got past the request checks) batched with a good
    one: the good one is answered (its own greedy answer), the bad one alone gets the 500."""
    calls = counted_generate(monkeypatch)
    batcher = serve_batch.Batcher(chat.model, chat.tokenizer, [], chat.tokenizer.pad_token_id, window=0.5)
    batcher.start()
    try:
        good = submit(batcher, chat, HI, 5)
        bad = submit(batcher, chat, HI, 5, top_p=float("nan"))
        wait([good, bad])
    finally:
        batcher.stop()
    assert calls[0] == 2  # they were batched together
    assert bad["events"][0][:2] == ("error", 500) and "top_p" in bad["events"][0][2]
    assert good["events"][-1] == ("finish", 0, "length")
    text = "".join(e[2] for e in good["events"] if e[0] == "delta")
    assert text.strip() == reply(chat, HI, Generation(max_new_tokens=5))


def test_time_limit_ends_a_request(chat):
    batcher = serve_batch.Batcher(chat.model, chat.tokenizer, [], chat.tokenizer.pad_token_id, window=0.0)
    batcher.start()
    try:
        late = submit(batcher, chat, HI, 5, timeout=-1.0)
        slow = submit(batcher, chat, HI, 10_000, timeout=0.5)
        wait([late, slow])
    finally:
        batcher.stop()
    assert late["events"][0][:2] == ("error", 503)
    assert slow["events"][-1] == ("finish", 0, "length") and slow["job"].completion_tokens < 10_000


def test_choice_text_holds_back_a_possible_stop_and_cuts_before_it():
    pieces = {1: "Hel", 2: "lo wor", 3: "ld!", 4: " more"}
    text = serve_batch.ChoiceText(lambda ids: "".join(pieces[i] for i in ids), ["world"])
    assert text.add(1) == ("Hel", False)
    assert text.add(2) == ("lo ", False)  # "wor" may start "world": held back
    assert text.add(3) == ("", True) and text.text == "Hello "
    broken = serve_batch.ChoiceText(lambda ids: "ab\ufffd" if len(ids) == 1 else "abé", [])
    assert broken.add(1) == ("ab", False) and broken.add(2) == ("é", False)


def test_serve_refuses_a_reward_model(tiny_reward_dir, capsys):
    assert main([str(tiny_reward_dir), "--backend", "transformers"]) == 2
    assert "is a reward model" in capsys.readouterr().err


def test_serve_vllm_without_its_environment_is_one_clear_line(tiny_model_dir, capsys, monkeypatch):
    from pipeline.modeling import vllm_server

    monkeypatch.setattr(vllm_server, "vllm_python", lambda: None)
    assert main([str(tiny_model_dir), "--backend", "vllm"]) == 2
    assert "vLLM is not installed (bash run_scripts/install_vllm.sh makes bench/.venv-vllm" in capsys.readouterr().err


def test_a_short_lived_vllm_server_starts_eager_on_a_cpu_and_compiled_on_a_gpu(monkeypatch):
    """The RL engine, the gold table, chat and distill's teacher start a server per run: on a CPU its
    compile is never cached (every start compiles again), so they start eager there, compiling
    nothing at all; on a GPU compiled; an explicit choice wins either way (`relay serve --backend
    vllm` compiles unless --eager)."""
    from pipeline.modeling import vllm_server
    from pipeline.rl.vllm_generator import engine_options

    def eager(opts) -> bool:
        return "--enforce-eager" in vllm_server.server_command("python", "/m", "h", 1, opts)

    def compiles(opts, environ=None) -> bool:
        """An eager server on a CPU compiles nothing, vLLM's sampler helpers included."""
        return vllm_server.server_env(opts, "k", environ or {}).get("TORCHDYNAMO_DISABLE") != "1"

    monkeypatch.setattr(vllm_server, "on_gpu", lambda: False)
    assert eager(engine_options(8)) and eager(engine_options(None)) and eager(vllm_server.ServerOptions(name="gold"))
    assert not eager(vllm_server.ServerOptions(name="serve", eager=False))
    assert not compiles(engine_options(8)) and not compiles(vllm_server.ServerOptions(name="gold"))
    assert compiles(vllm_server.ServerOptions(name="serve", eager=False))
    assert compiles(engine_options(8), {"TORCHDYNAMO_DISABLE": "0"})  # the user's own setting wins
    monkeypatch.setattr(vllm_server, "on_gpu", lambda: True)
    assert not eager(engine_options(8)) and not eager(vllm_server.ServerOptions(name="gold"))
    assert eager(vllm_server.ServerOptions(name="serve", eager=True))
    assert compiles(engine_options(8)) and compiles(vllm_server.ServerOptions(name="serve", eager=True))


def test_serve_vllm_on_a_cpu_runs_the_model_in_the_engine_process_and_compiles_unless_eager(
    tiny_model_dir, capsys, monkeypatch
):
    from pipeline.modeling import vllm_server

    calls = []
    monkeypatch.setattr(vllm_server, "vllm_python", lambda: "python")
    monkeypatch.setattr(
        vllm_server, "launch", lambda cmd, env: calls.append((cmd, env)) or type("Proc", (), {"wait": lambda self: 0})()
    )
    monkeypatch.setattr(vllm_server, "stop_group", lambda proc: None)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert main([str(tiny_model_dir), "--backend", "vllm"]) == 0
    assert main([str(tiny_model_dir), "--backend", "vllm", "--eager"]) == 0
    (plain, env), (eager, _) = calls
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # no worker process beside the engine core on a CPU
    assert "--enforce-eager" not in plain and eager == plain + ["--enforce-eager"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_server.server_env(
        vllm_server.ServerOptions(name="m", tensor_parallel_size=2)
    )
    assert main([str(tiny_model_dir), "--backend", "transformers", "--eager"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --eager is a vLLM option (--backend vllm)"


def test_relays_own_backend_is_named_relay_as_everywhere_else_and_its_old_name_still_works(capsys):
    """`relay serve --backend` named Relay's own engine `transformers`, where `relay chat`, the RL
    stages' generation.backend and the docs call it `relay`: both names now choose it."""
    from pipeline.tools.serving import serve_choice, serve_values

    assert serve_choice("relay") == serve_choice("transformers") == "relay" and serve_choice("vllm") == "vllm"
    assert serve_values()[:3] == ("auto", "relay", "vllm")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--backend relay" in " ".join(capsys.readouterr().out.split())
