"""`relay export`: turn a run's merged model into a folder you can ship.

    relay export outputs/demo/ppo --out release/                 # merged model + README.md model card
    relay export outputs/demo/ppo --out release/ --gguf          # + model.gguf (f32; or f16, bf16, q8_0)
    relay export outputs/demo/ppo --out release/ --push me/my-model   # + upload (needs an HF token)

The folder holds the model files, a SHA256SUMS file that `sha256sum -c` checks, and the model card
that pipeline.tools.model_card writes from the manifest chain (the base model, every stage with its
hyper-parameters and data, the prompt format, how to load it). The model's own code files
(auto_map) are copied, never run. An --out that is the source, inside it or above it is refused
before anything is written or deleted. `--gguf` writes a GGUF (pipeline.tools.gguf_export:
llama.cpp's layout and tokenizer metadata) and checks it by loading it back with transformers and
comparing next-token logits with the merged model on a probe batch (gguf_check.logit_error); an
error beyond what the type's own precision explains fails the export. The folder is written beside
--out under a temporary name and renamed at the end, so a failed export leaves --out as it was. Exported files are
world-readable (0644, folders 0755) like any save_pretrained output.
(This module is about shipping a finished model; the stage engine's adapter + merged/ step is
pipeline.engine.export.)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from pipeline.engine.tracking import quiet_console
from pipeline.modeling.embedded import resolve_model_path
from pipeline.modeling.manifest import file_sha256
from pipeline.modeling.preflight import model_kind_of, model_problems
from pipeline.tools.gguf_check import LOGIT_PROBES, PROBE, gguf_logit_error, gguf_tokenizer_problem
from pipeline.tools.gguf_export import GGUF_TYPES, ExportError, logit_problem, write_gguf
from pipeline.tools.model_card import (
    CHECKSUMS,
    GGUF_NAME,
    base_model,
    data_notes,
    default_name,
    manifest_chain,
    model_card,
    prompt_example,
    stage_data,
    trained,
)

MODEL_FILES = (".json", ".safetensors", ".jinja", ".txt", ".model")

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
        ExportError: no model at `source`, `out` overlapping it, a non-empty `out` without
            `overwrite`, a `.py` file the model's auto_map names missing, a GGUF of a reward model
            or one that does not reproduce the model's logits.
    """
    folder = merged_folder(source)
    target = Path(out)
    overlap = overlap_problem(Path(resolve_model_path(source)), target)
    if overlap:
        raise ExportError(overlap)
    if gguf_type is not None and model_kind_of(folder) == "reward":
        raise ExportError(
            f"--gguf: {folder} is a reward model (a sequence classifier); a GGUF holds a causal language model "
            "for llama.cpp to generate with, so export it without --gguf"
        )
    code = code_files(folder)  # a missing one is refused before anything is written
    chain = manifest_chain(folder)
    name = name or default_name(chain, repo_id)
    if target.exists() and not target.is_dir():
        raise ExportError(f"--out {target} is a file, not a folder")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ExportError(f"--out {target} is not empty (pass --overwrite to replace it)")
    made = [p for p in target.parents if not p.exists()]  # the parents this export creates
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        write_release(folder, work, chain, name, gguf_type, shown=target, code=code)
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


def overlap_problem(source: Path, target: Path) -> Optional[str]:
    """The line refusing an --out that is the source folder, inside it or above it (replacing it
    would delete the source, or write into it), paths compared resolved; else None."""
    src, out = source.resolve(), target.resolve()
    if out == src:
        where = "is the source folder"
    elif src in out.parents:
        where = f"is inside the source folder {source}"
    elif out in src.parents:
        where = f"holds the source folder {source}"
    else:
        return None
    return f"--out {target} {where}; give a folder outside it (nothing was written or deleted)"


def code_files(folder: Path) -> list[Path]:
    """The model's own `.py` files: the modules config.json's and tokenizer_config.json's `auto_map`
    name, with the modules they import relatively (found as transformers finds them,
    dynamic_module_utils.get_relative_imports: read, never run). A class from another Hub repo
    (`repo--module.Class`) is not in the folder and is not listed.

    Raises:
        ExportError: a named module's file is not in the folder (the copy could not load).
    """
    from transformers.dynamic_module_utils import get_relative_imports

    modules: list[str] = []
    for config in ("config.json", "tokenizer_config.json"):
        try:
            auto_map = json.loads((folder / config).read_text(encoding="utf-8")).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        for value in auto_map.values():
            for ref in value if isinstance(value, list) else [value]:
                if isinstance(ref, str) and "--" not in ref and "." in ref:
                    modules.append(ref.rsplit(".", 1)[0])
    found: list[Path] = []
    while modules:
        module = modules.pop()
        path = folder / f"{module.replace('.', '/')}.py"
        if path in found:
            continue
        if not path.is_file():
            raise ExportError(f"{folder}: its auto_map needs {path.relative_to(folder)}, which it does not hold")
        found.append(path)
        modules += get_relative_imports(path)
    return sorted(found)


def write_release(
    folder: Path,
    target: Path,
    chain: list[dict],
    name: str,
    gguf_type: Optional[str],
    shown: Path,
    code: Sequence[Path] = (),
) -> None:
    """The model files, the model's own code files (`code`, see code_files), the checked GGUF,
    SHA256SUMS and README.md in the empty folder `target` (`shown` is where it will be, for the
    lines printed).

    Raises:
        ExportError: the GGUF cannot be written or does not reproduce the model's logits.
    """
    for f in [f for f in folder.iterdir() if f.is_file() and f.suffix in MODEL_FILES] + list(code):
        copied = target / f.relative_to(folder)
        copied.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, copied)  # not copy2: merged/ may be 0600, a release is for everyone
    if gguf_type is not None:
        with quiet_progress():
            licence = base_model(chain)[1]
            error = write_checked_gguf(target, gguf_type, name, None if licence == "unknown" else licence)
        print(
            f"{shown / GGUF_NAME}: next-token logits match the model's on {len(LOGIT_PROBES)} probe prompts "
            f"(error {error:.2g}; {gguf_type} allows {GGUF_TYPES[gguf_type].tolerance:.2g}), and its tokenizer "
            "gives the model's ids",
            file=sys.stderr,
        )
    files = sorted(str(f.relative_to(target)) for f in target.rglob("*") if f.is_file())
    (target / CHECKSUMS).write_text("".join(f"{file_sha256(target / f)}  {f}\n" for f in files), encoding="utf-8")
    data = [stage_data(m) for m in reversed(chain) if trained(m)]
    for line in data_notes(chain, data):
        print(line, file=sys.stderr)
    card = model_card(chain, name, files, gguf_type, prompt_example(target), data, own_code=bool(code))
    (target / "README.md").write_text(card, encoding="utf-8")
    world_readable(target)


def write_checked_gguf(target: Path, gguf_type: str, name: str, license_id: Optional[str] = None) -> float:
    """model.gguf in `target`, kept only if transformers reads back the model's next-token logits
    within the type's tolerance (gguf_check.logit_error) and its tokenizer splitting text as the
    folder's does (gguf_check.gguf_tokenizer_problem); returns the worst error.

    Raises:
        ExportError: the GGUF cannot be written, its logits err beyond the type's tolerance, or its
            tokenizer gives other ids.
    """
    path = write_gguf(target, target / GGUF_NAME, gguf_type, name, license_id)
    error = gguf_logit_error(target, path)
    problem = logit_problem(error, gguf_type) or gguf_tokenizer_problem(target, path)
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
