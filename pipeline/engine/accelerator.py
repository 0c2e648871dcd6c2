"""The accelerator and the optimizer every stage trains with (one place for both, so engines,
precision and accumulation behave the same in every stage)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Optional

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
    out = []
    if engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        out.append(
            "distributed.engine: deepspeed needs the deepspeed package (pip install deepspeed); or use ddp or fsdp"
        )
    if engine == "deepspeed" and cfg.model.finetuning == "qlora" and zero_stage(cfg.distributed.deepspeed_config) == 3:
        # transformers refuses a device_map under ZeRO-3's zero.Init, and bitsandbytes places (and
        # quantises) the 4-bit weights only through one; ZeRO-2 and DDP keep whole weights.
        out.append(
            "model.finetuning: qlora cannot load under DeepSpeed ZeRO-3 (its 4-bit weights are placed through a "
            "device_map, which ZeRO-3's partitioned loading refuses); use a ZeRO-2 config "
            "(deepspeed_configs/zero2.json), distributed.engine ddp, or model.finetuning lora"
        )
    if engine == "deepspeed" and _would_resume(cfg):
        # ZeRO partitions the optimizer state (and under ZeRO-3 the weights) over ranks; the
        # checkpoint holds rank 0's optimizer share only, so a resume would be silently wrong.
        out.append(
            "checkpoint.resume: resuming a distributed.engine "
            "deepspeed run is not supported (ZeRO shards the optimizer "
            "state over ranks; the checkpoint holds rank 0's share); set checkpoint.resume false to start again, "
            "or train with distributed.engine ddp or fsdp, which resume exactly"
        )
    from pipeline.modeling.models import check_attn_implementation

    try:
        check_attn_implementation(cfg.model.attn_implementation)
    except ValueError as err:  # flash_attention_2 without CUDA or without flash-attn
        out.append(f"model.attn_implementation: {err}")
    if engine == "fsdp" and cfg.distributed.fsdp_sharding not in SHARDING:
        out.append(
            f"distributed.fsdp_sharding: {cfg.distributed.fsdp_sharding} has no FSDP2 counterpart (FSDP2 always "
            f"shards); use {' or '.join(SHARDING)}, or distributed.engine ddp for unsharded data parallelism"
        )
    if engine == "fsdp" and (problem := fsdp.unsupported_torch()) is not None:
        out.append(problem)  # FSDP2's API as this torch has it (the features asked for, not the version)
    if engine == "fsdp" and cfg.model.finetuning == "qlora":
        # bitsandbytes' 4-bit weights are not tensors FSDP2 can cut into DTensor shards.
        out.append(
            "distributed.engine: fsdp cannot shard QLoRA's 4-bit weights; use distributed.engine ddp, "
            "or model.finetuning lora or full"
        )
    return out


def zero_stage(path: Optional[str]) -> Optional[int]:
    """The ZeRO stage a DeepSpeed JSON asks for (None: no readable file, its own config problem)."""
    try:
        data = json.loads(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None
    zero = data.get("zero_optimization") if isinstance(data, dict) else None
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else None


def _would_resume(cfg: StageConfig) -> bool:
    return newest_identity(Path(cfg.output_dir) / "checkpoints", cfg.checkpoint) is not None


def is_fsdp(model) -> bool:
    """Whether the prepared model is sharded by FSDP2 (pipeline.engine.fsdp)."""
    return fsdp.is_sharded(model)


def is_zero3(accelerator) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the parameters over ranks."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin is not None and accelerator.num_processes > 1 and plugin.zero_stage == 3


def is_partitioned(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions parameters of `module`: on any number of ranks, one
    included (a partitioned parameter's own tensor is then empty, its size is `ds_shape`)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def zero3_state(module: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """`module`'s state (or its trainable parameters) with every ZeRO-3 partition gathered, as
    CPU copies keyed like `state_dict()` (tied weights under each of their names). One parameter
    gathered at a time, so the peak is the largest tensor, not the model; every rank must call
    it (the gathers are collectives, in the same order on every rank) and every rank gets it."""
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if trainable_only and not param.requires_grad:
            continue
        if id(param) not in done:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None, enabled=hasattr(param, "ds_id")):
                done[id(param)] = param.detach().to("cpu", copy=True)
        out[name] = done[id(param)]
    if not trainable_only:  # buffers are never partitioned; non-persistent ones are no state
        keys = module.state_dict().keys()
        out.update({n: b.detach().to("cpu", copy=True) for n, b in module.named_buffers() if n in keys})
    return out


@contextlib.contextmanager
def without_zero3_init(accelerator):
    """Models loaded in the body load whole, not partitioned by `deepspeed.zero.Init`.

    accelerate's DeepSpeed plugin registers its config with transformers, so under ZeRO-3 every
    `from_pretrained` after `setup_accelerator` partitions the weights over all ranks, a
    collective. A copy loaded on rank 0 alone (the export's fresh model, the LoRA merge) would
    wait for the other ranks forever, or on one rank come out with empty weights."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    config = getattr(plugin, "dschf", None)
    if config is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(config)


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


def torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer whose param groups carry the learning rate (what a scheduler drives):
    beneath accelerate's wrapper, and under ZeRO beneath DeepSpeed's, which is no
    torch.optim.Optimizer (LambdaLR refuses it) and steps the torch optimizer it holds."""
    inner = getattr(optimizer, "optimizer", optimizer)
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


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

    mixed = resolve_precision(cfg.train.precision)
    engine = cfg.distributed.engine
    cuda = torch.cuda.is_available()
    # Without a GPU, accelerate only sets up multi-process CPU training (gloo) when told cpu=True;
    # DeepSpeed is the exception (see _deepspeed_on_cpu).
    kwargs: dict[str, Any] = {
        "mixed_precision": mixed,
        "step_scheduler_with_optimizer": False,
        "cpu": not cuda and engine != "deepspeed",
    }
    if engine != "deepspeed":  # DeepSpeed takes the count from its plugin
        kwargs["gradient_accumulation_steps"] = cfg.train.grad_accum
    if engine == "deepspeed":
        if not cfg.distributed.deepspeed_config:
            raise ValueError("distributed.deepspeed_config: required when distributed.engine is deepspeed")
        _world_of_one()
        if not cuda:
            kwargs["kwargs_handlers"] = _deepspeed_on_cpu()
        from accelerate.utils import DeepSpeedPlugin

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
        if not cuda:
            # On a CPU an offloaded optimizer is where it always was: the step stays Relay's fused
            # torch AdamW (accelerate would swap in DeepSpeedCPUAdam, compiled on first use).
            ds.setdefault("zero_force_ds_cpu_optimizer", False)
    return accelerator


def _deepspeed_on_cpu() -> list:
    """The Accelerator's kwargs handlers that start DeepSpeed on a CPU.

    accelerate's own CPU path (cpu=True) drops the DeepSpeed plugin (plain gloo DDP). With
    cpu=False and no GPU it finds no backend: DeepSpeed's process group starts, but accelerate
    reads "no backend" as one process and every rank calls itself process 0 of 1. Naming gloo
    (DeepSpeed's CPU accelerator's backend) makes it read the world size and rank from the group.
    DS_ACCELERATOR=cpu before DeepSpeed is imported spares its accelerator probe and warning.
    """
    from accelerate.utils import InitProcessGroupKwargs

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return [InitProcessGroupKwargs(backend="gloo")]


def _world_of_one() -> None:
    """Give a process started without a launcher (no LOCAL_RANK) the environment of a one-rank
    torchrun. DeepSpeed needs a process group even for one process, and without these variables
    its `init_distributed` (called by `zero.Init` at model load and by `deepspeed.initialize`)
    looks for MPI instead (mpi4py) and fails."""
    import socket

    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": str(port),
        }
    )


def prepare_training(accelerator, model: torch.nn.Module, cfg: StageConfig) -> tuple[torch.nn.Module, Any]:
    """The trained module and its optimizer, ready for the engine: under fsdp the model sharded
    in place (pipeline.engine.fsdp) and the optimizer built over its shards, only the optimizer
    given to accelerate; otherwise both through `accelerator.prepare` (DDP, DeepSpeed)."""
    if cfg.distributed.engine != "fsdp":
        fill_hidden_size_autos(accelerator, model)
        return accelerator.prepare(model, build_optimizer(model, cfg.train))
    fsdp.shard_model(
        model, accelerator.device, sharding=cfg.distributed.fsdp_sharding, mixed=resolve_precision(cfg.train.precision)
    )
    return model, accelerator.prepare(build_optimizer(model, cfg.train))


HIDDEN_SIZE_AUTOS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
"""The DeepSpeed keys accelerate fills from `model.config.hidden_size` when "auto" (its formulas)."""


def fill_hidden_size_autos(accelerator, model: torch.nn.Module) -> None:
    """Fill the "auto" ZeRO sizes of the DeepSpeed config from the hidden size of the first
    module inside `model` that has a config, as accelerate would from `model.config`: accelerate
    raises at `prepare` for a model without a `config` of its own (PPO's and GRPO's ActorCritic,
    which holds the policy). A no-op without DeepSpeed, or where no module has a hidden size
    (accelerate then names the keys itself)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    if not any(zero.get(key) == "auto" for key in HIDDEN_SIZE_AUTOS):
        return
    hidden = None
    for module in model.modules():
        config = getattr(module, "config", None)
        hidden = getattr(config, "hidden_size", None) or max(getattr(config, "hidden_sizes", None) or [0]) or None
        if hidden:
            break
    if hidden is None:
        return
    for key, value in HIDDEN_SIZE_AUTOS.items():
        if zero.get(key) == "auto":
            zero[key] = value(int(hidden))


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
    fused = all(
        p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        for p in decay + no_decay
    )
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.epsilon,
        fused=fused or None,
    )


def trainable_state(model: torch.nn.Module, accelerator) -> dict[str, torch.Tensor]:
    """The trainable parameters by name (full tensors, gathered under FSDP / ZeRO-3; under FSDP
    only the trainable ones are gathered, so a LoRA checkpoint costs the adapter alone)."""
    names = {n for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}
    if is_fsdp(model):
        return fsdp.full_tensors((n, p) for n, p in model.named_parameters() if n in names)
    if is_partitioned(model):
        state = zero3_state(accelerator.unwrap_model(model), trainable_only=True)
        return {n: v for n, v in state.items() if n in names}
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
