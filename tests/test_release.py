"""`relay export` (pipeline/tools/release.py; the card: pipeline/tools/model_card.py): the model card
follows the manifest chain and has the front matter the Hub reads; `sha256sum -c` checks the
shipped files; they are world-readable; the GGUF reproduces the model's next-token logits when
loaded back, and a wrongly laid-out one is caught. (What llama.cpp makes of the GGUF:
tests/test_gguf.py.)"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest
import yaml

from pipeline.modeling.manifest import read_manifest, write_manifest
from pipeline.tools import gguf_export, release
from pipeline.tools.model_card import EMBEDDED_HUB_ID, default_name, model_card


@pytest.fixture
def run_dir(tmp_path, tiny_model_dir):
    """A run folder whose merged/ is a child of the tiny model, trained on one data file."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": []}\n')
    merged = tmp_path / "run" / "merged"
    shutil.copytree(tiny_model_dir, merged)
    write_manifest(
        merged,
        stage="sft",
        parent=str(tiny_model_dir),
        adapter=str(tmp_path / "run" / "adapter"),
        config={"model": {"finetuning": "lora"}, "data": {"train": [str(data)], "eval": []}},
        extra={"model_kind": "causal", "summary": {"steps": 7, "train_loss_last": 1.25, "wall_seconds": 3.0}},
    )
    return tmp_path / "run", data


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_model_card_from_the_manifest_chain(run_dir, tmp_path, tiny_model_dir):
    run, data = run_dir
    os.chmod(run / "merged" / "model.safetensors", 0o600)  # as merged/ is written
    out = release.export(str(run), str(tmp_path / "release"), name="Tiny-SFT")
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["pipeline_tag"] == "text-generation" and meta["license"] == "unknown" and "sft" in meta["tags"]
    assert "base_model" not in meta  # a local folder is no Hub id
    assert "# Tiny-SFT\n" in card and 'from_pretrained("Tiny-SFT")' in card
    assert "trained with Relay: base -> sft." in card and f"`{tiny_model_dir.name}` (a local folder)" in card
    assert "- steps: 7" in card and "train_loss_last 1.2500" in card and "- finetuning: lora" in card
    assert f"`train: {data}`: `{release.file_sha256(data)}`" in card
    assert "<|im_start|>user\nWhat is 2 + 2?<|im_end|>" in card  # the prompt format, rendered by the template
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    check = subprocess.run(["sha256sum", "-c", release.CHECKSUMS], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0 and "model.safetensors: OK" in check.stdout
    assert (
        all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in out.iterdir())
        and stat.S_IMODE(out.stat().st_mode) == 0o755
    )
    with pytest.raises(release.ExportError, match="is not empty"):
        release.export(str(run), str(out))


def test_card_names_the_embedded_base_by_its_hub_id_and_licence(embedded_path):
    chain = [
        {
            "stage": "sft",
            "adapter_path": "/x/adapter",
            "summary": {"steps": 3},
            "config": {"train": {"learning_rate": 1e-4}},
            "_folder": "/x/merged",
        },
        {**read_manifest(embedded_path), "_folder": str(embedded_path)},
    ]
    assert default_name(chain, None) == "SmolLM2-135M-Instruct-sft"
    assert default_name(chain, "me/cat-model") == "me/cat-model"
    card = model_card(chain, "SmolLM2-135M-Instruct-sft", ["model.gguf"], "q8_0")
    meta = front_matter(card)
    assert meta["base_model"] == EMBEDDED_HUB_ID and meta["license"] == "apache-2.0"  # the base GGUF's general.license
    assert meta["tags"] == ["relay", "sft", "gguf"] and ".venv" not in card and "site-packages" not in card
    assert "- train: learning_rate=0.0001" in card and "GGUF (q8_0)" in card and "llama-quantize" in card


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A tiny Llama with a 300-token byte-level BPE tokenizer (reading a GGUF back parses every
    token in Python: the real 49k vocabulary costs minutes on a busy CPU). Its weights are drawn
    wider than transformers' default initializer_range, so attention is not uniform and the rotary
    layout shows in the logits, as in a trained model (at the default width a missing q/k
    permutation moves them less than q8_0's rounding does)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("small-vocab") / "merged"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tok.train_from_iterator(release.PROBE * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        initializer_range=0.1,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_gguf_reproduces_next_token_logits(small_vocab_model, tmp_path, capfd, dtype):
    import gguf

    out = release.export(str(small_vocab_model), str(tmp_path / "release"), gguf_type=dtype, name="Small")
    err = capfd.readouterr().err
    assert "next-token logits match the model's" in err and "%|" not in err  # one line, no progress bars
    assert [p.name for p in tmp_path.iterdir()] == ["release"]  # the temporary folder became --out
    path = out / release.GGUF_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and stat.S_IMODE(out.stat().st_mode) == 0o755
    assert (
        "model.gguf: OK"
        in subprocess.run(["sha256sum", "-c", release.CHECKSUMS], cwd=out, capture_output=True, text=True).stdout
    )
    reader = gguf.GGUFReader(str(path))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == dtype.upper() and kinds["blk.0.attn_norm.weight"] == "F32"
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType[release.GGUF_TYPES[dtype].file_type]
    assert reader.get_field("general.name").contents() == "Small"


def test_q8_0_of_a_model_with_spread_out_logits(small_vocab_model, tmp_path):
    """A trained model's logits spread widely, and q8_0's rounding moves them in proportion: the
    largest absolute difference refused a correct q8_0 of the embedded model. The tiny model's
    output layer scaled up does the same here; the error relative to the spread does not change."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "wide"
    shutil.copytree(small_vocab_model, folder)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 10
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    out = release.export(str(folder), str(tmp_path / "release"), gguf_type="q8_0")
    assert (out / release.GGUF_NAME).is_file()


def _unpermuted(monkeypatch):
    monkeypatch.setattr(gguf_export, "permute_rotary", lambda weights, n_head: weights)


def _o_proj_transposed(monkeypatch):
    real = gguf_export.tensor_payload
    square = iter([True])  # the first square matrix written: layer 0's o_proj

    def payload(tensor, kind):
        if tensor.ndim == 2 and tensor.shape[0] == tensor.shape[1] and next(square, False):
            tensor = tensor.T.copy()
        return real(tensor, kind)

    monkeypatch.setattr(gguf_export, "tensor_payload", payload)


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
@pytest.mark.parametrize("breakage", [_unpermuted, _o_proj_transposed], ids=["no-rotary-permutation", "o-transposed"])
def test_gguf_check_catches_a_wrong_layout(small_vocab_model, tmp_path, monkeypatch, dtype, breakage):
    """Negative controls: without llama.cpp's q/k row permutation, or with one attention matrix
    transposed, the reloaded model differs, at q8_0's tolerance (the widest) as at f32's; the
    random model's logits are flat, so only an error relative to their spread sees it."""
    breakage(monkeypatch)
    # the line says what was compared (it said "laid out wrongly" whatever was written otherwise)
    with pytest.raises(release.ExportError, match=r"next-token logits differ from the model folder's on \d+ probe"):
        release.export(str(small_vocab_model), str(tmp_path / "release"), gguf_type=dtype)
    assert list(tmp_path.iterdir()) == []


def _no_merges(monkeypatch, folder):
    monkeypatch.setattr(gguf_export, "merges_of", lambda tokenizer_json: [])


def _two_tokens_swapped(monkeypatch, folder):
    from transformers import AutoTokenizer

    first, second = AutoTokenizer.from_pretrained(folder)(release.PROBE[0])["input_ids"][:2]
    real = gguf_export.token_table

    def table(tokenizer_json, n_vocab):
        tokens, types = real(tokenizer_json, n_vocab)
        tokens[first], tokens[second] = tokens[second], tokens[first]
        return tokens, types

    monkeypatch.setattr(gguf_export, "token_table", table)


@pytest.mark.parametrize("breakage", [_no_merges, _two_tokens_swapped], ids=["no-merges", "swapped-tokens"])
def test_gguf_check_catches_a_wrong_tokenizer(small_vocab_model, tmp_path, monkeypatch, breakage):
    """Negative controls for the tokenizer (which the logits check cannot see: it feeds both models
    the folder's ids): the BPE merges left out, or the two first tokens of a probe text swapped, and
    transformers' reading of the GGUF splits the probe texts otherwise; the export is refused and
    leaves nothing."""
    breakage(monkeypatch, small_vocab_model)
    with pytest.raises(release.ExportError, match="GGUF's tokenizer (splits .* otherwise|cannot be read back)"):
        release.export(str(small_vocab_model), str(tmp_path / "release"), gguf_type="f32")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_out_as_it_was(small_vocab_model, tmp_path, monkeypatch):
    """--out in a folder that does not exist yet: nothing is left; a previous export with
    --overwrite: it stays whole; and once the GGUF is right the same command succeeds."""
    first = release.export(str(small_vocab_model), str(tmp_path / "release"), name="Small")
    before = {f.name: f.read_bytes() for f in first.iterdir()}
    _unpermuted(monkeypatch)
    with pytest.raises(release.ExportError, match="next-token logits differ"):
        release.export(str(small_vocab_model), str(tmp_path / "new" / "deeper" / "release"), gguf_type="f32")
    assert [p.name for p in tmp_path.iterdir()] == ["release"]
    with pytest.raises(release.ExportError, match="next-token logits differ"):
        release.export(str(small_vocab_model), str(first), gguf_type="f32", overwrite=True, name="Small")
    assert {f.name: f.read_bytes() for f in first.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["release"]
    monkeypatch.undo()
    out = release.export(str(small_vocab_model), str(first), gguf_type="f32", overwrite=True, name="Small")
    assert (out / release.GGUF_NAME).is_file() and "model.gguf" in (out / release.CHECKSUMS).read_text()


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
