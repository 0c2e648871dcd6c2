"""The accelerator and the optimizer every stage trains with (one place for both, so engines,
precision and accumulation behave the same in every stage)."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Any

import torch

from pipeline.config import StageConfig, TrainConfig
from pipeline.engine import fsdp
from pipeline.engine.checkpoint import newest_identity
from pipeline.engine.fsdp import SHARDING


def resolve_precision(name: str) -> str:
    """accelerate's mixed_precision for our precision name ('auto': bf16 on a CUDA GPU with bf16,
    else 'no').

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    table = {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16"}
    if name not in table:
        raise ValueError(f"train.precision: {name!r} is not one of auto, {', '.join(table)}")
    return table[name]


def combination_problems(cfg: StageConfig) -> list[str]:
    """Engine / finetuning / hardware combinations Relay cannot run, each one line naming the
    combination and the one that works; checked with the other config problems, before any model
    loads (accelerate would otherwise fall back silently or fail mid-run).

    Pure apart from asking torch whether CUDA is visible, whether `deepspeed` / `flash_attn` are
    installed and whether output_dir holds a checkpoint to resume.
    """
    engine = cfg.distributed.engine
    cuda = torch.cuda.is_available()
    out = []
    if engine == "deepspeed" and not cuda:
        # Measured with accelerate 1.15 / deepspeed 0.19: with cpu=True accelerate drops the
        # DeepSpeed plugin silently (plain gloo DDP); with cpu=False it starts DeepSpeed but
        # reports one process per rank, so every rank would train on the same batches.
        out.append("distributed.engine: deepspeed needs a CUDA GPU (none is visible; accelerate cannot run DeepSpeed on CPU); "
                   "on CPU use distributed.engine ddp")
    elif engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        out.append("distributed.engine: deepspeed needs the deepspeed package (pip install deepspeed); or use ddp or fsdp")
    if engine == "deepspeed" and _would_resume(cfg):
        # ZeRO partitions the optimizer state (and under ZeRO-3 the weights) over ranks; the
        # checkpoint holds rank 0's optimizer share only, so a resume would be silently wrong.
        out.append("checkpoint.resume: resuming a distributed.engine deepspeed run is not supported (ZeRO shards the optimizer "
                   "state over ranks; the checkpoint holds rank 0's share); set checkpoint.resume false to start again, "
                   "or train with distributed.engine ddp or fsdp, which resume exactly")
    from pipeline.modeling.models import check_attn_implementation

    try:
        check_attn_implementation(cfg.model.attn_implementation)
    except ValueError as err:  # flash_attention_2 without CUDA or without flash-attn
        out.append(f"model.attn_implementation: {err}")
    if engine == "fsdp" and cfg.distributed.fsdp_sharding not in SHARDING:
        out.append(f"distributed.fsdp_sharding: {cfg.distributed.fsdp_sharding} has no FSDP2 counterpart (FSDP2 always "
                   f"shards); use {' or '.join(SHARDING)}, or distributed.engine ddp for unsharded data parallelism")
    if engine == "fsdp" and cfg.model.finetuning == "qlora":
        # bitsandbytes' 4-bit weights are not tensors FSDP2 can cut into DTensor shards.
        out.append("distributed.engine: fsdp cannot shard QLoRA's 4-bit weights; use distributed.engine ddp, "
                   "or model.finetuning lora or full")
    return out


def _would_resume(cfg: StageConfig) -> bool:
    return newest_identity(Path(cfg.output_dir) / "checkpoints", cfg.checkpoint) is not None


def is_fsdp(model) -> bool:
    """Whether the prepared model is sharded by FSDP2 (pipeline.engine.fsdp)."""
    return fsdp.is_sharded(model)


def is_zero3(accelerator) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the parameters over ranks."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin is not None and accelerator.num_processes > 1 and plugin.zero_stage == 3


@contextlib.contextmanager
def full_parameters(accelerator, model: torch.nn.Module):
    """Make the parameters of `model` (the prepared model or a module inside it) whole for the
    body (FSDP; a no-op otherwise).

    Under FSDP every rank holds only its shards outside a unit's forward, and forwards gather
    block by block (collectives every rank must run in step). PPO's and GRPO's sampling, scoring,
    eval and export run inside it: weights gathered once, forwards free of collectives, at the
    cost of the module's whole weights on every rank for the body. Every rank must enter it.
    """
    if not is_fsdp(model):
        yield
        return
    with fsdp.gathered(model):
        yield


def optimizer_state(model: torch.nn.Module, optimizer, accelerator) -> dict:
    """The optimizer state a checkpoint saves. Under FSDP each rank's optimizer holds the state of
    its own parameter shards only, so the full state (keyed by parameter name) is gathered from
    every rank (every rank must call this; every rank gets it, so a checkpoint is the same file
    whatever the world size); otherwise `optimizer.state_dict()`."""
    if not is_fsdp(model):
        return optimizer.state_dict()
    return fsdp.optimizer_state(model, getattr(optimizer, "optimizer", optimizer))


def load_optimizer_state(model: torch.nn.Module, optimizer, state: dict, accelerator) -> None:
    """Load what `optimizer_state` returned: under FSDP every rank keeps its own shards of the
    full state (every rank must call this). A checkpoint of the other engine loads too (resuming
    may switch between ddp and fsdp): its keys are turned into this engine's."""
    inner = getattr(optimizer, "optimizer", optimizer)
    names = fsdp.parameter_names(accelerator.unwrap_model(model), inner)
    if not is_fsdp(model):
        optimizer.load_state_dict(fsdp.keyed_by_index(state, names))
        return
    fsdp.load_optimizer_state(model, inner, fsdp.keyed_by_name(state, names))


def setup_accelerator(cfg: StageConfig):
    """An accelerate.Accelerator for cfg.distributed (ddp | deepspeed | fsdp) and cfg.train.precision.
    Under fsdp it is the plain multi-process accelerator: `prepare_training` shards the model.

    The accelerator knows `train.grad_accum`: every stage runs its micro-batches through
    `pipeline.engine.steps.micro_step` (accelerate's `accumulate`), so gradients are reduced and
    the optimizer (DeepSpeed's engine included) steps once per optimizer step.

    Raises:
        ValueError: unknown engine, deepspeed without a config file, deepspeed without a GPU.
    """
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    mixed = resolve_precision(cfg.train.precision)
    engine = cfg.distributed.engine
    # Without a GPU, accelerate only sets up multi-process CPU training (gloo) when told cpu=True.
    kwargs: dict[str, Any] = {"mixed_precision": mixed, "step_scheduler_with_optimizer": False,
                              "cpu": not torch.cuda.is_available()}
    if engine != "deepspeed":  # DeepSpeed takes the count from its plugin
        kwargs["gradient_accumulation_steps"] = cfg.train.grad_accum
    if engine == "deepspeed":
        if not torch.cuda.is_available():  # see combination_problems, which reports it up front
            raise ValueError("distributed.engine deepspeed needs a GPU (accelerate cannot run DeepSpeed on CPU); use ddp or fsdp")
        if not cfg.distributed.deepspeed_config:
            raise ValueError("distributed.deepspeed_config: required when distributed.engine is deepspeed")
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            hf_ds_config=cfg.distributed.deepspeed_config,
            gradient_accumulation_steps=cfg.train.grad_accum,
            gradient_clipping=cfg.train.max_grad_norm or None,
        )
    elif engine not in ("ddp", "fsdp"):
        raise ValueError(f"distributed.engine: {engine!r} is not one of ddp, deepspeed, fsdp")
    accelerator = Accelerator(**kwargs)
    if engine == "deepspeed":
        # accelerate fills the "auto" batch size from a DataLoader; we batch ourselves (exact resume).
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
        ds["gradient_accumulation_steps"] = cfg.train.grad_accum
        ds["train_batch_size"] = cfg.train.batch_size * cfg.train.grad_accum * accelerator.num_processes
    return accelerator


def prepare_training(accelerator, model: torch.nn.Module, cfg: StageConfig) -> tuple[torch.nn.Module, Any]:
    """The trained module and its optimizer, ready for the engine: under fsdp the model sharded
    in place (pipeline.engine.fsdp) and the optimizer built over its shards, only the optimizer
    given to accelerate; otherwise both through `accelerator.prepare` (DDP, DeepSpeed)."""
    if cfg.distributed.engine != "fsdp":
        return accelerator.prepare(model, build_optimizer(model, cfg.train))
    fsdp.shard_model(model, accelerator.device, sharding=cfg.distributed.fsdp_sharding,
                     mixed=resolve_precision(cfg.train.precision))
    return model, accelerator.prepare(build_optimizer(model, cfg.train))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no weight decay on 1-d parameters (norms, biases).

    The fused kernel where every trainable parameter allows it (CPU or CUDA, a float dtype): the
    same update as the per-parameter loop within fp32 rounding, and on CPU 12x faster for the
    135M embedded model (0.13 s against 1.6 s a step, one thread: bench/RESULTS.md), which is a
    quarter of a full fine-tuning step. TRL's default (`adamw_torch_fused`) is the same kernel.

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
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                for p in decay + no_decay)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.epsilon,
        fused=fused or None,
    )


def trainable_state(model: torch.nn.Module, accelerator) -> dict[str, torch.Tensor]:
    """The trainable parameters by name (full tensors, gathered under FSDP / ZeRO-3; under FSDP
    only the trainable ones are gathered, so a LoRA checkpoint costs the adapter alone)."""
    names = {n for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}
    if is_fsdp(model):
        return fsdp.full_tensors((n, p) for n, p in model.named_parameters() if n in names)
    if accelerator.num_processes > 1 and accelerator.distributed_type.name == "DEEPSPEED":
        full = accelerator.get_state_dict(model)
        return {k: v for k, v in full.items() if k in names}
    return {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters() if n in names}


def load_trainable_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], accelerator) -> None:
    """Copy checkpointed trainable weights into the model (under FSDP each rank into its shards).

    Raises:
        KeyError: the checkpoint lacks a trainable parameter of the model, or has an unknown one.
    """
    params = dict(accelerator.unwrap_model(model).named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in tensors]
    unknown = [n for n in tensors if n not in params]
    if missing or unknown:
        raise KeyError(f"checkpoint does not match the model: missing {missing[:5]}, unknown {unknown[:5]}")
    for name, value in tensors.items():
        fsdp.load_full(params[name], value)
