"""MFTCoder's chatML role-marker layouts, byte for byte: golden strings, trained spans and ids.

Two layouts of `template: role_markers` (`data.role_layout`):
- "readme": what MFTCoder's README (mftcoder_accelerate/README.md, section 3.1) writes,
  ``<s>human\\n{u}<s>bot\\n{a}{EOS}\\n``; Relay's behaviour before role_layout existed.
- "code": what MFTCoder's code does. Read from codefuse-ai/MFTCoder commit
  8ba13f44e2036f1412a343bc343dc6cda7383d73:
    mftcoder_accelerate/src/data/preprocess_data.py (`content_format` appends "\\n" to every
      content; `_tokenize_fields`: system = marker + content + "\\n" (loss 0); user = marker +
      content + "\\n" + assistant marker (loss 0); assistant = content + "\\n" then the EOS id
      (loss 1), then "\\n" (loss 0)),
    mftcoder_accelerate/src/pefts/mft_accelerate.py (`DataCollatorForMFTDataset`: labels =
      input_ids[1:], loss_mask[1:], so the trained targets are exactly the loss-1 tokens),
    mftcoder_accelerate/src/tokenizer/chat_template.py (`MFTCoder_template`: the same string,
      generation prompt "<s>bot\\n"),
    mftcoder_accelerate/inference/hf_inference.py (prompt f"<s>human\\n{instruction}\\n<s>bot\\n").
  So: ``<s>system\\n{s}\\n<s>human\\n{u}\\n<s>bot\\n{a}\\n{EOS}\\n``, trained ``{a}\\n{EOS}`` per
  assistant turn (not the markers, not the "\\n" after EOS).
The "code" tests fail until data_formats/render.py implements role_layout="code".

Ids are the embedded SmolLM2 tokenizer's (EOS "<|im_end|>" = 2, "\\n" = 198). For these
conversations MFTCoder's piecewise encoding (one `encode` per segment) gives the same ids as
encoding the whole string, which is what Relay does.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from data_formats.conversation import Conversation, Turn
from data_formats.render import IGNORE_INDEX, make_template, render, render_prompt, render_text, template_jinja
from pipeline.config import ChatDataConfig

SYSTEM_TWO_ROUNDS = Conversation(
    [
        Turn("system", "You are a coding assistant."),
        Turn("user", "Write hello world in Python."),
        Turn("assistant", "print('hello world')"),
        Turn("user", "And in C?"),
        Turn("assistant", 'puts("hello world");'),
    ]
)
ONE_ROUND = Conversation([Turn("user", "Name a colour."), Turn("assistant", "Blue.")])

GOLDEN = {
    "readme": {
        "system_two_rounds": {
            "text": "<s>system\nYou are a coding assistant.\n"
            "<s>human\nWrite hello world in Python.<s>bot\nprint('hello world')<|im_end|>\n"
            '<s>human\nAnd in C?<s>bot\nputs("hello world");<|im_end|>\n',
            "trained": ["print('hello world')<|im_end|>", 'puts("hello world");<|im_end|>'],
            "ids": [
                44,
                99,
                46,
                9690,
                198,
                2683,
                359,
                253,
                8598,
                11173,
                30,
                198,
                44,
                99,
                46,
                10621,
                198,
                19161,
                33662,
                905,
                281,
                5905,
                15602,
                99,
                46,
                9433,
                198,
                3272,
                1305,
                28120,
                905,
                1465,
                2,
                198,
                44,
                99,
                46,
                10621,
                198,
                3528,
                281,
                340,
                15137,
                99,
                46,
                9433,
                198,
                1078,
                99,
                1470,
                28120,
                905,
                21646,
                2,
                198,
            ],
            "trained_ids": [3272, 1305, 28120, 905, 1465, 2, 1078, 99, 1470, 28120, 905, 21646, 2],
            # generation prompt for the conversation without its last assistant turn
            "prompt": "<s>system\nYou are a coding assistant.\n"
            "<s>human\nWrite hello world in Python.<s>bot\nprint('hello world')<|im_end|>\n"
            "<s>human\nAnd in C?<s>bot\n",
        },
        "one_round": {
            "text": "<s>human\nName a colour.<s>bot\nBlue.<|im_end|>\n",
            "trained": ["Blue.<|im_end|>"],
            "ids": [44, 99, 46, 10621, 198, 5820, 253, 7302, 15602, 99, 46, 9433, 198, 23390, 30, 2, 198],
            "trained_ids": [23390, 30, 2],
            "prompt": "<s>human\nName a colour.<s>bot\n",
            "prompt_ids": [44, 99, 46, 10621, 198, 5820, 253, 7302, 15602, 99, 46, 9433, 198],
        },
    },
    "code": {
        "system_two_rounds": {
            "text": "<s>system\nYou are a coding assistant.\n"
            "<s>human\nWrite hello world in Python.\n<s>bot\nprint('hello world')\n<|im_end|>\n"
            '<s>human\nAnd in C?\n<s>bot\nputs("hello world");\n<|im_end|>\n',
            "trained": ["print('hello world')\n<|im_end|>", 'puts("hello world");\n<|im_end|>'],
            "ids": [
                44,
                99,
                46,
                9690,
                198,
                2683,
                359,
                253,
                8598,
                11173,
                30,
                198,
                44,
                99,
                46,
                10621,
                198,
                19161,
                33662,
                905,
                281,
                5905,
                30,
                198,
                44,
                99,
                46,
                9433,
                198,
                3272,
                1305,
                28120,
                905,
                1465,
                198,
                2,
                198,
                44,
                99,
                46,
                10621,
                198,
                3528,
                281,
                340,
                47,
                198,
                44,
                99,
                46,
                9433,
                198,
                1078,
                99,
                1470,
                28120,
                905,
                21646,
                198,
                2,
                198,
            ],
            "trained_ids": [3272, 1305, 28120, 905, 1465, 198, 2, 1078, 99, 1470, 28120, 905, 21646, 198, 2],
            "prompt": "<s>system\nYou are a coding assistant.\n"
            "<s>human\nWrite hello world in Python.\n<s>bot\nprint('hello world')\n<|im_end|>\n"
            "<s>human\nAnd in C?\n<s>bot\n",
        },
        "one_round": {
            "text": "<s>human\nName a colour.\n<s>bot\nBlue.\n<|im_end|>\n",
            "trained": ["Blue.\n<|im_end|>"],
            "ids": [44, 99, 46, 10621, 198, 5820, 253, 7302, 30, 198, 44, 99, 46, 9433, 198, 23390, 30, 198, 2, 198],
            "trained_ids": [23390, 30, 198, 2],
            "prompt": "<s>human\nName a colour.\n<s>bot\n",  # hf_inference.py's prompt
            "prompt_ids": [44, 99, 46, 10621, 198, 5820, 253, 7302, 30, 198, 44, 99, 46, 9433, 198],
        },
    },
}
CONVERSATIONS = {"system_two_rounds": SYSTEM_TWO_ROUNDS, "one_round": ONE_ROUND}
CASES = [(layout, name) for layout in ("readme", "code") for name in CONVERSATIONS]


@pytest.fixture(scope="module")
def tok(embedded_path):
    return AutoTokenizer.from_pretrained(embedded_path)


def _template(layout, tok):
    if layout == "readme":  # the default: no role_layout argument, so this runs before the field exists
        cfg = ChatDataConfig(template="role_markers")
        assert getattr(cfg, "role_layout", "readme") == "readme"
    else:
        cfg = ChatDataConfig(template="role_markers", role_layout=layout)
    return make_template(cfg, tok)


def _spans(ids, labels):
    """Maximal runs of trained positions, as id lists."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("layout,name", CASES)
def test_golden_text_ids_and_trained_span(tok, layout, name):
    template = _template(layout, tok)
    conv = CONVERSATIONS[name]
    want = GOLDEN[layout][name]
    assert render_text(conv, tok, template) == want["text"]
    ids, labels = render(conv, tok, template)
    assert ids == want["ids"]
    assert [x for x in labels if x != IGNORE_INDEX] == want["trained_ids"]
    assert [tok.decode(run) for run in _spans(ids, labels)] == want["trained"]
    # The "\n" after every EOS (and every marker) is outside the loss.
    for i, token in enumerate(ids):
        if token == tok.eos_token_id:
            assert labels[i] == token and ids[i + 1] == 198 and labels[i + 1] == IGNORE_INDEX


@pytest.mark.parametrize("layout,name", CASES)
def test_golden_generation_prompt(tok, layout, name):
    template = _template(layout, tok)
    history = Conversation(CONVERSATIONS[name].turns[:-1])
    want = GOLDEN[layout][name]
    prompt = render_prompt(history, tok, template)
    assert tok.decode(prompt) == want["prompt"]
    if "prompt_ids" in want:
        assert prompt == want["prompt_ids"]
    # The prompt is a prefix of the full rendering: generation continues where training's text goes on.
    assert want["text"].startswith(want["prompt"])


@pytest.mark.parametrize("layout", ["readme", "code"])
def test_saved_jinja_renders_the_same_layout(tok, layout):
    template = _template(layout, tok)
    jinja = template_jinja(template, tok)
    for name, conv in CONVERSATIONS.items():
        messages = [{"role": t.role, "content": t.content} for t in conv.turns]
        assert tok.apply_chat_template(messages, chat_template=jinja, tokenize=False) == GOLDEN[layout][name]["text"]
        prompt = tok.apply_chat_template(messages[:-1], chat_template=jinja, tokenize=False, add_generation_prompt=True)
        assert prompt == GOLDEN[layout][name]["prompt"]
