"""Exporting a trained stage: the adapter (LoRA/QLoRA) and merged/ with its manifest, or the full
model (full fine-tuning, gathered from the shards under FSDP / ZeRO-3). The trained model, optimizer
and scheduler are released before the merge loads the base again, so a stage's peak memory is
not the training copies plus the merge's."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from pipeline.config import to_dict
from pipeline.engine.accelerator import is_partitioned, settle_zero3, without_zero3_init, zero3_state
from pipeline.engine.fsdp import full_state, is_sharded
from pipeline.modeling.merge import export_full_model, merge_adapter
from pipeline.modeling.models import load_model


def export_trained(stage, extras: dict) -> Optional[Path]:
    """Save `stage`'s trained weights (`stage.export_module()`, and `stage.export_adapters()`
    beside the adapter) and merged/ (every rank calls this; rank 0 returns merged/, the others
    None). `stage.model`, `.optimizer`, `.scheduler` are None afterwards.

    Raises:
        MergeError / FileExistsError: from pipeline.modeling.merge.
    """
    acc, cfg = stage.accelerator, stage.cfg
    out = Path(cfg.output_dir)
    full = cfg.model.finetuning == "full"
    trained = stage.export_module()
    common = dict(
        stage=stage.name,
        config=to_dict(cfg),
        extra_manifest=extras,
        chat_template=stage.chat_template,
        overwrite=True,
        trust_remote_code=cfg.model.trust_remote_code,
    )
    if is_sharded(stage.model):
        return _export_sharded(stage, trained, out, full, common, full_state)
    if is_partitioned(trained):
        # ZeRO-3 partitions on one rank too: a module saved as it is would hold empty tensors.
        settle_zero3(stage.model)
        return _export_sharded(
            stage, trained, out, full, common, lambda module: zero3_state(module, trainable_only=not full)
        )
    merged = None
    if acc.is_main_process and full:
        merged = export_full_model(trained, stage.tokenizer, str(out / "merged"), parent=stage.model_path, **common)
    elif acc.is_main_process:
        trained.save_pretrained(out / "adapter", safe_serialization=True)
        save_tokenizer(stage, out / "adapter")
        for folder, adapter in stage.export_adapters().items():
            adapter.save_pretrained(out / folder)
    return _merge(stage, out, full, merged, common)


def save_tokenizer(stage, folder: Path) -> None:
    """The stage's tokenizer beside its adapter, with the chat template the run trained on
    (`stage.chat_template`: role markers, a tool layout), as merged/ gets it: `relay merge` reads
    the adapter folder's, and the base's template would render prompts another way."""
    tokenizer, own = stage.tokenizer, stage.tokenizer.chat_template
    if stage.chat_template is not None:
        tokenizer.chat_template = stage.chat_template
    try:
        tokenizer.save_pretrained(folder)
    finally:
        tokenizer.chat_template = own


def _export_sharded(stage, trained, out: Path, full: bool, common: dict, gather: Callable) -> Optional[Path]:
    """Under FSDP or ZeRO-3: gather the trained module's whole state (`gather`; every rank takes
    part; FSDP2's `state_dict()` always yields shards and ZeRO-3's parameters are empty, so
    `save_pretrained` cannot read the module itself), then on rank 0 load it into a fresh copy
    (full fine-tuning) or save the adapters from it (ZeRO-3 gathers the trainable tensors only,
    the ones an adapter holds)."""
    acc, cfg = stage.accelerator, stage.cfg
    state = gather(trained)
    adapters = {folder: gather(adapter) for folder, adapter in stage.export_adapters().items()} if not full else {}
    merged = None
    if acc.is_main_process and full:
        with without_zero3_init(acc):  # the fresh copy loads, and the export reloads it, on rank 0 alone
            fresh = load_model(cfg.model, None, kind=stage.model_kind, tokenizer=stage.tokenizer)
            fresh.load_state_dict(state)
            merged = export_full_model(fresh, stage.tokenizer, str(out / "merged"), parent=stage.model_path, **common)
    elif acc.is_main_process:
        trained.save_pretrained(out / "adapter", safe_serialization=True, state_dict=state)
        save_tokenizer(stage, out / "adapter")
        for folder, adapter in stage.export_adapters().items():
            adapter.save_pretrained(out / folder, state_dict=adapters[folder])
    return _merge(stage, out, full, merged, common)


def _merge(stage, out: Path, full: bool, merged: Optional[Path], common: dict) -> Optional[Path]:
    """Release the training copies, then (LoRA) merge the saved adapter into the base on rank 0."""
    acc, cfg = stage.accelerator, stage.cfg
    stage.release()
    stage.model, stage.optimizer, stage.scheduler = acc.free_memory(stage.model, stage.optimizer, stage.scheduler)
    if acc.is_main_process and not full:
        with without_zero3_init(acc):  # the base loads on rank 0 alone
            merged = merge_adapter(
                stage.model_path,
                str(out / "adapter"),
                str(out / "merged"),
                kind=stage.model_kind,
                allow_pickle=cfg.model.allow_pickle,
                tokenizer=stage.tokenizer,
                **common,
            )
    acc.wait_for_everyone()
    return merged
