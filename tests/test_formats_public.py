"""Public record formats (issue 32) on real records (tests/data/peers, sources in SOURCES.md): each
is read as its owner defines it (TRL's `extract_prompt` and dataset types, OpenAI's fine-tuning
formats, Firefly's training rule) and its rendered ids and trained mask are checked; what Relay
cannot train is refused in one line naming the format and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from trl.data_utils import extract_prompt, is_conversational, maybe_extract_prompt

from data_formats.render import IGNORE_INDEX, make_template, render, render_scored
from data_formats.sources import summarize
from data_formats.validate import read_and_parse
from pipeline.config import ChatDataConfig

PEERS = Path(__file__).parent / "data" / "peers"
HH = PEERS / "hh-rlhf" / "harmless-base" / "test.jsonl"


@pytest.fixture(scope="module")
def tok(embedded_path):
    return AutoTokenizer.from_pretrained(embedded_path)


@pytest.fixture(scope="module")
def markers(tok):
    return make_template(ChatDataConfig(template="role_markers"), tok)


def _parse(path, kind):
    good, problems = read_and_parse([str(path)], kind)
    assert problems == [], summarize(problems)
    return good


def _write(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _trained_text(tok, ids, labels):
    return tok.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX])


def _transcript(turns):
    return "".join(f"\n\n{'Human' if t.role == 'user' else 'Assistant'}: {t.content}" for t in turns)


def test_hh_rlhf_prompt_is_split_off_where_trl_extract_prompt_splits_it(tok, markers):
    raw = [json.loads(line) for line in HH.read_text(encoding="utf-8").splitlines()]
    good = _parse(HH, "rm")
    assert len(good) == len(raw) == 5
    exact = 0
    for record, item in zip(raw, good):
        chosen, rejected, _ = item.value
        assert chosen.turns[:-1] == rejected.turns[:-1] and chosen.turns[-1].role == "assistant"
        # Relay's turns give back each transcript byte for byte.
        assert _transcript(chosen.turns) == record["chosen"] and _transcript(rejected.turns) == record["rejected"]
        trl = extract_prompt({"chosen": record["chosen"], "rejected": record["rejected"]})
        relay_prompt = _transcript(chosen.turns[:-1]) + "\n\nAssistant:"
        # TRL cuts at the first differing character: never before Relay's turn boundary.
        assert trl["prompt"].startswith(relay_prompt)
        exact += trl["prompt"] == relay_prompt
        prompt_ids, answer_ids = render_scored(chosen, tok, markers)
        assert tok.decode(answer_ids) == chosen.turns[-1].content + markers.eos
    assert exact == 4  # line 10: both answers start "I’m", which TRL counts as prompt


def test_firefly_conversation_trains_every_assistant_turn_with_its_eos(tok, markers):
    raw = [
        json.loads(line) for line in (PEERS / "Firefly" / "dummy_data.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    good = _parse(PEERS / "Firefly" / "dummy_data.jsonl", "sft")
    for record, item in zip(raw, good):
        rounds = record["conversation"]
        assert [(t.role, t.content) for t in item.value.turns] == [
            pair for r in rounds for pair in (("user", r["human"]), ("assistant", r["assistant"]))
        ]
        ids, labels = render(item.value, tok, markers)
        # Firefly's target mask: each assistant answer and its stop token, nothing of the human's.
        assert _trained_text(tok, ids, labels) == "".join(r["assistant"] + markers.eos for r in rounds)


def test_ultrafeedback_layout_reads_the_prompt_from_the_conversations_as_trl_does(tok, markers):
    raw = [
        json.loads(line) for line in (PEERS / "Firefly" / "dummy_dpo.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    for record, item in zip(raw, _parse(PEERS / "Firefly" / "dummy_dpo.jsonl", "rm")):
        trl = maybe_extract_prompt(record)
        chosen, rejected, _ = item.value
        assert [t.content for t in chosen.turns[:-1]] == [m["content"] for m in trl["prompt"]]
        assert [chosen.turns[-1].content, rejected.turns[-1].content] == [
            trl["chosen"][0]["content"],
            trl["rejected"][0]["content"],
        ]


def test_openai_chat_weight_zero_is_context_and_system_then_assistant_trains(tok, markers):
    (item,) = _parse(PEERS / "ApiLogicServer-src" / "logic_trainer_multi_turn.jsonl", "sft")
    ids, labels = render(item.value, tok, markers)
    assert _trained_text(tok, ids, labels) == "Paris, as if everyone doesn't know that already." + markers.eos
    assert "Paris" + markers.eos in tok.decode(ids)  # the weight-0 answer stays in the context
    toy = _parse(PEERS / "openai-cookbook" / "toy_chat_fine_tuning.jsonl", "sft")
    assert [t.role for t in toy[2].value.turns] == ["system", "assistant"]
    ids, labels = render(toy[2].value, tok, markers)
    assert _trained_text(tok, ids, labels) == "You're great!" + markers.eos


def test_openai_preference_format(tok, markers):
    raw = [
        json.loads(line)
        for line in (PEERS / "together-python" / "test_preference_openai.jsonl").read_text().splitlines()
    ]
    for record, item in zip(raw, _parse(PEERS / "together-python" / "test_preference_openai.jsonl", "rm")):
        chosen, rejected, _ = item.value
        prompt = [m["content"] for m in record["input"]["messages"]]
        assert [t.content for t in chosen.turns[:-1]] == prompt == [t.content for t in rejected.turns[:-1]]
        _, answer = render_scored(chosen, tok, markers)
        assert tok.decode(answer) == record["preferred_output"][0]["content"] + markers.eos


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_openai_tool_call_without_content_trains_and_bad_arguments_are_one_line(tmp_path, tok, markers):
    """chat-input.md: an assistant message that carries `tool_calls` may omit `content` or set it to null."""
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "assistant", "content": "18C."},
    ]
    null = [dict(t, content=None) if "tool_calls" in t else t for t in turns]
    bad = json.loads(json.dumps(turns))
    bad[1]["tool_calls"][0]["function"]["arguments"] = '["Paris"]'
    path = _write(tmp_path, [{"messages": turns}, {"messages": null}, {"messages": bad}])
    good, problems = read_and_parse([str(path)], "sft")
    assert [g.line for g in good] == [1, 2]
    assert summarize(problems) == [
        f"{path}:3: messages[1]: tool_calls[0]: 'arguments' must be a JSON object, got an array"
    ]
    ids, labels = render(good[0].value, tok, markers)
    assert '"arguments": {"city": "Paris"}' in _trained_text(tok, ids, labels)


def test_openai_reinforcement_records_are_prompts_with_their_fields(tmp_path):
    """reinforcement-input.md: `messages` (a developer turn allowed) and any other keys for the grader."""
    path = _write(
        tmp_path,
        [
            {
                "messages": [
                    {"role": "developer", "content": "Answer with a number."},
                    {"role": "user", "content": "2+2?"},
                ],
                "reference_answer": "4",
            }
        ],
    )
    (item,) = _parse(path, "prompts")
    assert [(t.role, t.content) for t in item.value.turns] == [("system", "Answer with a number."), ("user", "2+2?")]
    assert item.value.meta == {"reference_answer": "4"}


# TRL's dataset types (docs "Dataset formats and types", the examples of trl.data_utils), each the kind
# that trains it and the turns Relay reads.
TRL_TYPES = [
    ("language modeling, standard", {"text": "The sky is blue."}, "pt", None),
    (
        "language modeling, conversational",
        {
            "messages": [
                {"role": "user", "content": "What color is the sky?"},
                {"role": "assistant", "content": "It is blue."},
            ]
        },
        "sft",
        [("user", "What color is the sky?"), ("assistant", "It is blue.")],
    ),
    ("prompt-only, standard", {"prompt": "The sky is"}, "prompts", [("user", "The sky is")]),
    (
        "prompt-only, conversational",
        {"prompt": [{"role": "user", "content": "What color is the sky?"}]},
        "prompts",
        [("user", "What color is the sky?")],
    ),
    (
        "prompt-completion, standard",
        {"prompt": "The sky is", "completion": " blue."},
        "sft",
        [("user", "The sky is"), ("assistant", " blue.")],
    ),
    (
        "prompt-completion, conversational",
        {
            "prompt": [{"role": "user", "content": "What color is the sky?"}],
            "completion": [{"role": "assistant", "content": "It is blue."}],
        },
        "sft",
        [("user", "What color is the sky?"), ("assistant", "It is blue.")],
    ),
    (
        "preference, standard",
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        "rm",
        [("user", "The sky is"), ("assistant", " blue.")],
    ),
    (
        "preference, conversational",
        {
            "prompt": [{"role": "user", "content": "What color is the sky?"}],
            "chosen": [{"role": "assistant", "content": "It is blue."}],
            "rejected": [{"role": "assistant", "content": "It is green."}],
        },
        "rm",
        [("user", "What color is the sky?"), ("assistant", "It is blue.")],
    ),
    (
        "implicit-prompt preference, conversational",
        {
            "chosen": [
                {"role": "user", "content": "What color is the sky?"},
                {"role": "assistant", "content": "It is blue."},
            ],
            "rejected": [
                {"role": "user", "content": "What color is the sky?"},
                {"role": "assistant", "content": "It is green."},
            ],
        },
        "rm",
        [("user", "What color is the sky?"), ("assistant", "It is blue.")],
    ),
]


@pytest.mark.parametrize("name,record,kind,turns", TRL_TYPES, ids=[t[0] for t in TRL_TYPES])
def test_every_trl_dataset_type_loads(tmp_path, name, record, kind, turns):
    (item,) = _parse(_write(tmp_path, [record]), kind)
    if kind == "pt":
        assert item.value == record["text"]
        return
    conv = item.value[0] if kind == "rm" else item.value
    assert [(t.role, t.content) for t in conv.turns] == turns
    # Message lists exactly where TRL calls the record conversational.
    assert is_conversational(record) == any(isinstance(v, list) for v in record.values())


REFUSED = [
    (
        "stepwise supervision",
        {
            "prompt": "Which number is larger, 9.8 or 9.11?",
            "completions": ["The fractional part of 9.8 is 0.8.", "Hence, 9.11 > 9.8."],
            "labels": [True, False],
        },
        "sft",
        "TRL stepwise supervision record",
    ),
    (
        "implicit-prompt preference, standard",
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        "rm",
        "plain texts without a 'prompt' (TRL's implicit-prompt standard type)",
    ),
    (
        "HH transcripts that differ before the answer",
        {
            "chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d",
            "rejected": "\n\nHuman: a\n\nAssistant: x\n\nHuman: c\n\nAssistant: y",
        },
        "rm",
        "HH-RLHF transcript: chosen and rejected differ at turn 1",
    ),
    (
        "weight on a user turn",
        {"messages": [{"role": "user", "content": "a", "weight": 0}, {"role": "assistant", "content": "b"}]},
        "sft",
        "'weight' 0 on a user turn",
    ),
    (
        "a KTO answer without its label",
        {"prompt": "q", "completion": "a"},
        "kto",
        "an answer without its 'label' (true: desirable, false: undesirable; or 'kto_tag')",
    ),
    (
        "weight 2 on an assistant turn",
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 2}]},
        "sft",
        "'weight' 2 on an assistant turn",
    ),
]


@pytest.mark.parametrize("name,record,kind,reason", REFUSED, ids=[t[0] for t in REFUSED])
def test_unusable_records_are_refused_in_one_line_naming_the_format(tmp_path, name, record, kind, reason):
    path = _write(tmp_path, [record, record])
    good, problems = read_and_parse([str(path)], kind)
    lines = summarize(problems)
    assert not good and len(lines) == 1 and reason in lines[0], lines


def test_openai_preference_with_tools_and_a_call_as_the_preferred_answer(tmp_path):
    """preference-input.md: `input.tools` and assistant messages that call them."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    record = {
        "input": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool]},
        "preferred_output": [{"role": "assistant", "tool_calls": [CALL]}],
        "non_preferred_output": [{"role": "assistant", "content": "No idea."}],
    }
    (item,) = _parse(_write(tmp_path, [record]), "rm")
    chosen, rejected, _ = item.value
    assert chosen.tools == rejected.tools == [tool["function"]]
    assert chosen.turns[-1].tool_calls == [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_1"}]


def test_hh_rlhf_after_trl_extract_prompt_reads_the_same_turns(tmp_path):
    """TRL's `extract_prompt` output on HH-RLHF (Dahoas/full-hh-rlhf's layout): the same pairs as the raw
    transcripts."""
    raw = [json.loads(line) for line in HH.read_text(encoding="utf-8").splitlines()]
    extracted = _write(tmp_path, [extract_prompt(r) for r in raw])  # lines 10 and 38: TRL splits inside the answers
    turns = lambda items: [(c.turns, r.turns) for c, r, _ in (g.value for g in items)]  # noqa: E731
    assert turns(_parse(extracted, "rm")) == turns(_parse(HH, "rm"))


def _msg(role, content):
    return {"role": role, "content": content}


# Each whole-conversation layout with sides that ask different questions, and the turn where they part.
MISMATCHED_PROMPTS = [
    (
        "UltraFeedback chosen/rejected lists",
        {
            "chosen": [_msg("user", "Capital of France?"), _msg("assistant", "Paris.")],
            "rejected": [_msg("user", "Capital of Spain?"), _msg("assistant", "Lyon.")],
        },
        "'chosen' and 'rejected' differ at turn 0",
    ),
    (
        "ShareGPT-style chosen/rejected lists",
        {
            "chosen": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}],
            "rejected": [{"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Hello!"}],
        },
        "'chosen' and 'rejected' differ at turn 0",
    ),
    (
        "LLaMA-Factory chosen_messages",
        {
            "chosen_messages": [_msg("system", "Be brief."), _msg("user", "2+2?"), _msg("assistant", "4")],
            "rejected_messages": [_msg("system", "Be brief."), _msg("user", "3+3?"), _msg("assistant", "5")],
        },
        "'chosen_messages' and 'rejected_messages' differ at turn 1",
    ),
    (
        "multi-turn, an earlier answer differs",
        {
            "chosen": [_msg("user", "a"), _msg("assistant", "b"), _msg("user", "c"), _msg("assistant", "d")],
            "rejected": [_msg("user", "a"), _msg("assistant", "x"), _msg("user", "c"), _msg("assistant", "y")],
        },
        "'chosen' and 'rejected' differ at turn 1",
    ),
    (
        "one side has an extra exchange",
        {
            "chosen": [_msg("user", "a"), _msg("assistant", "b"), _msg("user", "c"), _msg("assistant", "d")],
            "rejected": [_msg("user", "a"), _msg("assistant", "y")],
        },
        "'chosen' and 'rejected' differ at turn 1",
    ),
]


@pytest.mark.parametrize("kind", ["rm", "kto"])
@pytest.mark.parametrize("name,record,reason", MISMATCHED_PROMPTS, ids=[t[0] for t in MISMATCHED_PROMPTS])
def test_whole_conversation_pairs_that_ask_different_questions_are_refused(tmp_path, name, record, reason, kind):
    """As the HH reader refuses transcripts that differ before their answer: one line naming the file
    and line, for the preference readers and for KTO, which unpairs the same records."""
    first, second = list(record)
    last = dict(record[first][-1])
    last["content" if "content" in last else "value"] = "Another answer."
    good_pair = {first: record[first], second: record[first][:-1] + [last]}  # first: the line number counts
    path = _write(tmp_path, [good_pair, record])
    good, problems = read_and_parse([str(path)], kind)
    assert len(good) == 1
    assert [str(p) for p in problems] == [
        f"{path}:2: {reason}, before the answer: the two sides of a preference pair must share "
        "their prompt up to the last user turn (drop the record, or fix the side that asks another question)"
    ]


def test_whole_conversation_pairs_with_one_prompt_are_read(tmp_path):
    """The same question on both sides is read, whatever the answer holds after the last user turn
    (a tool call and its result on one side, a direct answer on the other)."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    record = {
        "chosen": [
            _msg("user", "Weather in Paris?"),
            {"role": "assistant", "tool_calls": [CALL]},
            {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
            _msg("assistant", "18C."),
        ],
        "rejected": [_msg("user", "Weather in Paris?"), _msg("assistant", "No idea.")],
        "tools": [tool],
    }
    (item,) = _parse(_write(tmp_path, [record]), "rm")
    chosen, rejected, _ = item.value
    assert (
        chosen.turns[0] == rejected.turns[0]
        and chosen.turns[-1].content == "18C."
        and rejected.turns[-1].content == "No idea."
    )
