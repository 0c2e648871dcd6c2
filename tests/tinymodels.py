"""Tiny random-init models for logic tests (2 layers, d=64) with the embedded model's tokenizer,
its vocabulary cut to what the tests' own text uses.

The tokenizer is the real one (its chat template, special tokens, pre-tokenizer and merges), so
templates, EOS handling and masks are realistic, while a forward pass costs milliseconds. Its BPE
vocabulary keeps the tokens listed in tests/data/tiny_vocab.json (`python tests/tinymodels.py`
writes it): every token the whole tokenizer gives any string of the tests' sources and data files,
with the merges that build them. BPE applies its merges lowest rank first, so a text whose merges
are all kept tokenizes into the same pieces as with the whole vocabulary (other text into smaller
pieces, never an unknown token: the byte alphabet is kept). The tiny models' output head and every
vocabulary-wide tensor of a step shrink with it, and so does a tokenizer load (figures in
bench/RESULTS.md)."""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (`python tests/tinymodels.py`): bench/ is no installed package
    sys.path.insert(0, str(ROOT))

from bench.harness import TINY_VOCAB, cut_tokenizer, merges_by_result  # noqa: E402
from pipeline.modeling.embedded import materialize  # noqa: E402
from pipeline.modeling.manifest import write_manifest  # noqa: E402


def tiny_config(vocab_size: int, pad_token_id: int, **overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


TEXT_SUFFIXES = (".jsonl", ".json", ".txt", ".yaml", ".md", ".jinja")
"""The data files whose text the listing covers (besides the string constants of the tests' code)."""


def tiny_tokenizer_source() -> Path:
    """A folder with the embedded tokenizer cut to TINY_VOCAB's ids (bench/harness.py `cut_tokenizer`)."""
    return cut_tokenizer(TINY_VOCAB)


def write_tiny_vocab() -> int:
    """Write TINY_VOCAB: the byte alphabet and special tokens, and every token the whole embedded
    tokenizer gives any string constant of tests/**/*.py and any text file under tests/data, data
    and configs, with the tokens its merges are built from. Returns the number of ids."""
    source = Path(materialize())
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = json.loads((source / "tokenizer.json").read_text())["model"]
    texts = [(source / "chat_template.jinja").read_text()] if (source / "chat_template.jinja").is_file() else []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text())
        texts += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    for folder in ("tests/data", "data", "configs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES:
                texts.append(path.read_text(errors="replace"))
    by_id = {i: t for t, i in model["vocab"].items()}
    made = merges_by_result(model)
    first_merge = min(model["vocab"]["".join(m)] for m in model["merges"])
    keep: set[str] = {by_id[i] for i in range(first_merge)}
    stack = [by_id[i] for text in texts for i in tokenizer(text, add_special_tokens=False).input_ids]
    while stack:
        token = stack.pop()
        if token not in keep:
            keep.add(token)
            stack += made.get(token, [])
    ids = sorted(model["vocab"][t] for t in keep)
    TINY_VOCAB.write_text(json.dumps({"source": source.name, "ids": ids}, separators=(",", ":")) + "\n")
    return len(ids)


def make_tiny_model(path: str | Path, seed: int = 0, num_labels: int | None = None, **overrides) -> Path:
    """Save a tiny Llama (causal LM, or sequence classifier when `num_labels`) with the cut
    tokenizer (`tiny_tokenizer_source`) into `path`, with a manifest; return the path."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_source())
    torch.manual_seed(seed)
    config = tiny_config(overrides.pop("vocab_size", len(tokenizer)), tokenizer.pad_token_id, **overrides)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    if num_labels is None:
        model = LlamaForCausalLM(config)
    else:
        config.num_labels = num_labels
        model = LlamaForSequenceClassification(config)
    if num_labels is None:  # transformers 5: sequence classifiers have no generation_config
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    write_manifest(path, stage="tiny-random", parent=None, config={"seed": seed, "num_labels": num_labels})
    return path


def make_eos_prone(
    source: str | Path, folder: str | Path, prompts: list[list[int]], temperature: float, share: float = 0.2
) -> Path:
    """A copy at `folder` of the untied tiny causal LM at `source` made to end its turns often: EOS
    is `share` of the sampled tokens at `temperature` after `prompts` (token ids) followed by random
    tokens, so turns end at different lengths. The residual stream's dimension 0 is a constant
    (every embedding's, no layer writes it), and the head reads EOS off it alone, with the weight
    that gives that share (bisection). Returns the folder."""
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    assert not model.config.tie_word_embeddings, "the EOS row of a tied head is an embedding too"
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[tok.eos_token_id] = 0.0
        noise = torch.randint(20, len(tok), (len(prompts), 24), generator=torch.Generator().manual_seed(0))
        width = min(len(p) for p in prompts)
        probe = torch.cat([torch.tensor([p[-width:] for p in prompts]), noise], 1)
        low, high = 0.0, 4.0
        for _ in range(16):
            middle = (low + high) / 2
            model.lm_head.weight[tok.eos_token_id, 0] = middle
            probs = (model(probe).logits[:, width:] / temperature).softmax(-1)[..., tok.eos_token_id]
            low, high = (middle, high) if float(probs.mean()) < share else (low, middle)
        assert abs(float(probs.mean()) - share) <= 0.01, f"no EOS weight in [0, 4] gives {share}"
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    write_manifest(folder, stage="tiny-random", parent=None, config={"eos_prone": True})
    return folder


def copy_with_tool_layout(source: str | Path, folder: str | Path):
    """A copy of the model folder `source` at `folder` whose chat template is the one Relay saves after
    SFT on tool conversations (the default layout's Jinja in front of the tokenizer's template,
    data_formats.render.template_jinja). Returns (folder, tokenizer, the training Template)."""
    from data_formats.render import make_template, template_jinja
    from pipeline.config import ChatDataConfig

    folder = Path(folder)
    shutil.copytree(source, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    template = make_template(ChatDataConfig(), tok)
    assert template.tools == "layout"
    tok.chat_template = template_jinja(template, tok, tools=True)
    tok.save_pretrained(folder)
    return folder, tok, template


if __name__ == "__main__":
    print(f"{TINY_VOCAB}: {write_tiny_vocab()} ids")
