"""Tool-calling conversations: both record shapes, the native template checked against
transformers' own `apply_chat_template(..., tools=...)` and its assistant mask, and Relay's
default layout (mask, saved template, prompts ending in a tool result)."""

import json

import pytest
from transformers import AutoTokenizer

from data_formats.conversation import RecordError, Turn
from data_formats.records import parse_conversation
from data_formats.render import IGNORE_INDEX, make_template, render, render_prompt, render_text, template_jinja
from data_formats.tools import call_text, template_messages, template_tools
from data_formats.validate import read_and_parse
from pipeline.config import ChatDataConfig
from pipeline.modeling.embedded import materialize

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
CALL = {"name": "get_weather", "arguments": {"city": "Oslo"}}
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps(CALL)},
        {"from": "observation", "value": '{"temp": 3}'},
        {"from": "gpt", "value": "It is 3 degrees in Oslo."},
        {"from": "human", "value": "And Bergen?"},
        {"from": "function_call", "value": json.dumps([{"name": "get_weather", "arguments": {"city": "Bergen"}}])},
        {"from": "observation", "value": '{"temp": 5}'},
        {"from": "gpt", "value": "5 degrees."},
    ],
    "tools": json.dumps(TOOLS),
}
OPENAI = {
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'},
        {"role": "assistant", "content": "It is 3 degrees in Oslo."},
        {"role": "user", "content": "And Bergen?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bergen"}}}],
        },
        {"role": "tool", "content": '{"temp": 5}'},
        {"role": "assistant", "content": "5 degrees."},
    ],
    "tools": [{"type": "function", "function": TOOLS[0]}],
}

# A template in the style of Qwen2.5/Llama 3.1 (written for this test): tools listed in the system
# turn, calls as JSON after the assistant's text, results in their own turn; {% generation %}
# marks what transformers reports as the assistant's tokens.
NATIVE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}\n{% endif %}"
    "Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
    "{%- elif m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] or '' }}"
    "{%- for c in (m['tool_calls'] or []) %}"
    "<call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</call>{%- endfor %}"
    "<|im_end|>{% endgeneration %}\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>tool\n{{ m['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(materialize())


@pytest.fixture(scope="module")
def native_tok(tok, tmp_path_factory):
    """A tokenizer folder whose chat template accepts tools and tool_calls."""
    folder = tmp_path_factory.mktemp("native_tok")
    tok.save_pretrained(folder)
    native = AutoTokenizer.from_pretrained(folder)
    native.chat_template = NATIVE
    native.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_both_record_shapes_read_alike():
    a = parse_conversation(SHAREGPT, "sharegpt")
    b = parse_conversation(OPENAI, "messages")
    strip = lambda turns: [
        (t.role, t.content, [{k: v for k, v in c.items() if k != "id"} for c in t.tool_calls or []]) for t in turns
    ]
    assert strip(a.turns) == strip(b.turns) and a.tools == b.tools == TOOLS
    assert [t.role for t in a.turns] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert a.turns[1].tool_calls == [CALL] and b.turns[2].tool_call_id == "c1"


@pytest.mark.parametrize(
    "turns,reason",
    [
        (
            [
                {"from": "human", "value": "q"},
                {"from": "function_call", "value": json.dumps(CALL)},
                {"from": "human", "value": "q"},
            ],
            "turn 2: a tool call must be followed by its result (a tool/observation turn), got user",
        ),
        (
            [{"from": "human", "value": "q"}, {"from": "observation", "value": "r"}],
            "turn 1: a tool result must follow the assistant's tool call",
        ),
        (
            [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{not json"}],
            "conversations[1]: function_call is not valid "
            "JSON: Expecting property name enclosed in double quotes (column 2)",
        ),
        (
            [{"from": "human", "value": "q"}, {"from": "function_call", "value": '{"arguments": {}}'}],
            "conversations[1]: function_call[0]: a tool call needs a 'name'",
        ),
    ],
)
def test_malformed_tool_conversations_are_one_line(turns, reason):
    with pytest.raises(RecordError) as err:
        parse_conversation({"conversations": turns}, "sharegpt")
    assert str(err.value) == reason


def test_native_template_ids_and_mask_equal_transformers(native_tok):
    """Relay's ids == apply_chat_template(messages, tools=...) and its trained positions == the
    assistant mask transformers computes from the template's {% generation %} blocks."""
    template = make_template(ChatDataConfig(), native_tok)
    assert template.tools == "native"
    conv = parse_conversation(OPENAI, "messages")
    ids, labels = render(conv, native_tok, template)
    want = native_tok.apply_chat_template(
        template_messages(conv.turns),
        tools=template_tools(conv.tools),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert ids == list(want["input_ids"])
    assert [label != IGNORE_INDEX for label in labels] == [bool(m) for m in want["assistant_masks"]]
    trained = native_tok.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX])
    assert trained == (
        '<call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</call><|im_end|>'
        "It is 3 degrees in Oslo.<|im_end|>"
        '<call>{"name": "get_weather", "arguments": {"city": "Bergen"}}</call><|im_end|>5 degrees.<|im_end|>'
    )
    assert template_jinja(template, native_tok, tools=True) is None  # the tokenizer's own template already renders them


@pytest.mark.parametrize("mode", ["chat_template", "role_markers"])
def test_default_layout_mask_prompt_and_saved_template(tok, mode):
    """SmolLM2's template ignores tools, so Relay's layout renders them: only the calls and the
    answers are trained (each span tokenized on its own, so no token straddles a boundary), a
    prompt ending in a tool result is the prefix of the whole, and the saved template renders
    every peer conversation exactly as training did."""
    cfg = ChatDataConfig(template=mode, system_prompt="Be brief." if mode == "role_markers" else None)
    template = make_template(cfg, tok)
    assert template.tools == "layout"
    conv = parse_conversation(SHAREGPT, "sharegpt", system_prompt=cfg.system_prompt)
    ids, labels = render(conv, tok, template)
    spans, run = [], []
    for i, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            run.append(i)
        elif run:
            spans.append(tok.decode(run))
            run = []
    spans += [tok.decode(run)] if run else []
    calls = [call_text("", [CALL]), call_text("", [{"name": "get_weather", "arguments": {"city": "Bergen"}}])]
    answers = ["It is 3 degrees in Oslo.", "5 degrees."]
    assert spans == [
        calls[0] + tok.eos_token,
        answers[0] + tok.eos_token,
        calls[1] + tok.eos_token,
        answers[1] + tok.eos_token,
    ]
    prompt = render_prompt(
        conv.__class__(conv.turns[: 3 + (conv.turns[0].role == "system")], tools=conv.tools), tok, template
    )
    assert ids[: len(prompt)] == prompt and labels[len(prompt)] != IGNORE_INDEX
    jinja = template_jinja(template, tok, tools=True)
    good, problems = read_and_parse(
        [
            "tests/data/peers/LLaMA-Factory/glaive_toolcall_en_demo.json",
            "tests/data/peers/MedicalGPT/sft/glaive_toolcall_zh_demo.jsonl",
        ],
        "sft",
        system_prompt=cfg.system_prompt,
    )
    assert not problems and len(good) == 8
    for conversation in [conv] + [g.value for g in good]:
        saved = tok.apply_chat_template(
            template_messages(conversation.turns),
            tools=template_tools(conversation.tools),
            chat_template=jinja,
            tokenize=False,
        )
        assert saved == render_text(conversation, tok, template)
    plain = parse_conversation(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        "messages",
        system_prompt=cfg.system_prompt,
    )
    assert tok.apply_chat_template(template_messages(plain.turns), chat_template=jinja, tokenize=False) == render_text(
        plain, tok, template
    )


def test_tool_turns_never_trained_even_with_tool_text_in_content(tok):
    conv = parse_conversation(SHAREGPT, "sharegpt")
    conv.turns[2] = Turn("tool", "It is 3 degrees in Oslo.")  # a result whose text repeats the answer
    ids, labels = render(conv, tok, make_template(ChatDataConfig(), tok))
    assert (
        tok.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX]).count("It is 3 degrees in Oslo.") == 1
    )


def test_the_next_stage_reads_the_saved_layout_as_a_tool_template(tok, tmp_path):
    """A model trained on tool calls in the default layout ships the layout in its template: the
    next stage (DPO, RM, GRPO on it) finds that template tool-capable and renders the same ids."""
    layout = make_template(ChatDataConfig(), tok)
    folder = tmp_path / "merged_tok"
    tok.save_pretrained(folder)
    merged = AutoTokenizer.from_pretrained(folder)
    merged.chat_template = template_jinja(layout, tok, tools=True)
    child = make_template(ChatDataConfig(), merged)
    assert child.tools == "native"
    conv = parse_conversation(SHAREGPT, "sharegpt")
    assert render(conv, merged, child) == render(conv, tok, layout)


def test_text_parts_and_loss_weights_that_say_what_relay_trains():
    """LLaMA-Factory v1 / OpenAI content parts: text parts are the turn's text; a loss_weight is
    accepted only where it agrees with Relay's mask (assistant 1, else 0)."""
    turns = lambda weight: {
        "messages": [
            {"role": "user", "content": [{"type": "text", "value": "hi"}], "loss_weight": 0.0},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "y"}, {"type": "text", "text": "o"}],
                "loss_weight": weight,
            },
        ]
    }
    assert [(t.role, t.content) for t in parse_conversation(turns(1.0), "messages").turns] == [
        ("user", "hi"),
        ("assistant", "yo"),
    ]
    with pytest.raises(
        RecordError, match=r"^loss_weight 0.5 on a turn of the assistant; Relay trains every assistant turn"
    ):
        parse_conversation(turns(0.5), "messages")
