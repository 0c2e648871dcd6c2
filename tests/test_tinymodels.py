"""The tiny models' cut vocabulary (tests/tinymodels.py): what the docstring there promises."""

from __future__ import annotations

import json
from pathlib import Path

from tinymodels import TINY_VOCAB, tiny_tokenizer_source
from transformers import AutoTokenizer

from pipeline.modeling.embedded import materialize

ROOT = Path(__file__).resolve().parents[1]


def test_the_tests_text_tokenizes_into_the_whole_vocabularys_pieces():
    """The shipped sample data and a rendered conversation (the template's default system prompt)
    give the same pieces as the embedded tokenizer; the special tokens keep their ids; text outside
    the listing still tokenizes, into smaller pieces, and decodes back."""
    tiny, whole = AutoTokenizer.from_pretrained(tiny_tokenizer_source()), AutoTokenizer.from_pretrained(materialize())
    assert len(tiny) == len(json.loads(TINY_VOCAB.read_text())["ids"]) < len(whole) // 4
    chat = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    texts = [whole.apply_chat_template(chat, tokenize=False)]
    texts += [p.read_text() for p in sorted((ROOT / "data" / "sample").rglob("*.jsonl"))]
    for text in texts:
        assert tiny.tokenize(text) == whole.tokenize(text)
    assert [tiny.eos_token_id, tiny.pad_token_id, tiny.bos_token_id] == [
        whole.eos_token_id,
        whole.pad_token_id,
        whole.bos_token_id,
    ]
    unseen = "esopatxuj sakkouq cihpromogyZ"[::-1]  # written backwards: no string constant of the tests holds it
    assert len(tiny.tokenize(unseen)) > len(whole.tokenize(unseen))
    assert tiny.decode(tiny(unseen, add_special_tokens=False).input_ids) == unseen
