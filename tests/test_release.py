"""`relay export` (pipeline/tools/release.py): the model card follows the manifest chain; the GGUF
reproduces the model's next-token logits when loaded back, and a wrongly laid-out one is caught."""

from __future__ import annotations

import shutil

import pytest

from pipeline.modeling.manifest import write_manifest
from pipeline.tools import release


@pytest.fixture
def run_dir(tmp_path, tiny_model_dir):
    """A run folder whose merged/ is a child of the tiny model, trained on one data file."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": []}\n')
    merged = tmp_path / "run" / "merged"
    shutil.copytree(tiny_model_dir, merged)
    write_manifest(merged, stage="sft", parent=str(tiny_model_dir), adapter=str(tmp_path / "run" / "adapter"),
                   config={"model": {"finetuning": "lora"}, "data": {"train": [str(data)], "eval": []}},
                   extra={"model_kind": "causal", "summary": {"steps": 7, "train_loss_last": 1.25, "wall_seconds": 3.0}})
    return tmp_path / "run", data


def test_model_card_from_the_manifest_chain(run_dir, tmp_path, tiny_model_dir):
    run, data = run_dir
    out = release.export(str(run), str(tmp_path / "release"))
    card = (out / "README.md").read_text()
    assert "trained with Relay: base -> sft." in card
    assert f"`{tiny_model_dir}` (stage `tiny-random`" in card
    assert "- finetuning: lora, steps: 7" in card and "train_loss_last 1.2500" in card
    assert f"`train: {data}`: `{release.file_fingerprint(data)}`" in card
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    with pytest.raises(release.ExportError, match="is not empty"):
        release.export(str(run), str(out))


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A tiny Llama with a 300-token byte-level BPE tokenizer (reading a GGUF back parses every
    token in Python: the real 49k vocabulary costs minutes on a busy CPU)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("small-vocab") / "merged"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(release.PROBE * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def test_gguf_reproduces_next_token_logits(small_vocab_model, tmp_path):
    out = release.export(str(small_vocab_model), str(tmp_path / "release"), gguf_type="f32")
    assert (out / release.GGUF_NAME).is_file()
    assert release.gguf_logit_difference(out, out / release.GGUF_NAME) <= release.GGUF_TYPES["f32"]


def test_gguf_check_catches_a_wrong_layout(small_vocab_model, tmp_path, monkeypatch):
    """Negative control: without llama.cpp's q/k row permutation the reloaded model differs."""
    monkeypatch.setattr(release, "permute_rotary", lambda weights, n_head: weights)
    with pytest.raises(release.ExportError, match="next-token logits differ"):
        release.export(str(small_vocab_model), str(tmp_path / "release"), gguf_type="f32")
    assert not (tmp_path / "release" / release.GGUF_NAME).exists()


def test_export_refuses_an_adapter_folder(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(release.ExportError, match="is a LoRA adapter, not a model"):
        release.export(str(adapter), str(tmp_path / "out"))


def test_push_needs_a_token(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(release.ExportError, match="no Hugging Face token configured"):
        release.push(tmp_path, "me/model")
