"""`relay serve` with tools (pipeline/tools/serve_tools.py, openai_protocol.py), driven by the
official `openai` client against a tiny model whose template is the one Relay saves after tool
SFT: the served prompt of a tool conversation is token for token the training rendering, an
answer's calls come back as `tool_calls` with finish_reason "tool_calls" (streamed as OpenAI
streams tool-call deltas), the history carries calls and results, every tool_choice works, and
bad tool requests are OpenAI-style 400s. The model's sampling is scripted (serve_batch.generate
patched), since a random model writes no calls."""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest
from tinymodels import copy_with_tool_layout
from transformers import AutoTokenizer

from data_formats.conversation import Conversation, Turn
from data_formats.render import render_prompt
from pipeline.tools import serve_batch
from pipeline.tools.chat import load_chat_model
from pipeline.tools.openai_protocol import ApiError, check_request
from pipeline.tools.serve import Server, make_app
from pipeline.tools.serve_tools import prompt_and_prefill

ADD = {
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
TOOLS = [{"type": "function", "function": ADD}]
USER = {"role": "user", "content": "What is 2 + 3?"}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
SCRIPT = {"text": "", "prompts": []}


@pytest.fixture(scope="module")
def tool_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with the template Relay saves after SFT on tool conversations (its layout in
    front of the tokenizer's template), and the training Template of that SFT."""
    return copy_with_tool_layout(tiny_model_dir, tmp_path_factory.mktemp("served") / "tool_model")


@pytest.fixture(scope="module")
def server(tool_model):
    import uvicorn

    chat = load_chat_model(str(tool_model[0]))
    real = serve_batch.generate

    def scripted(model, prompts, *, max_new_tokens, eos_ids, on_token, **kwargs):
        SCRIPT["prompts"] += [list(p) for p in prompts]
        ids = chat.tokenizer(SCRIPT["text"], add_special_tokens=False)["input_ids"] + [chat.tokenizer.eos_token_id]
        for row in range(len(prompts)):
            for token in ids[: max_new_tokens[row]]:
                if on_token(row, token):
                    break

    serve_batch.generate = scripted
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(
        uvicorn.Config(
            make_app(Server(chat, "tiny", max_new_tokens=64, window=0.0, slice_tokens=256)), log_level="warning"
        )
    )
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    yield openai.OpenAI(
        base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="unused", max_retries=0, timeout=60
    )
    uv.should_exit = True
    thread.join(timeout=10)
    serve_batch.generate = real


def ask(client, text, **kwargs):
    SCRIPT["text"], SCRIPT["prompts"] = text, []
    return client.chat.completions.create(**{"model": "tiny", "messages": [USER], "tools": TOOLS, **kwargs})


def streamed(client, text, **kwargs):
    """(content, tool calls accumulated from their deltas as clients do, finish reason)."""
    content, calls, reason = "", {}, None
    for part in ask(client, text, stream=True, **kwargs):
        for choice in part.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
            reason = choice.finish_reason or reason
    return content, calls, reason


def test_a_tool_loop_with_the_openai_client_prompts_as_training_rendered(server, tool_model):
    _, tok, template = tool_model
    answer = ask(server, "Let me add.\n" + CALL)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me add."
    (call,) = choice.message.tool_calls
    assert (
        call.type == "function"
        and call.function.name == "add"
        and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    )
    turns = [Turn("user", USER["content"])]
    assert SCRIPT["prompts"] == [render_prompt(Conversation(turns, tools=[ADD]), tok, template)]  # the SFT rendering
    history = [
        USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    final = ask(server, "The sum is 5.", messages=history)
    assert final.choices[0].message.content == "The sum is 5." and final.choices[0].finish_reason == "stop"
    assert not final.choices[0].message.tool_calls
    turns += [
        Turn("assistant", "Let me add.", tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}]),
        Turn("tool", "5"),
    ]
    assert SCRIPT["prompts"] == [render_prompt(Conversation(turns, tools=[ADD]), tok, template)]


def test_streamed_tool_calls_equal_the_answer(server):
    content, calls, reason = streamed(server, "Let me add.\n" + CALL)
    assert content == "Let me add." and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("add", {"a": 2, "b": 3})]
    assert calls[0]["id"].startswith("call_")
    text = "No tool needed: 5 <tool"  # held back while it may open a call, then sent
    assert streamed(server, text) == (text, {}, "stop")
    assert ask(server, text).choices[0].message.content == text


def test_tool_choice_none_required_and_named(server, tool_model):
    _, tok, _ = tool_model
    none = ask(server, CALL, tool_choice="none").choices[0]
    assert none.message.content == CALL and not none.message.tool_calls and none.finish_reason == "stop"
    required = ask(
        server, '{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>', tool_choice="required"
    ).choices[0]
    assert tok.decode(SCRIPT["prompts"][0]).endswith("<|im_start|>assistant\n<tool_call>")
    assert required.finish_reason == "tool_calls" and required.message.tool_calls[0].function.name == "add"
    named = ask(
        server, '{"a": 4, "b": 5}}</tool_call>', tool_choice={"type": "function", "function": {"name": "add"}}
    ).choices[0]
    assert tok.decode(SCRIPT["prompts"][0]).endswith('<tool_call>{"name": "add", "arguments":')  # a token's end
    assert json.loads(named.message.tool_calls[0].function.arguments) == {"a": 4, "b": 5}
    content, calls, reason = streamed(
        server, '{"a": 4, "b": 5}}</tool_call>', tool_choice={"type": "function", "function": {"name": "add"}}
    )
    assert (content, reason) == ("", "tool_calls") and json.loads(calls[0]["arguments"]) == {"a": 4, "b": 5}
    unread = ask(server, "not json at all", tool_choice="required").choices[0]  # not repaired: returned as it is
    assert unread.message.content == "<tool_call>not json at all" and unread.finish_reason == "stop"


BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"name": "add"}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"messages": [USER, {"role": "tool", "content": "5"}]}, "messages[1].tool_call_id"),
    (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "[1, 2]"}}],
                },
            ]
        },
        "messages[1].tool_calls",
    ),
    (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}],
                },
            ]
        },
        "messages[1].tool_calls",
    ),
]


@pytest.mark.parametrize("change,param", BAD)
def test_bad_tool_requests_are_openai_400s(server, change, param):
    body = {"model": "tiny", "messages": [USER], "tools": TOOLS, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as err:
        server.chat.completions.create(**body)
    assert err.value.body["param"] == param, err.value.body


def test_a_template_without_tools_is_refused_in_one_line(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    request = check_request({"model": "m", "messages": [USER], "tools": TOOLS}, "m")
    with pytest.raises(ApiError) as err:
        prompt_and_prefill(tok, request)
    assert err.value.status == 400 and "does not render tools" in err.value.message


def test_vllm_is_started_with_the_parser_of_the_layout(tool_model, tiny_model_dir):
    """vLLM's hermes parser reads <tool_call>{json}</tool_call>: the flags for a folder whose
    template writes that (Relay's saved layout), none for one without tools."""
    from pipeline.tools.vllm_serving import vllm_command

    assert vllm_command(str(tool_model[0]), "h", 1)[-3:] == [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    assert "--tool-call-parser" not in vllm_command(str(tiny_model_dir), "h", 1)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"]
)
def test_a_forced_answer_starts_with_the_tokens_training_gave_it(embedded_path, choice):
    """The real vocabulary writes `"arguments": {"` as `":` then ` {"`: a prefill cut at the text's
    marker ended in a lone ' ' token, a sequence the model never saw in training, and a model that
    called `add` well under "auto" broke the call when told to call it. The served ids are the SFT
    rendering of the conversation with the call (data_formats.render: the prompt, then the answer
    tokenized on its own) up to a token boundary, at the opener or just before the arguments."""
    from data_formats.render import make_template, render, template_jinja
    from pipeline.config import ChatDataConfig

    tok = AutoTokenizer.from_pretrained(embedded_path)
    template = make_template(ChatDataConfig(), tok)
    tok.chat_template = template_jinja(template, tok, tools=True)
    request = check_request({"model": "m", "messages": [USER], "tools": TOOLS, "tool_choice": choice}, "m")
    ids, prefill = prompt_and_prefill(tok, request)
    call = Turn("assistant", "", tool_calls=[{"name": "add", "arguments": {"a": 2, "b": 3}}])
    trained, _ = render(Conversation([Turn("user", USER["content"]), call], tools=[ADD]), tok, template)
    prompt = render_prompt(Conversation([Turn("user", USER["content"])], tools=[ADD]), tok, template)
    assert ids[: len(prompt)] == prompt and ids == trained[: len(ids)] and len(ids) > len(prompt)
    assert tok.decode(ids[len(prompt) :]) == prefill
    assert prefill.endswith('"arguments":' if isinstance(choice, dict) else "<tool_call>"), prefill
    assert trained[len(ids) :][:1] != tok(" ", add_special_tokens=False)["input_ids"]


def test_text_after_a_call_is_streamed_as_the_answer_gives_it(server):
    """Content after a call (and between calls) is part of the non-streamed message's content; the
    stream sent only what came before the first call."""
    for text in ("First.\n" + CALL + "\nThen I answer.", CALL + "\nThe tool will tell us."):
        answer = ask(server, text).choices[0]
        content, calls, reason = streamed(server, text)
        assert (content, reason) == (answer.message.content, answer.finish_reason == "tool_calls" and "tool_calls")
        assert [c["name"] for c in calls.values()] == [c.function.name for c in answer.message.tool_calls]


def test_an_answer_with_a_call_that_cannot_be_read_is_all_content(server):
    """A good call then a malformed one (or one cut before its close tag): the whole text is the
    content and nothing is a call, as vLLM's hermes parser answers; streamed the same. Before,
    the good call came back and the malformed one vanished."""
    for text in (CALL + "<tool_call>{not json}</tool_call>", CALL + '<tool_call>{"name": "add", "argum'):
        answer = ask(server, text).choices[0]
        assert answer.message.content == text and not answer.message.tool_calls and answer.finish_reason == "stop"
        assert streamed(server, text) == (text, {}, "stop")
