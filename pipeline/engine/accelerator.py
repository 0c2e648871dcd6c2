"""The accelerator and the optimizer every stage trains with (one place for both, so engines,
precision and accumulation behave the same in every stage)."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.config import StageConfig, TrainConfig


def resolve_precision(name: str) -> str:
    """accelerate's mixed_precision for our precision name ('auto': bf16 on a CUDA GPU with bf16,
    else 'no').

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    table = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
    if name not in table:
        raise ValueError(f"train.precision: {name!r} is not one of auto, fp32, bf16, fp16")
    return table[name]


def setup_accelerator(cfg: StageConfig):
    """An accelerate.Accelerator for cfg.distributed (ddp | deepspeed | fsdp) and cfg.train.precision.

    The accelerator knows `train.grad_accum`: every stage runs its micro-batches through
    `pipeline.engine.steps.micro_step` (accelerate's `accumulate`), so gradients are reduced and
    the optimizer (DeepSpeed's engine included) steps once per optimizer step.

    Raises:
        ValueError: unknown engine, or deepspeed without a config file.
    """
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    mixed = resolve_precision(cfg.train.precision)
    engine = cfg.distributed.engine
    # Without a GPU, accelerate only sets up multi-process CPU training (gloo) when told cpu=True.
    kwargs: dict[str, Any] = {"mixed_precision": mixed, "step_scheduler_with_optimizer": False,
                              "cpu": not torch.cuda.is_available()}
    if engine != "deepspeed":  # DeepSpeed takes the count from its plugin
        kwargs["gradient_accumulation_steps"] = cfg.train.grad_accum
    if engine == "deepspeed":
        if not torch.cuda.is_available():
            # Measured with accelerate 1.15 / deepspeed 0.19: with cpu=True accelerate drops the
            # DeepSpeed plugin silently (plain gloo DDP); with cpu=False it starts DeepSpeed but
            # reports one process per rank, so every rank would train on the same batches.
            raise ValueError("distributed.engine deepspeed needs a GPU (accelerate cannot run DeepSpeed on CPU); use ddp or fsdp")
        if not cfg.distributed.deepspeed_config:
            raise ValueError("distributed.deepspeed_config: required when distributed.engine is deepspeed")
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            hf_ds_config=cfg.distributed.deepspeed_config,
            gradient_accumulation_steps=cfg.train.grad_accum,
            gradient_clipping=cfg.train.max_grad_norm or None,
        )
    elif engine == "fsdp":
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            sharding_strategy=cfg.distributed.fsdp_sharding,
            use_orig_params=True,
            # Broadcasting rank 0's weights needs a GPU in accelerate; every rank loads the same
            # files and seeds LoRA's init identically, so CPU runs start identical without it.
            sync_module_states=torch.cuda.is_available(),
            state_dict_type="FULL_STATE_DICT",
        )
    elif engine != "ddp":
        raise ValueError(f"distributed.engine: {engine!r} is not one of ddp, deepspeed, fsdp")
    accelerator = Accelerator(**kwargs)
    if engine == "deepspeed":
        # accelerate fills the "auto" batch size from a DataLoader; we batch ourselves (exact resume).
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
        ds["gradient_accumulation_steps"] = cfg.train.grad_accum
        ds["train_batch_size"] = cfg.train.batch_size * cfg.train.grad_accum * accelerator.num_processes
    return accelerator


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no weight decay on 1-d parameters (norms, biases).

    Raises:
        ValueError: the model has no trainable parameter.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters (check model.finetuning / lora.target_modules)")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.epsilon
    )
