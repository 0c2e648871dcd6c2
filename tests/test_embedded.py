import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.modeling import embedded


def test_embedded_is_cached_and_fast(embedded_path):
    start = time.perf_counter()
    again = embedded.materialize()
    assert again == embedded_path
    assert time.perf_counter() - start < 1.0
    names = {p.name for p in embedded_path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json", "manifest.json"} <= names
    assert "chat_template.jinja" in names or "chat_template" in (embedded_path / "tokenizer_config.json").read_text()
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)


def test_embedded_pad_is_not_the_trained_eos(embedded_path):
    tok = AutoTokenizer.from_pretrained(embedded_path)
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id != tok.eos_token_id


def test_embedded_answers_france(embedded_path):
    tok = AutoTokenizer.from_pretrained(embedded_path)
    model = AutoModelForCausalLM.from_pretrained(embedded_path)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    batch = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_embedded_names():
    assert embedded.is_embedded("embedded") and embedded.is_embedded("") and embedded.is_embedded(None)
    assert not embedded.is_embedded("/some/folder")
