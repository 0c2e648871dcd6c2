"""Merge a LoRA adapter into its base and write a self-describing full model folder.

    python -m pipeline.modeling.merge --base DIR --adapter DIR --out DIR [--kind causal|reward] [--overwrite]

The merged folder is what the next stage loads: safetensors weights, tokenizer, chat template,
generation config and manifest.json. The merge is computed in fp32 and saved in the dtype the
base's safetensors hold (a bf16 base gives a bf16 merged model, as full fine-tuning saves its own
dtype). The merge checks its own output: merged must give base+adapter's logits within 1e-3 (fp32,
on a probe batch), and the saved folder, reloaded with the plain Auto class, must load with no
missing or unexpected keys and give those logits again (saved in fp32), or hold exactly the merged
weights rounded to the saved dtype (bf16, fp16). It is written into a staging folder beside `out`
and renamed into place, so a crash never leaves a half-written model that looks complete; an `out`
that is, or holds, the base or the adapter is refused before anything is deleted.

`relay merge` (main) also refuses an adapter whose own records name other base weights than
`--base` holds (pipeline/modeling/adapter_checks.py).

Custom code and pickles: the base and the merged folder load with the run's `trust_remote_code`
(a model whose class lives in its folder, `auto_map`, is merged and checked as that class, and
its code files are saved with it); a base with only pickled weights loads only with `allow_pickle`
(torch.load(weights_only=True)). The merged folder itself is always safetensors.

QLoRA adapters: the base is always loaded in full precision (fp32) here, so merging a QLoRA
adapter dequantises the base first. The merged weights are therefore W + BA with the *original*
W, while training saw nf4(W) + BA; the two differ by the 4-bit quantisation error of W (small but
not zero; tests/test_qlora.py measures it on a tiny model). Merging into the 4-bit weights
instead would bake that rounding error into a full-precision model for no gain. The merge check
compares with the full-precision base + adapter, so it does not measure that difference.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from pipeline.modeling.adapter_checks import adapter_base_problem
from pipeline.modeling.embedded import resolve_model_path
from pipeline.modeling.manifest import write_manifest
from pipeline.modeling.models import ensure_pad_token, warn_ignored_code

log = logging.getLogger(__name__)

TOLERANCE = 1e-3
TASK_TYPES = {"causal": "CAUSAL_LM", "reward": "SEQ_CLS"}
PROBE_TEXTS = (
    "Relay merge probe: the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
)


class MergeError(RuntimeError):
    """The merged model does not reproduce base+adapter, or it does not reload cleanly."""


def _auto_class(kind: str):
    if kind == "causal":
        return AutoModelForCausalLM
    if kind == "reward":
        return AutoModelForSequenceClassification
    raise ValueError(f"kind {kind!r} is not one of 'causal', 'reward'")


def _load_plain(path: str | Path, kind: str, trust_remote_code: bool = False, allow_pickle: bool = False):
    """Load a full model in fp32 with the plain Auto class; return (model, loading_info).
    `allow_pickle`: a folder without safetensors loads its pickled weights (weights_only=True)."""
    warn_ignored_code(path, trust_remote_code)
    extra = {"num_labels": 1} if kind == "reward" else {}
    model, info = _auto_class(kind).from_pretrained(
        path,
        dtype=torch.float32,
        use_safetensors=None if allow_pickle else True,
        weights_only=True,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
        **extra,
    )
    return model.eval(), info


def check_out_dir(out: str | Path, overwrite: bool, keep: Optional[dict[str, str | Path]] = None) -> Path:
    """Return `out` as a Path, refusing a non-empty folder unless `overwrite`, and a folder that is or
    holds one of `keep` ({what: path} the writing reads, e.g. the base and the adapter), which
    replacing `out` would delete.

    Raises:
        FileExistsError: `out` is a non-empty folder and overwrite is False, or a file.
        ValueError: `out` is, or is a folder above, one of `keep`'s paths.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder")
    where = out.resolve()
    for what, path in (keep or {}).items():
        if Path(path).exists() and (where == Path(path).resolve() or where in Path(path).resolve().parents):
            raise ValueError(
                f"{out}: is or holds the {what} {path}, which writing the merged model there would delete; "
                "choose another output folder"
            )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: folder is not empty; pass overwrite=True (--overwrite) to replace it")
    return out


def probe_batch(tokenizer) -> dict[str, torch.Tensor]:
    """A fixed two-row batch (right-padded) the merge checks its output on."""
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; load it with pipeline.modeling.models.load_tokenizer")
    return dict(tokenizer(list(PROBE_TEXTS), return_tensors="pt", padding=True))


@torch.no_grad()
def model_outputs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits (causal) or scores (reward), with padded positions zeroed so they do not count."""
    logits = model(**batch).logits
    if logits.dim() == 3:
        logits = logits * batch["attention_mask"].unsqueeze(-1)
    return logits.float()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _check_reload(
    folder: Path, kind: str, batch: dict, expected: torch.Tensor, trust_remote_code: bool = False
) -> float:
    """Reload `folder` with the plain Auto class; return the max logit difference from `expected`.

    Raises:
        MergeError: missing/unexpected keys, or logits further than TOLERANCE from `expected`.
    """
    model, info = _load_plain(folder, kind, trust_remote_code)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise MergeError(f"{folder}: the saved model does not load cleanly: {bad}")
    diff = max_abs_diff(model_outputs(model, batch), expected)
    if diff > TOLERANCE:
        raise MergeError(
            f"{folder}: reloaded model's outputs differ from the expected ones by {diff:.3g} > {TOLERANCE}"
        )
    return diff


def stored_dtype(folder: str | Path) -> torch.dtype:
    """The floating dtype most of a folder's safetensors weights are stored in (read from their
    headers); fp32 when it has none (a hub id, pickled weights) or another dtype than fp32/bf16/fp16."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for file in sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []:
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                piece = fh.get_slice(key)
                counts[piece.get_dtype()] = counts.get(piece.get_dtype(), 0) + math.prod(piece.get_shape())
    floating = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    found = {name: n for name, n in counts.items() if name in floating}
    return floating[max(found, key=found.__getitem__)] if found else torch.float32


@torch.no_grad()
def _check_reload_weights(
    folder: Path, kind: str, model, trust_remote_code: bool = False, batch=None, expected=None
) -> float:
    """Reload `folder` in fp32; every tensor must equal `model`'s (upcast to fp32). Return the
    reloaded outputs' max abs difference from `expected` on `batch` when given, else 0.0.

    Raises:
        MergeError: missing/unexpected keys, or any tensor that differs.
    """
    reloaded, info = _load_plain(folder, kind, trust_remote_code)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise MergeError(f"{folder}: the saved model does not load cleanly: {bad}")
    saved, original = reloaded.state_dict(), model.state_dict()
    if set(saved) != set(original):
        raise MergeError(f"{folder}: saved tensors {sorted(set(saved) ^ set(original))[:8]} differ from the model's")
    changed = [k for k in original if not torch.equal(saved[k], original[k].float().cpu())]
    if changed:
        raise MergeError(f"{folder}: saved tensors differ from the model's: {changed[:8]}")
    return 0.0 if batch is None else max_abs_diff(model_outputs(reloaded, batch), expected)


def _check_task_type(adapter: str, kind: str) -> None:
    """Raises MergeError when the adapter was trained for the other kind of model (peft would
    otherwise fail deep inside with an AttributeError)."""
    from peft import PeftConfig

    task_type = PeftConfig.from_pretrained(adapter).task_type
    expected = TASK_TYPES[kind]
    if task_type is not None and str(task_type) != expected:
        other = (
            next(k for k, v in TASK_TYPES.items() if v == str(task_type))
            if str(task_type) in TASK_TYPES.values()
            else None
        )
        hint = f"; merge it with kind={other!r} (--kind {other})" if other else ""
        raise MergeError(f"{adapter}: adapter task_type is {task_type}, but kind={kind!r} needs {expected}{hint}")


def _check_head_saved(base_info: dict, peft_model, adapter: str) -> None:
    """Raises MergeError when the base had no reward head (a causal LM loaded as a classifier, so
    its head is random) and the adapter does not carry a trained one in modules_to_save."""
    fresh = {k.split(".")[0] for k in base_info.get("missing_keys", [])}
    if not fresh:
        return
    saved = set(peft_model.peft_config[peft_model.active_adapter].modules_to_save or [])
    if fresh - saved:
        raise MergeError(
            f"{adapter}: the base has no weights for {sorted(fresh - saved)} and the adapter does not save them "
            "(modules_to_save), so the merged head would be random"
        )


def _check_tied(model) -> None:
    """Raises MergeError when a model configured with tied embeddings no longer shares them."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    output = model.get_output_embeddings()
    if output is None:
        return
    if output.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise MergeError("tie_word_embeddings is set but the merged input and output embeddings are separate tensors")


def _write_folder(model, tokenizer, staging: Path, chat_template: Optional[str]) -> None:
    """Save weights (safetensors), tokenizer with its chat template, and generation config.

    A stock transformers class loaded from a folder whose custom code was not trusted keeps that
    folder's `auto_map` in its config; it is left out of the saved config.json, which must not
    point at code the saved folder does not hold (and that did not produce these weights)."""
    auto_map = getattr(model.config, "auto_map", None)
    stock = type(model).__module__.startswith("transformers.")
    if auto_map and stock:
        del model.config.auto_map
    try:
        model.save_pretrained(staging, safe_serialization=True)
    finally:
        if auto_map and stock:
            model.config.auto_map = auto_map
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(staging)
    generation = getattr(model, "generation_config", None)
    if generation is not None and not (staging / "generation_config.json").is_file():
        generation.save_pretrained(staging)


def _publish(staging: Path, out: Path) -> Path:
    """Move the finished staging folder to `out`, replacing what is there."""
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out


def _staging_dir(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}-staging-", dir=out.parent))


def _load_tokenizer_for_merge(base: str, adapter: str, trust_remote_code: bool = False):
    """The adapter folder's tokenizer when the stage saved one there (it may have added a pad
    token), else the base's; a pad token is ensured either way."""
    source = adapter if (Path(adapter) / "tokenizer_config.json").is_file() else base
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    ensure_pad_token(tokenizer)
    return tokenizer


def merge_adapter(
    base: str,
    adapter: str,
    out: str,
    *,
    kind: str = "causal",
    stage: str = "merge",
    config: Optional[dict] = None,
    extra_manifest: Optional[dict] = None,
    chat_template: Optional[str] = None,
    overwrite: bool = False,
    verify: bool = True,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    tokenizer=None,
) -> Path:
    """Merge the LoRA adapter in `adapter` into `base`; write the full model to `out`; return `out`.
    `tokenizer`: the adapter's (a stage passes the one it saved beside it); None: read the adapter
    folder's, else the base's.

    The base loads in fp32 (a QLoRA adapter's 4-bit base is thus dequantised first, see the module
    docstring) and the merge is computed there, then saved in the dtype of the base's weights
    (stored_dtype). `chat_template`, when given, becomes the merged tokenizer's template. With
    `verify`, the written folder is reloaded: saved in fp32 its logits must match base+adapter's
    within 1e-3; saved in bf16/fp16 its weights must be the merged ones rounded to that dtype.
    Pass the run's `trust_remote_code` and `allow_pickle` (model section): the base and the reload
    honour them.

    Raises:
        FileExistsError: `out` is non-empty and overwrite is False.
        ValueError: unknown kind, or `out` is or holds the base or the adapter.
        MergeError: the adapter was trained for the other kind, the merge does not reproduce
            base+adapter, embeddings came untied, the saved folder does not reload cleanly, or a
            reward head exists in neither base nor adapter.
    """
    from peft import PeftModel

    base = resolve_model_path(base)
    out_path = check_out_dir(out, overwrite, keep={"base model": base, "adapter": adapter})
    _check_task_type(adapter, kind)
    if tokenizer is None:
        tokenizer = _load_tokenizer_for_merge(base, adapter, trust_remote_code)
    model, info = _load_plain(base, kind, trust_remote_code, allow_pickle)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    peft_model = PeftModel.from_pretrained(model, adapter, is_trainable=False).eval()
    _check_head_saved(info, peft_model, adapter)
    batch = probe_batch(tokenizer)
    expected = model_outputs(peft_model, batch)
    merged = peft_model.merge_and_unload().eval()
    _check_tied(merged)
    merge_diff = max_abs_diff(model_outputs(merged, batch), expected)
    if merge_diff > TOLERANCE:
        raise MergeError(f"merging {adapter} into {base}: outputs moved by {merge_diff:.3g} > {TOLERANCE}")
    dtype = stored_dtype(base)
    merged = merged.to(dtype)
    staging = _staging_dir(out_path)
    try:
        _write_folder(merged, tokenizer, staging, chat_template)
        reload_diff = None
        if verify and dtype == torch.float32:
            reload_diff = _check_reload(staging, kind, batch, expected, trust_remote_code)
        elif verify:
            reload_diff = _check_reload_weights(staging, kind, merged, trust_remote_code, batch, expected)
        extras = {
            "model_kind": kind,
            "merge_check": {
                "merge_max_abs_diff": merge_diff,
                "reload_max_abs_diff": reload_diff,
                "tolerance": TOLERANCE,
                "dtype": str(dtype).removeprefix("torch."),
            },
        }
        write_manifest(
            staging,
            stage=stage,
            parent=base,
            config=config,
            adapter=adapter,
            extra={**extras, **(extra_manifest or {})},
        )
        result = _publish(staging, out_path)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    log.info("merged %s + %s -> %s (max |diff| %.2e)", base, adapter, result, merge_diff)
    return result


def export_full_model(
    model,
    tokenizer,
    out: str,
    *,
    parent: str,
    stage: str,
    config: Optional[dict] = None,
    extra_manifest: Optional[dict] = None,
    chat_template: Optional[str] = None,
    overwrite: bool = False,
    verify: bool = True,
    trust_remote_code: bool = False,
) -> Path:
    """Write a fully fine-tuned model like a merged one (weights, tokenizer, template, manifest).

    `model` is the trained transformers model (unwrap accelerate/DDP first); it is saved in its own
    dtype and left unchanged. With `verify`, the folder is reloaded (with `trust_remote_code`: a
    custom class reloads as itself) and every tensor must equal `model`'s exactly (a weight
    comparison, so it holds for bf16 models too).

    Raises:
        FileExistsError: `out` is non-empty and overwrite is False.
        ValueError: `model` is a PeftModel (merge its adapter with merge_adapter instead), its
            class is neither a causal LM nor a sequence classifier, or `out` is or holds `parent`.
        MergeError: the saved folder does not reload cleanly or reproduce `model`.
    """
    from peft import PeftModel

    if isinstance(model, PeftModel):
        raise ValueError("export_full_model got a PeftModel; save its adapter and use merge_adapter")
    kind = "reward" if type(model).__name__.endswith("ForSequenceClassification") else "causal"
    if kind == "causal" and not type(model).__name__.endswith("ForCausalLM"):
        raise ValueError(f"export_full_model: {type(model).__name__} is neither a causal LM nor a sequence classifier")
    out_path = check_out_dir(out, overwrite, keep={"parent model": parent})
    staging = _staging_dir(out_path)
    try:
        _write_folder(model, tokenizer, staging, chat_template)
        reload_diff = _check_reload_weights(staging, kind, model, trust_remote_code) if verify else None
        extras = {"model_kind": kind, "merge_check": {"reload_max_abs_diff": reload_diff, "tolerance": TOLERANCE}}
        write_manifest(
            staging, stage=stage, parent=parent, config=config, adapter=None, extra={**extras, **(extra_manifest or {})}
        )
        result = _publish(staging, out_path)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="relay merge", description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="base model folder (or 'embedded')")
    parser.add_argument("--adapter", required=True, help="LoRA adapter folder (adapter_config.json)")
    parser.add_argument("--out", required=True, help="where the merged model goes")
    parser.add_argument("--kind", choices=("causal", "reward"), default="causal")
    parser.add_argument("--stage", default="merge", help="stage name recorded in manifest.json")
    parser.add_argument("--chat-template", default=None, help="Jinja file saved as the merged chat template")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    parser.add_argument("--no-verify", action="store_true", help="skip reloading the saved folder")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run the base folder's own model code (auto_map)"
    )
    parser.add_argument(
        "--allow-pickle", action="store_true", help="load a base that has only pickled weights (weights_only=True)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    problem = adapter_base_problem(args.base, args.adapter)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        out = merge_adapter(
            args.base,
            args.adapter,
            args.out,
            kind=args.kind,
            stage=args.stage,
            chat_template=template,
            overwrite=args.overwrite,
            verify=not args.no_verify,
            config=vars(args),
            trust_remote_code=args.trust_remote_code,
            allow_pickle=args.allow_pickle,
        )
    except (FileExistsError, MergeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
