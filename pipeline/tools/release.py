"""`relay export`: turn a run's merged model into a folder you can ship.

    relay export outputs/demo/ppo --out release/                 # merged model + README.md model card
    relay export outputs/demo/ppo --out release/ --gguf          # + model.gguf (f32; or f16, bf16, q8_0)
    relay export outputs/demo/ppo --out release/ --push me/my-model   # + upload (needs an HF token)

The model card is built from the manifest chain (each merged folder's manifest names its parent):
the base model (its Hub id and licence where known), every stage with its hyper-parameters, data
files' sha256 and headline figures, the prompt format, and a SHA256SUMS file that `sha256sum -c`
checks. `--gguf` writes a GGUF (pipeline.tools.gguf_export: llama.cpp's layout and tokenizer
metadata) and checks it by loading it back with transformers and comparing next-token logits with
the merged model on a probe batch (gguf_export.logit_error); an error beyond what the type's own
precision explains fails the export. The folder is written beside --out under a temporary name
and renamed at the end, so a failed export leaves --out as it was. Exported files are
world-readable (0644, folders 0755) like any save_pretrained output.
(This module is about shipping a finished model; the stage engine's adapter + merged/ step is
pipeline.engine.export.)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from data_formats.sources import expand_entry
from pipeline.engine.tracking import quiet_console
from pipeline.modeling.embedded import gguf_path, resolve_model_path
from pipeline.modeling.manifest import file_sha256, read_manifest
from pipeline.modeling.preflight import model_problems
from pipeline.tools.gguf_export import (
    GGUF_TYPES,
    PROBE,
    ExportError,
    gguf_logit_error,
    gguf_string,
    gguf_tokenizer_problem,
    write_gguf,
)

GGUF_NAME = "model.gguf"
CHECKSUMS = "SHA256SUMS"
MODEL_FILES = (".json", ".safetensors", ".jinja", ".txt", ".model")
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub model the embedded GGUF (pipeline.modeling.embedded) was converted from."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
NOT_HYPER = (  # config sections that are places and switches, not hyper-parameters
    "output_dir",
    "model",
    "data",
    "checkpoint",
    "tracking",
    "distributed",
    "train",
    "lora",
)

__all__ = ["ExportError", "GGUF_NAME", "GGUF_TYPES", "PROBE", "export", "model_card", "write_gguf"]


def merged_folder(source: str) -> Path:
    """The merged model folder of a run folder (its merged/) or the folder itself.

    Raises:
        ExportError: neither holds a model.
    """
    path = Path(resolve_model_path(source))  # 'embedded' names the converted embedded model
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


def data_fingerprints(config: dict) -> list[tuple[str, str]]:
    """(data file, sha256 or "hub dataset" / "not found here") of a stage's train/eval data entries."""
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
                out.append((f"{key}: {f}", file_sha256(f) if f.is_file() else "not found here"))
    return out


def hub_datasets(chain: list[dict]) -> list[str]:
    """Hub dataset ids the stages trained on (the card's `datasets:`), in stage order."""
    found = []
    for m in reversed(chain):
        for entry, what in data_fingerprints(m.get("config") or {}):
            name = entry.split(": ", 1)[1]
            if what == "hub dataset" and name not in found:
                found.append(name)
    return found


def base_model(chain: list[dict]) -> tuple[Optional[str], str]:
    """(Hub id of the base model when known, licence) from the oldest manifest of the chain: the
    embedded model's id and its GGUF's general.license, or a parent named by a Hub id."""
    base = chain[-1] if chain else {}
    if base.get("stage") == "embedded":
        return EMBEDDED_HUB_ID, gguf_license(base.get("parent_path")) or "unknown"
    parent = str(base.get("parent_path") or "")
    return (parent, "unknown") if HUB_ID.match(parent) and not Path(parent).exists() else (None, "unknown")


def gguf_license(path: Optional[str]) -> Optional[str]:
    """general.license of a GGUF file (the embedded model's own records), or None."""
    try:
        return gguf_string(Path(path) if path and Path(path).is_file() else gguf_path(), "general.license")
    except (OSError, ValueError):
        return None


def default_name(chain: list[dict], repo_id: Optional[str]) -> str:
    """The exported model's name: the Hub repo when uploading, else base model + last stage."""
    if repo_id:
        return repo_id
    hub_id, _ = base_model(chain)
    base = hub_id.split("/")[-1] if hub_id else Path(str((chain[-1] if chain else {}).get("_folder", "model"))).name
    stage = chain[0].get("stage") if chain else None
    return f"{base}-{stage}" if stage and stage not in ("embedded", "tiny-random") else base


def hyper_parameters(config: dict) -> list[str]:
    """One line per config section of a stage's hyper-parameters (pure)."""
    finetuning = (config.get("model") or {}).get("finetuning", "?")
    sections = ["train"] + (["lora"] if finetuning in ("lora", "qlora") else [])
    sections += [k for k, v in config.items() if isinstance(v, dict) and k not in NOT_HYPER]
    lines = [f"finetuning: {finetuning}"]
    for key in sections:
        values = {
            k: v for k, v in (config.get(key) or {}).items() if isinstance(v, (int, float, str, bool)) or v is None
        }
        if values:
            lines.append(f"{key}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    return lines


def _figures(summary: dict) -> str:
    parts = [
        f"{k} {v:.4f}" for k, v in summary.items() if isinstance(v, float) and k not in ("wall_seconds", "tokens_per_s")
    ]
    return ", ".join(parts) or "none recorded"


def front_matter(chain: list[dict], gguf_type: Optional[str]) -> list[str]:
    """The card's YAML front matter lines (the Hub reads them; pure but for the licence lookup)."""
    import yaml

    head = chain[0] if chain else {}
    hub_id, license_id = base_model(chain)
    reward = head.get("model_kind") == "reward"
    stages = [str(m.get("stage")) for m in reversed(chain) if m.get("adapter_path") or m.get("summary")]
    meta = {
        "library_name": "transformers",
        "license": license_id,
        "pipeline_tag": "text-classification" if reward else "text-generation",
        "tags": ["relay", *stages, *(["gguf"] if gguf_type else [])],
    }
    if hub_id:
        meta["base_model"] = hub_id
    datasets = hub_datasets(chain)
    if datasets:
        meta["datasets"] = datasets
    return ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---"]


def model_card(
    chain: list[dict],
    name: str,
    files: Sequence[str] = (),
    gguf_type: Optional[str] = None,
    prompt_example: Optional[str] = None,
) -> str:
    """README.md of the exported model from its manifest chain (pure but for the licence lookup):
    `files` are the shipped files SHA256SUMS lists, `prompt_example` a conversation rendered by
    the chat template."""
    if not chain:
        return f"# {name}\n\nNo manifest: this folder was not produced by Relay, so its history is unknown.\n"
    head, base = chain[0], chain[-1]
    hub_id, license_id = base_model(chain)
    stages = [m for m in reversed(chain) if m.get("adapter_path") or m.get("summary")]
    kind = (
        "reward model (sequence classifier, one score)"
        if head.get("model_kind") == "reward"
        else "causal language model"
    )
    lines = (
        front_matter(chain, gguf_type)
        + [
            "",
            f"# {name}",
            "",
            f"A {kind} trained with Relay: {' -> '.join(['base'] + [str(m.get('stage')) for m in stages])}.",
            "",
            "## Base model",
            "",
            "- "
            f"{f'[{hub_id}](https://huggingface.co/{hub_id})' if hub_id else '`' + Path(base['_folder']).name + '`'}"
            f"{'' if hub_id else ' (a local folder)'}"
            f" (stage `{base.get('stage')}`), licence: {license_id}",
            "",
        ]
        + (["## Stages", ""] if stages else [])
    )
    for m in stages:
        config = m.get("config") or {}
        lines += [
            f"### {m.get('stage')}",
            "",
            f"- steps: {(m.get('summary') or {}).get('steps', '?')}, created {m.get('created', '?')}",
            f"- figures: {_figures(m.get('summary') or {})}",
        ]
        lines += [f"- {line}" for line in hyper_parameters(config)]
        fingerprints = data_fingerprints(config)
        if fingerprints:
            lines.append("- data (sha256 of each file, as `sha256sum` prints it):")
            lines += [f"  - `{f}`: `{h}`" for f, h in fingerprints]
        lines.append("")
    lines += prompt_section(prompt_example) + files_section(files, gguf_type) + use_section(name, gguf_type)
    versions = head.get("versions") or {}
    lines += ["## Environment", "", ", ".join(f"{k} {v}" for k, v in versions.items()) or "unknown", ""]
    return "\n".join(lines)


def prompt_section(prompt_example: Optional[str]) -> list[str]:
    if prompt_example is None:
        return []
    return [
        "## Prompt format",
        "",
        "The chat template shipped with the tokenizer (and inside model.gguf) renders a conversation "
        "as the model was trained on it; a system and a user turn, ready for the answer:",
        "",
        "```",
        prompt_example,
        "```",
        "",
    ]


def files_section(files: Sequence[str], gguf_type: Optional[str]) -> list[str]:
    lines = ["## Files", ""]
    lines += [
        f"- `{f}`" + (f": GGUF ({gguf_type}) for llama.cpp, Ollama, LM Studio" if f == GGUF_NAME else "") for f in files
    ]
    return lines + [
        "",
        f"`{CHECKSUMS}` holds the sha256 of each of them: `sha256sum -c {CHECKSUMS}` in this folder checks them.",
        "",
    ]


def use_section(name: str, gguf_type: Optional[str]) -> list[str]:
    lines = [
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")  # the Hub id, or this folder\'s path',
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        "```",
        "",
        "Serve it with `relay serve FOLDER` (an OpenAI-compatible /v1/chat/completions, streaming included).",
        "",
    ]
    if gguf_type:
        lines += [
            "With llama.cpp: `llama-cli -m model.gguf -cnv` (the chat template is in the file). For k-quants, "
            "quantise the file with llama.cpp's own tool: `llama-quantize model.gguf model-Q4_K_M.gguf Q4_K_M`.",
            "",
        ]
    return lines


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


def export(
    source: str,
    out: str,
    gguf_type: Optional[str] = None,
    overwrite: bool = False,
    name: Optional[str] = None,
    repo_id: Optional[str] = None,
) -> Path:
    """Copy the merged model of `source` into `out` with a README.md model card and SHA256SUMS (and
    a checked GGUF when `gguf_type`); returns `out`. `name` (default: default_name) is the model's
    name in the card and the GGUF's general.name.

    Raises:
        ExportError: no model at `source`, a non-empty `out` without `overwrite`, a GGUF that
            does not reproduce the model's logits.
    """
    folder = merged_folder(source)
    chain = manifest_chain(folder)
    name = name or default_name(chain, repo_id)
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise ExportError(f"--out {target} is a file, not a folder")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ExportError(f"--out {target} is not empty (pass --overwrite to replace it)")
    made = [p for p in target.parents if not p.exists()]  # the parents this export creates
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        write_release(folder, work, chain, name, gguf_type, shown=target)
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        for parent in made:  # innermost first; one something else wrote into stays
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    return target


def write_release(
    folder: Path, target: Path, chain: list[dict], name: str, gguf_type: Optional[str], shown: Path
) -> None:
    """The model files, the checked GGUF, SHA256SUMS and README.md in the empty folder `target`
    (`shown` is where it will be, for the one line printed).

    Raises:
        ExportError: the GGUF cannot be written or does not reproduce the model's logits.
    """
    for f in folder.iterdir():
        if f.is_file() and f.suffix in MODEL_FILES:
            shutil.copyfile(f, target / f.name)  # not copy2: merged/ may be 0600, a release is for everyone
    if gguf_type is not None:
        with quiet_progress():
            licence = base_model(chain)[1]
            error = write_checked_gguf(target, gguf_type, name, None if licence == "unknown" else licence)
        print(
            f"{shown / GGUF_NAME}: next-token logits match the model's on {len(PROBE)} probe prompts "
            f"(error {error:.2g}; {gguf_type} allows {GGUF_TYPES[gguf_type].tolerance:.2g}), and its tokenizer "
            "gives the model's ids",
            file=sys.stderr,
        )
    files = sorted(f.name for f in target.iterdir() if f.is_file())
    (target / CHECKSUMS).write_text("".join(f"{file_sha256(target / f)}  {f}\n" for f in files), encoding="utf-8")
    card = model_card(chain, name, files, gguf_type, prompt_example(target))
    (target / "README.md").write_text(card, encoding="utf-8")
    world_readable(target)


def write_checked_gguf(target: Path, gguf_type: str, name: str, license_id: Optional[str] = None) -> float:
    """model.gguf in `target`, kept only if transformers reads back the model's next-token logits
    within the type's tolerance (gguf_export.logit_error) and its tokenizer splitting text as the
    folder's does (gguf_export.gguf_tokenizer_problem); returns the worst error.

    Raises:
        ExportError: the GGUF cannot be written, its logits err beyond the type's tolerance, or its
            tokenizer gives other ids.
    """
    path = write_gguf(target, target / GGUF_NAME, gguf_type, name, license_id)
    error = gguf_logit_error(target, path)
    tolerance = GGUF_TYPES[gguf_type].tolerance
    problem = (
        f"next-token logits differ from the model's (normalised squared error {error:.3g}, {gguf_type} allows "
        f"{tolerance:.2g}): its tensors are laid out wrongly"
        if error > tolerance
        else gguf_tokenizer_problem(target, path)
    )
    if problem:
        path.unlink()
        raise ExportError(f"--gguf: the GGUF's {problem}; not written")
    return error


@contextlib.contextmanager
def quiet_progress():
    """No progress bars inside (export prints its own one line): transformers' switch, and stderr
    held back for the bare tqdm its GGUF loader uses (shown after all if something fails)."""
    from transformers.utils import logging

    was_enabled, held = logging.is_progress_bar_enabled(), io.StringIO()
    logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except ExportError:
        raise
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def prompt_example(folder: Path) -> Optional[str]:
    """A short conversation rendered by the folder's chat template (None without one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def world_readable(folder: Path) -> None:
    """Files 0644 and folders 0755 under `folder`, as save_pretrained leaves them under a usual umask."""
    os.chmod(folder, 0o755)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(Path(root) / d, 0o755)
        for f in files:
            os.chmod(Path(root) / f, 0o644)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relay export",
        description="Write a shippable model folder (merged model + "
        "model card from the manifest chain), optionally a checked GGUF and a Hub upload.",
    )
    parser.add_argument("source", help="a run folder (with merged/) or a merged model folder")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument(
        "--gguf",
        nargs="?",
        const="f32",
        choices=tuple(GGUF_TYPES),
        help="also write model.gguf: f32 (default), f16, "
        "bf16 or q8_0; for k-quants run llama.cpp's llama-quantize on it",
    )
    parser.add_argument(
        "--name", help="the model's name in the card and the GGUF (default: the --push repo, else base model + stage)"
    )
    parser.add_argument("--push", metavar="REPO_ID", help="upload the folder to the Hugging Face Hub (needs a token)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)

    quiet_console()
    try:
        target = export(args.source, args.out, args.gguf, args.overwrite, args.name, args.push)
        print(f"exported {merged_folder(args.source)} -> {target} (model card: {target / 'README.md'})")
        if args.push:
            print(f"uploaded: {push(target, args.push)}")
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
