"""`relay chat` with tools (pipeline/tools/chat_tools.py): the model's calls are shown and run
(or typed by the user), the results go back through the folder's template, and the model answers
again; bad tool options are one line before any model loads. The model's turns are scripted
(pipeline.modeling.decode.generate patched): a random tiny model writes no calls."""

from __future__ import annotations

import json

import pytest
from tinymodels import copy_with_tool_layout

from pipeline.modeling import decode
from pipeline.tools import chat
from pipeline.tools.chat_tools import tool_setup

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with the template Relay saves after tool SFT."""
    return copy_with_tool_layout(tiny_model_dir, tmp_path_factory.mktemp("chat") / "tool_model")[0]


def scripted(monkeypatch, model, turns):
    """Patch the decode engine to answer with `turns` in order; return the prompts it was given."""
    seen = []

    def generate(m, prompts, **kwargs):
        seen.append(model.tokenizer.decode(prompts[0]))
        ids = model.tokenizer(turns[len(seen) - 1], add_special_tokens=False)["input_ids"] + [
            model.tokenizer.eos_token_id
        ]
        return decode.Generation(tokens=[ids], finished=[True])

    monkeypatch.setattr(decode, "generate", generate)
    return seen


def test_calls_are_shown_run_and_answered(tool_model, monkeypatch, capsys):
    model = chat.load_chat_model(str(tool_model))
    seen = scripted(monkeypatch, model, [CALL, "The sum is 5."])
    setup = tool_setup(["test_tool_rollout:add"], None, 5.0)
    answer = chat.one_shot([model], "What is 2 + 3?", chat.Generation(max_new_tokens=64), tools=setup)
    assert answer == "The sum is 5."
    printed = capsys.readouterr().out.splitlines()
    assert printed == ['call> add({"a": 2, "b": 3})', "tool> 5", "bot> The sum is 5."]
    assert '"name": "add"' in seen[0] and "<tool_response>5</tool_response>" in seen[1]


def test_typed_results_in_interactive_chat(tool_model, tmp_path, monkeypatch, capsys):
    schemas = tmp_path / "tools.json"
    schemas.write_text(
        json.dumps([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
    )
    model = chat.load_chat_model(str(tool_model))
    scripted(monkeypatch, model, [CALL, "It is 7."])
    setup = tool_setup(None, str(schemas), 5.0)
    lines = iter(["What is 2 + 3?", "7", "/exit"])
    prompts = []
    histories = chat.interactive(
        [model], chat.Generation(max_new_tokens=64), read=lambda p: prompts.append(p) or next(lines), tools=setup
    )
    assert prompts == ["you> ", 'result of add({"a": 2, "b": 3})> ', "you> "]
    assert [m["role"] for m in histories[0]] == ["user", "assistant", "tool", "assistant"]
    assert histories[0][2]["content"] == "7" and histories[0][3]["content"] == "It is 7."


def test_bad_tool_options_are_one_line_before_loading(tiny_model_dir, capsys):
    assert (
        chat.main(
            ["--model", str(tiny_model_dir), "--tools", "test_tool_rollout:missing", "x/y.py:f", "--prompt", "hi"]
        )
        == 2
    )
    err = capsys.readouterr().err
    # a file path is accepted (pipeline/algorithms/rewards.py's loader); this one does not exist
    assert err.count("\n") == 1 and "--tools" in err and "has no 'missing'" in err and "no such file 'x/y.py'" in err
    assert chat.main(["--model", str(tiny_model_dir), "--tools", "test_tool_rollout:add", "--prompt", "hi"]) == 2
    assert "does not render tools" in capsys.readouterr().err


def test_a_turn_cut_at_the_token_limit_says_so_with_tools(tool_model, monkeypatch, capsys):
    """A call cut before its close tag read as an unreadable call and nothing said the answer had
    hit --max-new-tokens (the plain chat says it); now the cut line follows the turn it cut short,
    and the final answer too."""
    model = chat.load_chat_model(str(tool_model))
    partial = '<tool_call>{"name": "add", "arguments": {"a": 2'
    seen = []

    limit = len(model.tokenizer(partial, add_special_tokens=False)["input_ids"])
    final = model.tokenizer("The sum is five and that is all. " * 8, add_special_tokens=False)["input_ids"][:limit]

    def generate(m, prompts, **kwargs):  # every turn stops at the limit, without EOS
        seen.append(prompts[0])
        ids = model.tokenizer(partial, add_special_tokens=False)["input_ids"] if len(seen) == 1 else final
        return decode.Generation(tokens=[ids], finished=[False])

    monkeypatch.setattr(decode, "generate", generate)
    gen = chat.Generation(max_new_tokens=limit)
    chat.one_shot([model], "What is 2 + 3?", gen, tools=tool_setup(["test_tool_rollout:add"], None, 5.0))
    printed = capsys.readouterr().out.splitlines()
    marker = f"[answer cut at {limit} tokens: --max-new-tokens raises the limit]"
    assert printed[0].startswith("call> (unreadable)") and printed[1] == marker, printed
    assert printed[2].startswith("tool> error: tool call 1") and printed[-1] == marker, printed
    assert printed[-2] == f"bot> {model.tokenizer.decode(final)}"
