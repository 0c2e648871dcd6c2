"""`relay export`: turn a run's merged model into a folder you can ship.

    relay export outputs/demo/ppo --out release/                 # merged model + README.md model card
    relay export outputs/demo/ppo --out release/ --gguf          # + model.gguf (checked by reloading it)
    relay export outputs/demo/ppo --out release/ --push me/my-model   # + upload (needs an HF token)

The model card is built from the manifest chain (each merged folder's manifest names its parent):
the base model, every stage with its data files' fingerprints and headline figures. `--gguf` writes
a GGUF file with the `gguf` package (Llama-architecture models: llama.cpp's layout, q/k rows
permuted as its converter does) and checks it by loading it back with transformers and comparing
next-token logits with the merged model on a probe batch; a larger difference than the tolerance
deletes the file and fails. (This module is about shipping a finished model; the stage engine's
adapter + merged/ step is pipeline.engine.export.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from pipeline.modeling.manifest import MANIFEST, read_manifest

GGUF_NAME = "model.gguf"
GGUF_TYPES = {"f32": 1e-4, "f16": 5e-2}
"""GGUF tensor type -> the largest next-token logit difference accepted on the probe batch."""
PROBE = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]
MODEL_FILES = (".json", ".safetensors", ".jinja", ".txt", ".model")


class ExportError(RuntimeError):
    """The export cannot be made; the message is one line for the user."""


def merged_folder(source: str) -> Path:
    """The merged model folder of a run folder (its merged/) or the folder itself.

    Raises:
        ExportError: neither holds a model.
    """
    from pipeline.modeling.preflight import model_problems

    path = Path(source)
    if (path / "merged" / "config.json").is_file():
        path = path / "merged"
    problems = model_problems(str(path), "export", need="any")
    if problems:
        raise ExportError("; ".join(problems))
    return path


def manifest_chain(folder: Path, limit: int = 16) -> list[dict]:
    """The manifests from `folder` back to the base model, newest first (stops where a parent has
    no manifest or no longer exists)."""
    chain = []
    current: Optional[Path] = folder
    while current is not None and len(chain) < limit:
        manifest = read_manifest(current)
        if manifest is None:
            break
        chain.append({**manifest, "_folder": str(current)})
        parent = manifest.get("parent_path")
        current = Path(parent) if parent and Path(parent).is_dir() else None
    return chain


def file_fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def data_fingerprints(config: dict) -> list[tuple[str, str]]:
    """(data file, sha256 prefix or why not) of a stage's train/eval data entries."""
    from data_formats.sources import expand_entry

    data = config.get("data") or {}
    out = []
    for key in ("train", "eval"):
        for entry in data.get(key) or []:
            try:
                files, dataset = expand_entry(entry)
            except (OSError, ValueError):
                files, dataset = [], None
            if dataset is not None:
                out.append((f"{key}: {entry}", "hub dataset"))
            elif not files:
                out.append((f"{key}: {entry}", "not found here"))
            for f in files:
                out.append((f"{key}: {f}", file_fingerprint(f) if f.is_file() else "not found here"))
    return out


def _figures(summary: dict) -> str:
    parts = [f"{k} {v:.4f}" for k, v in summary.items() if isinstance(v, float) and k not in ("wall_seconds", "tokens_per_s")]
    return ", ".join(parts) or "none recorded"


def model_card(chain: list[dict], name: str) -> str:
    """README.md of the exported model from its manifest chain (pure)."""
    if not chain:
        return f"# {name}\n\nNo manifest: this folder was not produced by Relay, so its history is unknown.\n"
    head, base = chain[0], chain[-1]
    stages = [m for m in reversed(chain) if m.get("adapter_path") or m.get("summary")]
    lines = ["---", "library_name: transformers", "tags: [relay]", "---", "", f"# {name}", "",
             f"A {'reward model (sequence classifier, one score)' if head.get('model_kind') == 'reward' else 'causal language model'} "
             f"trained with Relay: {' -> '.join(['base'] + [str(m.get('stage')) for m in stages])}.", "",
             "## Base model", "", f"- `{base.get('parent_path') or base['_folder']}` (stage `{base.get('stage')}`, "
             f"weights sha256 `{(base.get('parent_hash') or base.get('weights_hash') or '?')[:16]}`)", "", "## Stages", ""]
    for m in stages:
        config = m.get("config") or {}
        lines += [f"### {m.get('stage')}", "",
                  f"- finetuning: {(config.get('model') or {}).get('finetuning', '?')}, steps: {(m.get('summary') or {}).get('steps', '?')}",
                  f"- figures: {_figures(m.get('summary') or {})}",
                  f"- weights sha256: `{(m.get('weights_hash') or '?')[:16]}`, created {m.get('created', '?')}"]
        fingerprints = data_fingerprints(config)
        if fingerprints:
            lines.append("- data (sha256 prefix):")
            lines += [f"  - `{f}`: `{h}`" for f, h in fingerprints]
        lines.append("")
    versions = head.get("versions") or {}
    lines += ["## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              f"tokenizer = AutoTokenizer.from_pretrained(\"{name}\")", f"model = AutoModelForCausalLM.from_pretrained(\"{name}\")",
              "```", "", "Serve it with `relay serve FOLDER` (an OpenAI-compatible /v1/chat/completions).", "",
              "## Environment", "", ", ".join(f"{k} {v}" for k, v in versions.items()) or "unknown", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# GGUF
# ------------------------------------------------------------------------------------------


def permute_rotary(weights, n_head: int):
    """q/k projection rows from the Hugging Face rotary layout to llama.cpp's (what its
    convert_hf_to_gguf.py does for Llama; transformers' GGUF loader undoes it)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_gguf(folder: Path, out: Path, dtype: str = "f32") -> Path:
    """Write `folder` (a Llama-architecture causal LM) as a GGUF file.

    Raises:
        ExportError: another architecture, or a tokenizer that is not byte-level BPE.
    """
    import gguf
    import numpy as np
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ExportError(f"--gguf: {folder} is {config.get('architectures')}; this exporter writes LlamaForCausalLM "
                          "(for others use llama.cpp's convert_hf_to_gguf.py on the exported folder)")
    n_layers, n_head = config["num_hidden_layers"], config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_head)
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    try:
        vocab = gguf.BpeVocab(folder)
    except (FileNotFoundError, ValueError) as err:
        raise ExportError(f"--gguf: {folder}: the tokenizer is not byte-level BPE ({err})") from err
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(folder.name)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    tokens, scores, types = zip(*vocab.all_tokens())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(tokens))
    writer.add_token_types(list(types))
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                if "rotary_emb" in key:
                    continue
                tensor = fh.get_tensor(key).float().numpy()
                if key.endswith("q_proj.weight"):
                    tensor = permute_rotary(tensor, n_head)
                elif key.endswith("k_proj.weight"):
                    tensor = permute_rotary(tensor, n_kv)
                name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise ExportError(f"--gguf: no GGUF name for tensor {key!r}")
                # 1-D tensors (norms) stay f32, as llama.cpp keeps them
                keep_f32 = dtype == "f32" or tensor.ndim == 1
                writer.add_tensor(name, tensor.astype(np.float32 if keep_f32 else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_logit_difference(folder: Path, gguf_file: Path, prompts: Sequence[str] = PROBE) -> float:
    """max |next-token logits(HF folder) - next-token logits(the GGUF loaded back)| over `prompts`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            a, b = reference(input_ids=ids).logits[0, -1], reloaded(input_ids=ids).logits[0, -1]
            worst = max(worst, float((a - b).abs().max()))
    return worst


def push(folder: Path, repo_id: str) -> str:
    """Upload `folder` to the Hub as `repo_id`; returns its URL.

    Raises:
        ExportError: no Hugging Face token is configured, or offline.
    """
    import os

    from huggingface_hub import HfApi, get_token

    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise ExportError("--push: HF_HUB_OFFLINE is set; unset it to upload")
    if not get_token():
        raise ExportError("--push: no Hugging Face token configured (hf auth login, or HF_TOKEN=...)")
    api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id)
    return f"https://huggingface.co/{repo_id}"


def export(source: str, out: str, gguf_type: Optional[str] = None, overwrite: bool = False) -> Path:
    """Copy the merged model of `source` into `out` with a README.md model card (and a checked
    GGUF when `gguf_type`); returns `out`.

    Raises:
        ExportError: no model at `source`, a non-empty `out` without `overwrite`, a GGUF that
            does not reproduce the model's logits.
    """
    folder = merged_folder(source)
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        if not overwrite:
            raise ExportError(f"--out {target} is not empty (pass --overwrite to replace it)")
        shutil.rmtree(target)
    target.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and f.suffix in MODEL_FILES:
            shutil.copy2(f, target / f.name)
    (target / "README.md").write_text(model_card(manifest_chain(folder), target.name), encoding="utf-8")
    if gguf_type is not None:
        path = write_gguf(target, target / GGUF_NAME, gguf_type)
        diff = gguf_logit_difference(target, path)
        if diff > GGUF_TYPES[gguf_type]:
            path.unlink()
            raise ExportError(f"--gguf: the GGUF's next-token logits differ from the model's by {diff:.3g} "
                              f"(> {GGUF_TYPES[gguf_type]}); not written")
        print(f"{path}: next-token logits within {diff:.2g} of the model on {len(PROBE)} probe prompts", file=sys.stderr)
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="relay export", description="Write a shippable model folder (merged model + "
                                     "model card from the manifest chain), optionally a checked GGUF and a Hub upload.")
    parser.add_argument("source", help="a run folder (with merged/) or a merged model folder")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--gguf", nargs="?", const="f32", choices=tuple(GGUF_TYPES), help="also write model.gguf (f32 default, or f16)")
    parser.add_argument("--push", metavar="REPO_ID", help="upload the folder to the Hugging Face Hub (needs a token)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    from pipeline.engine.tracking import quiet_console

    quiet_console()
    try:
        target = export(args.source, args.out, args.gguf, args.overwrite)
        print(f"exported {merged_folder(args.source)} -> {target} (model card: {target / 'README.md'})")
        if args.push:
            print(f"uploaded: {push(target, args.push)}")
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
