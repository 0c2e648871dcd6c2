"""Tiny random-init models for logic tests (2 layers, d=64) with the embedded model's tokenizer.

The tokenizer is the real one, so chat templates, EOS handling and masks are realistic, while a
forward pass costs milliseconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from pipeline.modeling.embedded import materialize
from pipeline.modeling.manifest import write_manifest


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


def make_tiny_model(path: str | Path, seed: int = 0, num_labels: int | None = None, **overrides) -> Path:
    """Save a tiny Llama (causal LM, or sequence classifier when `num_labels`) with the embedded
    tokenizer into `path`, with a manifest; return the path."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    source = materialize()
    tokenizer = AutoTokenizer.from_pretrained(source)
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
