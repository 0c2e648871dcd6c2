"""Exporting a trained stage: the adapter (LoRA/QLoRA) and merged/ with its manifest, or the full
model (full fine-tuning, gathered from the shards under FSDP/ZeRO). The trained model, optimizer
and scheduler are released before the merge loads the base again, so a stage's peak memory is
not the training copies plus the merge's."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from pipeline.config import to_dict
from pipeline.engine.accelerator import full_parameters
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
    whole = trained is acc.unwrap_model(stage.model)
    if whole and full and acc.num_processes > 1 and acc.distributed_type.name in ("FSDP", "DEEPSPEED"):
        # Sharded weights: gather the full state (every rank takes part) into a fresh copy on rank 0.
        state = acc.get_state_dict(stage.model)
        if acc.is_main_process:
            trained = load_model(cfg.model, None, kind=stage.model_kind, tokenizer=stage.tokenizer)
            trained.load_state_dict(state)
    common = dict(stage=stage.name, config=to_dict(cfg), extra_manifest=extras, chat_template=stage.chat_template, overwrite=True,
                  trust_remote_code=cfg.model.trust_remote_code)
    merged = None
    # A part of the prepared module (PPO's policy) is saved from the unwrapped module, whose
    # weights under FSDP are shards outside the wrapped forward: make them whole (every rank).
    with contextlib.nullcontext() if whole else full_parameters(acc, stage.model):
        if acc.is_main_process and full:
            merged = export_full_model(trained, stage.tokenizer, str(out / "merged"), parent=stage.model_path, **common)
        elif acc.is_main_process:
            trained.save_pretrained(out / "adapter", safe_serialization=True)
            stage.tokenizer.save_pretrained(out / "adapter")
            for folder, adapter in stage.export_adapters().items():
                adapter.save_pretrained(out / folder)
    trained = None
    stage.release()
    stage.model, stage.optimizer, stage.scheduler = acc.free_memory(stage.model, stage.optimizer, stage.scheduler)
    if acc.is_main_process and not full:
        merged = merge_adapter(stage.model_path, str(out / "adapter"), str(out / "merged"), kind=stage.model_kind,
                               allow_pickle=cfg.model.allow_pickle, **common)
    acc.wait_for_everyone()
    return merged
