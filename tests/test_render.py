"""Golden rendering and exact loss masks (role_markers and chat_template), the saved-template
round trip, and the start-up refusal of non-prefix-preserving templates."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from data_formats.conversation import Conversation, Turn
from data_formats.render import IGNORE_INDEX, make_template, render, render_prompt, render_text, template_jinja
from data_formats.validate import read_and_parse
from pipeline.config import ChatDataConfig

GOOD = Path(__file__).parent / "data" / "good"
CHATML = Conversation(
    [
        Turn("system", "You are a coding assistant."),
        Turn("user", "Write hello world in Python."),
        Turn("assistant", "print('hello world')"),
        Turn("user", "And in C?"),
        Turn("assistant", 'puts("hello world");'),
    ]
)
TRAINED_TEXT = "print('hello world')<|im_end|>puts(\"hello world\");<|im_end|>"
# Trained ids of CHATML with the SmolLM2 tokenizer (both modes train the same spans).
TRAINED_IDS = [3272, 1305, 28120, 905, 1465, 2, 1078, 99, 1470, 28120, 905, 21646, 2]
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok(embedded_path):
    return AutoTokenizer.from_pretrained(embedded_path)


def _trained(labels):
    return [x for x in labels if x != IGNORE_INDEX]


def _records(name):
    good, problems = read_and_parse([str(GOOD / name)], "sft")
    assert problems == []
    return good


def test_chatml_file_parses_to_expected_conversation():
    record = _records("chatml.jsonl")[0]
    assert record.value.turns == CHATML.turns
    assert record.task == "code-helper" and record.source.endswith("chatml.jsonl:1")


def test_role_markers_golden_string_and_mask(tok):
    template = make_template(ChatDataConfig(template="role_markers"), tok)
    conv = _records("chatml.jsonl")[0].value
    text = render_text(conv, tok, template)
    assert text == (
        "<s>system\nYou are a coding assistant.\n"
        "<s>human\nWrite hello world in Python.<s>bot\nprint('hello world')<|im_end|>\n"
        '<s>human\nAnd in C?<s>bot\nputs("hello world");<|im_end|>\n'
    )
    ids, labels = render(conv, tok, template)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert _trained(labels) == TRAINED_IDS
    assert tok.decode(_trained(labels)) == TRAINED_TEXT
    # Trained tokens are exactly the two contiguous assistant spans; the "\n" after EOS is not.
    trained_at = [i for i, x in enumerate(labels) if x != IGNORE_INDEX]
    assert ids[trained_at[5] + 1] == tok("\n", add_special_tokens=False)["input_ids"][0]
    assert labels[trained_at[5] + 1] == IGNORE_INDEX and labels[-1] == IGNORE_INDEX


def test_chat_template_golden_string_and_mask(tok):
    template = make_template(ChatDataConfig(), tok)
    conv = _records("chatml.jsonl")[0].value
    text = render_text(conv, tok, template)
    assert text == (
        "<|im_start|>system\nYou are a coding assistant.<|im_end|>\n"
        "<|im_start|>user\nWrite hello world in Python.<|im_end|>\n"
        "<|im_start|>assistant\nprint('hello world')<|im_end|>\n"
        "<|im_start|>user\nAnd in C?<|im_end|>\n"
        '<|im_start|>assistant\nputs("hello world");<|im_end|>\n'
    )
    assert text == tok.apply_chat_template([{"role": t.role, "content": t.content} for t in conv.turns], tokenize=False)
    ids, labels = render(conv, tok, template)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert _trained(labels) == TRAINED_IDS
    assert tok.decode(_trained(labels)) == TRAINED_TEXT


def test_chat_template_injected_system_is_not_trained(tok):
    """SmolLM2 injects a default system turn when there is none; prefix rendering copes."""
    template = make_template(ChatDataConfig(), tok)
    conv = _records("sharegpt.jsonl")[0].value
    assert render_text(conv, tok, template) == (
        SMOL_SYSTEM + "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nBlue.<|im_end|>\n"
    )
    ids, labels = render(conv, tok, template)
    assert tok.decode(_trained(labels)) == "Blue.<|im_end|>"
    assert _trained(labels) == tok("Blue.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


@pytest.mark.parametrize("mode", ["role_markers", "chat_template"])
def test_sharegpt_and_alpaca_masks(tok, mode):
    template = make_template(ChatDataConfig(template=mode), tok)
    share = _records("sharegpt.jsonl")[0].value
    alpaca = _records("alpaca.json")
    assert share.turns == [Turn("user", "Name a colour."), Turn("assistant", "Blue.")]
    assert alpaca[0].value.turns == [Turn("user", "Translate to French.\n\nGood morning"), Turn("assistant", "Bonjour")]
    assert alpaca[1].value.turns == [Turn("user", "Say yes."), Turn("assistant", "Yes.")]
    assert [r.line for r in alpaca] == [2, 3]
    expected = {"Blue.<|im_end|>": share, "Bonjour<|im_end|>": alpaca[0].value, "Yes.<|im_end|>": alpaca[1].value}
    for text, conv in expected.items():
        ids, labels = render(conv, tok, template)
        assert tok.decode(_trained(labels)) == text
        assert ids == tok(render_text(conv, tok, template), add_special_tokens=False)["input_ids"]
    if mode == "role_markers":
        assert render_text(alpaca[0].value, tok, template) == (
            "<s>human\nTranslate to French.\n\nGood morning<s>bot\nBonjour<|im_end|>\n"
        )


def test_custom_markers(tok):
    markers = {"system": "### System:\n", "user": "### Instruction:\n", "assistant": "### Response:\n"}
    template = make_template(ChatDataConfig(template="role_markers", role_markers=markers), tok)
    conv = Conversation([Turn("user", "Hi"), Turn("assistant", "Hello")])
    assert render_text(conv, tok, template) == "### Instruction:\nHi### Response:\nHello<|im_end|>\n"
    assert (
        tok.decode(render_prompt(Conversation([Turn("user", "Hi")]), tok, template))
        == "### Instruction:\nHi### Response:\n"
    )


@pytest.mark.parametrize("system_prompt", [None, "Be terse."])
def test_role_markers_jinja_round_trip(tok, system_prompt):
    """The template saved into merged/ renders exactly what training saw (and the same prompt)."""
    template = make_template(ChatDataConfig(template="role_markers", system_prompt=system_prompt), tok)
    jinja = template_jinja(template, tok)
    for record in _records("chatml.jsonl"):
        conv = record.value
        messages = [{"role": t.role, "content": t.content} for t in conv.turns]
        if system_prompt is not None and conv.turns[0].role != "system":
            # Training saw the configured system turn (added at parse time); the saved template adds it.
            conv = Conversation([Turn("system", system_prompt)] + conv.turns)
        saved = tok.apply_chat_template(messages, chat_template=jinja, tokenize=False)
        assert saved == render_text(conv, tok, template)
        prompt = tok.apply_chat_template(messages[:-1], chat_template=jinja, tokenize=False, add_generation_prompt=True)
        assert tok(prompt, add_special_tokens=False)["input_ids"] == render_prompt(
            Conversation(conv.turns[:-1]), tok, template
        )
    assert template_jinja(make_template(ChatDataConfig(), tok), tok) is None


def test_chat_template_prompt_matches_tokenizer(tok):
    template = make_template(ChatDataConfig(), tok)
    conv = Conversation([Turn("user", "Hi")])
    expected = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert render_prompt(conv, tok, template) == tok(expected, add_special_tokens=False)["input_ids"]


def test_non_prefix_preserving_template_refused(tok, tmp_path):
    """A template that drops earlier assistant turns (like reasoning-stripping templates) cannot
    locate spans by prefix rendering: make_template must refuse at start-up."""
    tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with pytest.raises(ValueError, match="not prefix-preserving"):
        make_template(ChatDataConfig(), tok)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        make_template(ChatDataConfig(), tok)


BOUNDARY_ANSWERS = ("    return a + b", "\nYes", "\tindented", "  Yes", "é accent first", "日本語の答え", " one space")


def _spans(labels):
    """[start, end) of every run of trained positions."""
    out, start = [], None
    for i, x in enumerate(labels + [IGNORE_INDEX]):
        if x != IGNORE_INDEX and start is None:
            start = i
        elif x == IGNORE_INDEX and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize(
    "mode,layout", [("chat_template", "readme"), ("role_markers", "readme"), ("role_markers", "code")]
)
def test_no_token_straddles_the_prompt_answer_boundary(tok, mode, layout):
    """Answers that open with spaces, a newline, a tab or non-ASCII text: the ids before each
    assistant span are exactly the generation prompt for that turn (what inference feeds the
    model), and the labels are exactly the answer's own tokens plus end-of-turn. (Before the fix
    the opener's "\n" merged with the answer's leading whitespace into one untrained token, and
    the model was trained on a tokenization the generation prompt never produces.)"""
    template = make_template(ChatDataConfig(template=mode, role_layout=layout), tok)
    eos_part = ("\n" if layout == "code" and mode == "role_markers" else "") + tok.eos_token
    for answer in BOUNDARY_ANSWERS:
        turns = [
            Turn("system", "Be brief."),
            Turn("user", "Q1?"),
            Turn("assistant", answer),
            Turn("user", "  Q2 with leading spaces"),
            Turn("assistant", answer + " again"),
        ]
        ids, labels = render(Conversation(turns), tok, template)
        spans = _spans(labels)
        assert len(spans) == 2, answer
        for (start, end), i in zip(spans, (2, 4)):
            assert ids[:start] == render_prompt(Conversation(turns[:i]), tok, template), (answer, i)
            want = tok(turns[i].content + eos_part, add_special_tokens=False)["input_ids"]
            assert labels[start:end] == ids[start:end] == want, (answer, i)
        if mode == "chat_template":
            # The generation prompt equals a plain one-shot tokenization of the tokenizer's template
            # (special end-of-turn tokens split the string there anyway).
            first = tok.apply_chat_template(
                [{"role": t.role, "content": t.content} for t in turns[:2]], tokenize=False, add_generation_prompt=True
            )
            assert ids[: spans[0][0]] == tok(first, add_special_tokens=False)["input_ids"]


def test_show_colours_exactly_the_trained_tokens(tok):
    from data_formats.show import RESET, TRAINED, colour_tokens

    template = make_template(ChatDataConfig(template="role_markers"), tok)
    conv = Conversation([Turn("user", "Hi"), Turn("assistant", "Yes.")])
    ids, labels = render(conv, tok, template)
    shown = colour_tokens(ids, labels, tok)
    assert shown == f"<s>human\nHi<s>bot\n{TRAINED}Yes{RESET}{TRAINED}.{RESET}{TRAINED}<|im_end|>{RESET}\n"


SHOWN = {
    "sft": {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]},
    "rm": {"prompt": "Say hi.", "chosen": "Hi.", "rejected": "No."},
    "prompts": {"prompt": "Say hi."},
    "pt": {"text": "Atlas is an island."},
    "kto": {"prompt": "Say hi.", "completion": "Hi.", "label": False},
}
"""One record of each kind of data a stage reads (`relay show --kind`)."""


def test_relay_show_takes_every_stage_name_and_shows_it_as_the_stage_renders_it(tmp_path, tok, capsys):
    import json
    import re

    import stages as registry
    from data_formats.render import render_scored
    from pipeline.tools import cli

    files = {}
    for kind, record in SHOWN.items():
        files[kind] = tmp_path / f"{kind}.jsonl"
        files[kind].write_text(json.dumps(record) + "\n", encoding="utf-8")
    for stage in registry.STAGES:
        kind = registry.record_kind(stage)
        code = cli.main(["show", "--kind", stage, str(files[kind]), "--template", "role_markers", "-n", "1"])
        out, err = capsys.readouterr()
        assert code == 0 and err == "" and out.startswith(f"--- {files[kind]}:1 "), (stage, out, err)
    # KTO: the answer after its prompt, the answer and its end-of-turn trained, with its label
    template = make_template(ChatDataConfig(template="role_markers"), tok)
    conv = Conversation([Turn("user", "Say hi."), Turn("assistant", "Hi.")])
    prompt, answer = render_scored(conv, tok, template)
    assert cli.main(["show", "--kind", "kto", str(files["kto"]), "--template", "role_markers"]) == 0
    title, shown = capsys.readouterr().out.removesuffix("\n").split("\n", 1)
    counted = f"{len(prompt + answer)} tokens, {len(answer)} trained"
    assert title == f"--- {files['kto']}:1 (task kto) undesirable answer: {counted}"
    assert re.sub(r"\033\[[0-9;]*m", "", shown) == tok.decode(prompt + answer)
    assert shown.endswith("".join(f"\033[42;30m{tok.decode([t])}\033[0m" for t in answer))


def test_relay_show_names_itself_and_refuses_a_kind_in_one_line(tmp_path, capsys):
    from data_formats import show
    from pipeline.tools import cli

    with pytest.raises(SystemExit):
        show.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: relay show ")
    assert cli.main(["show", "--kind", "ranking", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --kind 'ranking': not a data kind"), err
