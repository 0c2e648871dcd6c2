"""Peer record layouts read as the peer's own converter reads them, and the inconsistencies inside
a record that are refused in one line (`FILE:LINE: reason`) instead of training on a repaired copy.

The expected turns are written out by hand from the peer's code:
  MedicalGPT  training/reward_modeling.py, `preprocess_reward_function` (shibing624/MedicalGPT
              14f6229ccecf60117b2586f19a1f410028a210dd, the last commit with the
              {system, history, question, response_chosen, response_rejected} layout): the system
              turn when `system or ""` is not empty, the history's [question, answer] rounds, the
              question, then each answer (its DPO script builds the same prompt).
  LLaMA-Factory  src/llamafactory/data/converter.py (hiyouga/LLaMA-Factory
              ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30): AlpacaDatasetConverter's `_system` (the
              system column; null or "" leaves the template's default, as no system turn does here),
              `_prompt` (the history's rounds, then the user turn) and `_response` (the answer; a
              ranking entry's chosen and rejected); SharegptDatasetConverter takes a leading system
              turn of the messages over the system column.
"""

from __future__ import annotations

import json
from pathlib import Path

from data_formats.conversation import Conversation
from data_formats.tools import parse_answer
from data_formats.validate import read_and_parse


def write(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def turns(conv: Conversation) -> list[tuple[str, str]]:
    return [(t.role, t.content) for t in conv.turns]


def registry(folder: Path, entries: dict) -> Path:
    path = folder / "dataset_info.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------
# MedicalGPT's {system, history, question, response_chosen, response_rejected}
# ------------------------------------------------------------------------------------------

# Lines 236 and 13 of MedicalGPT's data/reward/dpo_zh_500.jsonl (commit in the module docstring),
# then the same layout with a history (the reward and DPO scripts' docstrings name it; the sample
# file's records all have an empty one).
MEDICALGPT = [
    {
        "system": "",
        "history": [],
        "question": "奥巴马的丈夫是谁？",
        "response_chosen": "奥巴马不是和男性结婚的。他是和前第一夫人米歇尔·奥巴马结婚的。",
        "response_rejected": "巴拉克·奥巴马的丈夫是巴拉克·奥巴马二世。",
    },
    {
        "system": "你是一个非常聪明的AI助手，非常擅长按照指示行事。尽你所能地帮助。",
        "history": [],
        "question": "期末考试 问题1. 罗伯特·P·凯利曾任CEO的公司是在哪一年成立的？",
        "response_chosen": "为了帮助您解答这个问题，我需要知道罗伯特·P·凯利曾担任过的公司的名称。请提供公司名称。",
        "response_rejected": "当然！罗伯特·P·凯利曾担任首席执行官的公司Uber成立于2009年3月28日。",
    },
    {
        "system": "You are a doctor",
        "history": [["I have a cold", "Rest and drink water."]],
        "question": "What else should I do?",
        "response_chosen": "See a doctor if fever persists.",
        "response_rejected": "Nothing.",
    },
]


def test_medicalgpt_pairs_keep_their_system_and_history_as_its_reward_script_does(tmp_path):
    good, problems = read_and_parse([write(tmp_path / "rm.jsonl", MEDICALGPT)], "rm")
    assert problems == []
    sides = [(turns(p.value[0]), turns(p.value[1])) for p in good]
    assert sides == [
        (
            [
                ("user", "奥巴马的丈夫是谁？"),
                ("assistant", "奥巴马不是和男性结婚的。他是和前第一夫人米歇尔·奥巴马结婚的。"),
            ],
            [("user", "奥巴马的丈夫是谁？"), ("assistant", "巴拉克·奥巴马的丈夫是巴拉克·奥巴马二世。")],
        ),
        (
            [
                ("system", "你是一个非常聪明的AI助手，非常擅长按照指示行事。尽你所能地帮助。"),
                ("user", "期末考试 问题1. 罗伯特·P·凯利曾任CEO的公司是在哪一年成立的？"),
                ("assistant", "为了帮助您解答这个问题，我需要知道罗伯特·P·凯利曾担任过的公司的名称。请提供公司名称。"),
            ],
            [
                ("system", "你是一个非常聪明的AI助手，非常擅长按照指示行事。尽你所能地帮助。"),
                ("user", "期末考试 问题1. 罗伯特·P·凯利曾任CEO的公司是在哪一年成立的？"),
                ("assistant", "当然！罗伯特·P·凯利曾担任首席执行官的公司Uber成立于2009年3月28日。"),
            ],
        ),
        (
            [
                ("system", "You are a doctor"),
                ("user", "I have a cold"),
                ("assistant", "Rest and drink water."),
                ("user", "What else should I do?"),
                ("assistant", "See a doctor if fever persists."),
            ],
            [
                ("system", "You are a doctor"),
                ("user", "I have a cold"),
                ("assistant", "Rest and drink water."),
                ("user", "What else should I do?"),
                ("assistant", "Nothing."),
            ],
        ),
    ]


def test_a_medicalgpt_pair_with_a_bad_system_or_history_is_its_line(tmp_path):
    record = MEDICALGPT[2]
    bad = [{**record, "system": ["You are a doctor"]}, {**record, "history": "I have a cold"}]
    good, problems = read_and_parse([write(tmp_path / "rm.jsonl", bad)], "rm")
    assert good == [] and [str(p) for p in problems] == [
        f"{tmp_path / 'rm.jsonl'}:1: field 'system' must be a string, got an array",
        f"{tmp_path / 'rm.jsonl'}:2: field 'history' must be a list of [instruction, response] pairs, got a string",
    ]


# ------------------------------------------------------------------------------------------
# LLaMA-Factory's alpaca entries with system and history columns
# ------------------------------------------------------------------------------------------

ALPACA_COLUMNS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "system": "system",
    "history": "history",
}


def test_a_ranking_alpaca_entry_keeps_its_system_and_history(tmp_path):
    write(
        tmp_path / "rank.jsonl",
        [
            {
                "instruction": "q",
                "input": "",
                "chosen": "good",
                "rejected": "bad",
                "system": "Be kind.",
                "history": [["h1", "a1"]],
            },
            {"instruction": "q2", "input": "", "chosen": "yes", "rejected": "no", "system": None, "history": None},
        ],
    )
    columns = {
        "prompt": "instruction",
        "query": "input",
        "chosen": "chosen",
        "rejected": "rejected",
        "system": "system",
        "history": "history",
    }
    info = registry(tmp_path, {"rank": {"file_name": "rank.jsonl", "ranking": True, "columns": columns}})
    good, problems = read_and_parse([f"{info}:rank"], "rm")
    assert problems == []
    assert [(turns(p.value[0]), turns(p.value[1])) for p in good] == [
        (
            [("system", "Be kind."), ("user", "h1"), ("assistant", "a1"), ("user", "q"), ("assistant", "good")],
            [("system", "Be kind."), ("user", "h1"), ("assistant", "a1"), ("user", "q"), ("assistant", "bad")],
        ),
        ([("user", "q2"), ("assistant", "yes")], [("user", "q2"), ("assistant", "no")]),
    ]


def test_every_record_of_an_alpaca_entry_reads_in_one_layout(tmp_path):
    """Records with and without a history, with a system of "", null or text, in one file: each
    is read (the file's layout is detected once, from its first record), as SFT conversations,
    as PPO/GRPO prompts (the question, its answer in meta) and as KTO records."""
    records = [
        {"instruction": "q1", "input": "", "output": "a1", "system": None, "history": []},
        {"instruction": "q2", "input": "", "output": "a2", "system": "Be brief.", "history": [["h", "ha"]]},
        {"instruction": "q3", "input": "", "output": "a3", "system": "", "history": None},
    ]
    write(tmp_path / "a.jsonl", records)
    write(tmp_path / "k.jsonl", [{**r, "kto": i != 1} for i, r in enumerate(records)])
    info = registry(
        tmp_path,
        {
            "a": {"file_name": "a.jsonl", "columns": ALPACA_COLUMNS},
            "k": {"file_name": "k.jsonl", "columns": {**ALPACA_COLUMNS, "kto_tag": "kto"}},
        },
    )
    sft = [
        [("user", "q1"), ("assistant", "a1")],
        [("system", "Be brief."), ("user", "h"), ("assistant", "ha"), ("user", "q2"), ("assistant", "a2")],
        [("user", "q3"), ("assistant", "a3")],
    ]
    good, problems = read_and_parse([f"{info}:a"], "sft")
    assert problems == [] and [turns(p.value) for p in good] == sft
    good, problems = read_and_parse([f"{info}:a"], "prompts")
    assert problems == [] and [turns(p.value) for p in good] == [t[:-1] for t in sft]
    assert [p.value.meta for p in good] == [{"output": "a1"}, {"output": "a2"}, {"output": "a3"}]
    good, problems = read_and_parse([f"{info}:k"], "kto")
    assert problems == [] and [[(turns(c), label) for c, label in p.value] for p in good] == [
        [(t, label)] for t, label in zip(sft, (True, False, True))
    ]


def test_an_alpaca_entrys_tools_stay_its_schemas_as_a_prompt(tmp_path):
    schema = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    write(tmp_path / "t.jsonl", [{"instruction": "Weather?", "output": "sunny", "tools": json.dumps([schema])}])
    info = registry(tmp_path, {"t": {"file_name": "t.jsonl", "columns": {"tools": "tools"}}})
    good, problems = read_and_parse([f"{info}:t"], "prompts")
    assert problems == [] and turns(good[0].value) == [("user", "Weather?")] and good[0].value.tools == [schema]


# ------------------------------------------------------------------------------------------
# A system turn in the list and a system column
# ------------------------------------------------------------------------------------------


def test_a_list_system_turn_and_an_equal_system_column_are_one_system_turn(tmp_path):
    """LLaMA-Factory takes the list's leading system turn over the system column (its data README:
    the system tag "can override system column"); Relay does the same when both say the same, and
    refuses the record, naming both, when they differ (the column would be dropped unsaid)."""
    conversation = [
        {"from": "system", "value": "list sys"},
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a"},
    ]
    messages = [
        {"role": "system", "content": "list sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    path = write(
        tmp_path / "s.jsonl",
        [
            {"conversations": conversation, "system": "list sys"},
            {"conversations": conversation, "system": ""},
            {"conversations": conversation, "system": "col sys"},
        ],
    )
    write(
        tmp_path / "m.jsonl",
        [{"messages": messages, "system": "list sys"}, {"messages": messages, "system": "col sys"}],
    )
    info = registry(
        tmp_path,
        {
            "s": {
                "file_name": "s.jsonl",
                "formatting": "sharegpt",
                "columns": {"messages": "conversations", "system": "system"},
            },
        },
    )
    differ = (
        "two system prompts: field 'system' ('col sys') and the list's system turn ('list sys') differ; keep one "
        "(LLaMA-Factory trains the list's and drops the field)"
    )
    for entry in (path, f"{info}:s"):
        good, problems = read_and_parse([entry], "sft")
        assert [turns(p.value) for p in good] == [[("system", "list sys"), ("user", "q"), ("assistant", "a")]] * 2
        assert [str(p) for p in problems] == [f"{path}:3: {differ}"]
    good, problems = read_and_parse([str(tmp_path / "m.jsonl")], "sft")
    assert len(good) == 1 and [str(p) for p in problems] == [f"{tmp_path / 'm.jsonl'}:2: {differ}"]


# ------------------------------------------------------------------------------------------
# Margins, prompts, tool calls
# ------------------------------------------------------------------------------------------


def test_a_margin_that_is_not_finite_is_its_line(tmp_path):
    """Python's JSON reader takes NaN and Infinity; such a margin makes the loss nan at step 1."""
    path = tmp_path / "m.jsonl"
    path.write_text(
        "".join(
            '{"prompt": "q%d", "chosen": "good", "rejected": "bad", "margin": %s}\n' % (i, m)
            for i, m in enumerate(("NaN", "Infinity", "-Infinity", "0.5"))
        ),
        encoding="utf-8",
    )
    good, problems = read_and_parse([str(path)], "rm", margin_field="margin")
    assert [p.value[2] for p in good] == [0.5]
    assert [str(p) for p in problems] == [
        f"{path}:1: field 'margin' must be a finite number, got nan",
        f"{path}:2: field 'margin' must be a finite number, got inf",
        f"{path}:3: field 'margin' must be a finite number, got -inf",
    ]


def test_a_prompt_list_that_ends_with_the_assistant_is_refused_as_its_messages_are(tmp_path):
    """The PPO/GRPO stages answer a prompt with a new assistant turn: a prompt that ends with an
    assistant prefix is refused (it was cut back to its user turn, the prefix dropped unsaid)."""
    prompt = [{"role": "user", "content": "Translate: hello"}, {"role": "assistant", "content": "Sure, it is:"}]
    path = write(tmp_path / "p.jsonl", [{"prompt": prompt}, {"prompt": prompt[:1], "answer": "bonjour"}])
    as_messages = write(tmp_path / "m.jsonl", [{"messages": prompt}])
    good, problems = read_and_parse([path], "prompts")
    assert [str(p) for p in problems] == [f"{path}:1: last turn must be the user's, got assistant"]
    assert [turns(p.value) for p in good] == [[("user", "Translate: hello")]] and good[0].value.meta == {
        "answer": "bonjour"
    }
    _, problems = read_and_parse([as_messages], "prompts")
    assert [p.reason for p in problems] == ["last turn must be the user's, got assistant"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def call(call_id: str | None, city: str | None) -> dict:
    function = {"name": "get_weather"} | ({"arguments": {"city": city}} if city is not None else {})
    return {"type": "function", "function": function} | ({"id": call_id} if call_id else {})


def calls_then(calls: list[dict], *results: tuple[str | None, str]) -> dict:
    """An OpenAI messages record: a question, the assistant's calls, the results, an answer."""
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    for result_id, content in results:
        messages.append({"role": "tool", "content": content} | ({"tool_call_id": result_id} if result_id else {}))
    messages.append({"role": "assistant", "content": "Sunny, then rain."})
    return {"messages": messages, "tools": [WEATHER]}


def test_tool_results_answer_their_calls_one_each_in_order(tmp_path):
    """OpenAI answers each of an assistant's tool_calls with one tool message (ids optional in
    Relay's records; vLLM's hermes parser reads a call only with its name and arguments): one
    result per call in the calls' order, an id where both sides give one equal to its call's, and
    a call with its arguments."""
    two = [call("c1", "Paris"), call("c2", "Rome")]
    records = [
        calls_then(two, ("c1", "sunny"), ("c2", "rain")),
        calls_then(two, (None, "sunny"), (None, "rain")),
        calls_then([call(None, "Paris"), call(None, "Rome")], ("c1", "sunny"), ("c2", "rain")),
        calls_then(two, ("c1", "sunny")),
        calls_then(two, ("c1", "sunny"), ("c2", "rain"), (None, "more")),
        calls_then([call("c1", "Paris")], ("zzz", "sunny")),
        calls_then(two, ("c2", "rain"), ("c1", "sunny")),
        calls_then([call("c1", None)], ("c1", "sunny")),
    ]
    path = write(tmp_path / "t.jsonl", records)
    good, problems = read_and_parse([path], "sft")
    assert [p.line for p in good] == [1, 2, 3]
    order = "results answer the calls one each, in the calls' order"
    assert [str(p) for p in problems] == [
        f"{path}:4: turn 1: 2 tool call(s) answered by 1 result(s): give one tool/observation turn per call, in the "
        "calls' order",
        f"{path}:5: turn 1: 2 tool call(s) answered by 3 result(s): give one tool/observation turn per call, in the "
        "calls' order",
        f"{path}:6: turn 2: tool_call_id 'zzz' does not match call 1 of turn 1 (id 'c1'): {order}",
        f"{path}:7: turn 2: tool_call_id 'c2' does not match call 1 of turn 1 (id 'c1'): {order}",
        f"{path}:8: messages[1]: tool_calls[0]: a tool call needs its 'arguments' (a JSON object; {{}} when it takes "
        "none)",
    ]
    prompt = {"messages": calls_then(two, ("c1", "sunny"))["messages"][:-1], "tools": [WEATHER]}
    _, problems = read_and_parse([write(tmp_path / "p.jsonl", [prompt])], "prompts")
    assert [p.reason for p in problems] == [
        "turn 1: 2 tool call(s) answered by 1 result(s): give one tool/observation turn per call, in the calls' order"
    ]
    generated = parse_answer('<tool_call>{"name": "get_weather"}</tool_call>')
    assert generated.calls == [] and generated.errors == [
        "tool call 1: a tool call needs its 'arguments' (a JSON object; {} when it takes none)"
    ]
