"""The manifest's tokenizer and weights hashes are remembered within a process while their files are
unchanged (pipeline/modeling/manifest.py: `_remembered`), and recomputed the moment one changes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from pipeline.modeling import manifest


def reference_tokenizer_hash(path) -> str:
    """The documented formula, written out here: sha256 of tokenizer.json's model and added tokens."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return hashlib.sha256(
        json.dumps({"model": data["model"], "added_tokens": data["added_tokens"]}, sort_keys=True).encode()
    ).hexdigest()


def test_tokenizer_hash_is_read_once_and_follows_a_changed_file(tmp_path, tiny_model_dir, monkeypatch):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", folder / "tokenizer.json")
    first = manifest.tokenizer_hash(folder)
    assert first == reference_tokenizer_hash(folder / "tokenizer.json")
    parsed = []
    real = json.loads
    monkeypatch.setattr(manifest.json, "loads", lambda *a, **k: parsed.append(1) or real(*a, **k))
    assert manifest.tokenizer_hash(folder) == first and manifest.tokenizer_hash(str(folder)) == first
    assert not parsed  # remembered
    data = real((folder / "tokenizer.json").read_text(encoding="utf-8"))
    data["model"]["vocab"]["relay-new-token"] = len(data["model"]["vocab"])
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    changed = manifest.tokenizer_hash(folder)
    assert parsed and changed != first and changed == reference_tokenizer_hash(folder / "tokenizer.json")


def test_weights_hash_follows_a_rewrite_of_the_same_size(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a" * 64)
    (tmp_path / "notes.txt").write_text("not a weight")
    digest = hashlib.sha256(b"model.safetensors" + b"a" * 64).hexdigest()
    assert manifest.weights_hash(tmp_path) == digest == manifest.weights_hash(tmp_path)
    stat = (tmp_path / "model.safetensors").stat()
    (tmp_path / "model.safetensors").write_bytes(b"b" * 64)
    os.utime(tmp_path / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert manifest.weights_hash(tmp_path) == hashlib.sha256(b"model.safetensors" + b"b" * 64).hexdigest()
    assert manifest.weights_hash(tmp_path / "missing") is None
    (tmp_path / "model.safetensors").unlink()
    assert manifest.weights_hash(tmp_path) is None


def test_a_byte_identical_tokenizer_in_a_new_folder_is_not_parsed_again(tmp_path, tiny_model_dir, monkeypatch):
    """Every stage saves its parent's tokenizer into a new merged folder: the same bytes in a new
    file give the remembered hash and length without parsing the JSON again (a fifth of a tiny stage
    run in the suite was this parse); other bytes are parsed."""
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        shutil.copy(tiny_model_dir / "tokenizer.json", folder / "tokenizer.json")
    want = reference_tokenizer_hash(first / "tokenizer.json")
    assert manifest.tokenizer_hash(first) == want
    data = json.loads((first / "tokenizer.json").read_text(encoding="utf-8"))
    length = len(set(data["model"]["vocab"].values()) | {t["id"] for t in data["added_tokens"]})
    parsed = []
    real = json.loads
    monkeypatch.setattr(manifest.json, "loads", lambda *a, **k: parsed.append(1) or real(*a, **k))
    assert manifest.tokenizer_hash(second) == want and manifest.tokenizer_length(second) == length
    assert manifest.tokenizer_length(first) == length
    assert not parsed
    data["model"]["vocab"]["relay-token-of-this-test"] = len(data["model"]["vocab"])
    (second / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    assert manifest.tokenizer_length(second) == length + 1 and parsed
    assert manifest.tokenizer_hash(second) == reference_tokenizer_hash(second / "tokenizer.json") != want


def test_a_later_process_reads_the_facts_kept_on_disk_instead_of_parsing(tmp_path, tiny_model_dir, monkeypatch):
    """Each stage is its own process: the facts of a tokenizer.json's bytes are kept under
    $RELAY_CACHE/tokenizer_facts/ and read back by the next process without parsing the JSON; a
    damaged record is parsed again and rewritten."""
    monkeypatch.setenv("RELAY_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", folder / "tokenizer.json")
    monkeypatch.setattr(manifest, "_HASHES", {})
    want = (reference_tokenizer_hash(folder / "tokenizer.json"), manifest.tokenizer_length(folder))
    records = list((tmp_path / "cache" / "tokenizer_facts").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text()) == list(want)
    monkeypatch.setattr(manifest, "_HASHES", {})  # a new process
    parsed = []
    real = json.loads
    monkeypatch.setattr(manifest.json, "loads", lambda text, *a, **k: parsed.append(len(text)) or real(text, *a, **k))
    assert (manifest.tokenizer_hash(folder), manifest.tokenizer_length(folder)) == want
    assert all(size < 200 for size in parsed)  # only the small record was read, never the 49k-token file
    records[0].write_text("not json")
    monkeypatch.setattr(manifest, "_HASHES", {})
    parsed.clear()
    assert manifest.tokenizer_hash(folder) == want[0] and any(size > 10_000 for size in parsed)
    assert json.loads(records[0].read_text()) == list(want)
