"""The runtime half of the distributed engines (their facts: pipeline/config/engines.py): per
`distributed.engine`, what keeps it from running a config on this machine, the Accelerator options it
asks for, what it fills in once the Accelerator exists, and how it makes the trained module and its
optimizer ready. pipeline/engine/accelerator.py's `combination_problems`, `setup_accelerator` and
`prepare_training` look the entry up, so none of them branches on an engine's name.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch

from pipeline.config import StageConfig
from pipeline.config.engines import EngineFacts, deepspeed_json_problems, zero_stage
from pipeline.engine import fsdp
from pipeline.engine.checkpoint import newest_identity

OptimizerFor = Callable[[torch.nn.Module], torch.optim.Optimizer]
"""Builds the optimizer over a module's trainable parameters (accelerator.build_optimizer)."""


def _no_problems(cfg: StageConfig, facts: EngineFacts) -> list[str]:
    return []


def _nothing(accelerator: Any, cfg: StageConfig, cuda: bool) -> None:
    return None


def _process_group_kwargs(cfg: StageConfig, cuda: bool) -> dict[str, Any]:
    # Without a GPU, accelerate only sets up multi-process CPU training (gloo) when told cpu=True.
    return {"cpu": not cuda, "gradient_accumulation_steps": cfg.train.grad_accum}


def _through_accelerate(
    accelerator: Any, model: torch.nn.Module, cfg: StageConfig, optimizer_for: OptimizerFor, mixed: str
) -> tuple[torch.nn.Module, Any]:
    return accelerator.prepare(model, optimizer_for(model))


class EngineRuntime(NamedTuple):
    """How one engine runs (its facts: pipeline/config/engines.py's entry of the same name)."""

    problems: Callable[[StageConfig, EngineFacts], list[str]] = _no_problems
    """(stage config, the engine's facts) -> what keeps it from running that config on this machine,
    one line each (asked with the config problems, before any model loads)."""
    accelerator_kwargs: Callable[[StageConfig, bool], dict[str, Any]] = _process_group_kwargs
    """(stage config, whether CUDA is visible) -> the Accelerator's keyword options beyond the mixed
    precision and the scheduler's stepping."""
    after_creation: Callable[[Any, StageConfig, bool], None] = _nothing
    """(accelerator, stage config, whether CUDA is visible) -> None: what it fills in once the
    Accelerator exists."""
    prepare: Callable[[Any, torch.nn.Module, StageConfig, OptimizerFor, str], tuple[torch.nn.Module, Any]] = (
        _through_accelerate
    )
    """(accelerator, model, stage config, optimizer builder, accelerate's mixed precision) -> the
    trained module and its optimizer, ready for the engine."""


# ------------------------------------------------------------------------------------------
# DeepSpeed
# ------------------------------------------------------------------------------------------


def would_resume(cfg: StageConfig) -> bool:
    """Whether output_dir holds a checkpoint this run would resume."""
    return newest_identity(Path(cfg.output_dir) / "checkpoints", cfg.checkpoint) is not None


def resumed_engine(cfg: StageConfig) -> Optional[str]:
    """The distributed.engine that wrote the checkpoint this run would resume (None: none, or a
    marker from before identities)."""
    found = newest_identity(Path(cfg.output_dir) / "checkpoints", cfg.checkpoint)
    identity = found[1] if found is not None else None
    return (identity or {}).get("may_change", {}).get("distributed.engine")


def _deepspeed_problems(cfg: StageConfig, facts: EngineFacts) -> list[str]:
    path = cfg.distributed.deepspeed_config
    readable = bool(path) and Path(path).is_file()  # else the section's own problem says so
    found = deepspeed_json_problems(path, "distributed.deepspeed_config", cfg.train.max_grad_norm) if readable else []
    why = facts.no_qlora(zero_stage(path))
    return found + ([why] if cfg.model.finetuning == "qlora" and why else [])


def _deepspeed_kwargs(cfg: StageConfig, cuda: bool) -> dict[str, Any]:
    """accelerate's CPU path (cpu=True) would drop the plugin (see `_deepspeed_on_cpu`); the
    accumulation count goes to the plugin, which takes it from there. Gives a process started
    without a launcher a one-rank torchrun's environment first (`_world_of_one`)."""
    from accelerate.utils import DeepSpeedPlugin

    _world_of_one()
    kwargs: dict[str, Any] = {"cpu": False}
    if not cuda:
        kwargs["kwargs_handlers"] = _deepspeed_on_cpu()
    kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
        hf_ds_config=cfg.distributed.deepspeed_config,
        gradient_accumulation_steps=cfg.train.grad_accum,
        gradient_clipping=cfg.train.max_grad_norm or None,
    )
    return kwargs


def _deepspeed_fill_in(accelerator: Any, cfg: StageConfig, cuda: bool) -> None:
    # accelerate fills the "auto" batch size from a DataLoader; we batch ourselves (exact resume).
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
    ds["gradient_accumulation_steps"] = cfg.train.grad_accum
    ds["train_batch_size"] = cfg.train.batch_size * cfg.train.grad_accum * accelerator.num_processes
    # train.max_grad_norm, 0 included (DeepSpeed clips only above 0): accelerate's plugin reads 0 as
    # "not given" and fills "auto" with 1.0, so an unclipped run clipped at 1.0.
    ds["gradient_clipping"] = float(cfg.train.max_grad_norm)
    if not cuda:
        # On a CPU an offloaded optimizer is where it always was: the step stays Relay's fused
        # torch AdamW (accelerate would swap in DeepSpeedCPUAdam, compiled on first use).
        ds.setdefault("zero_force_ds_cpu_optimizer", False)


def _deepspeed_on_cpu() -> list:
    """The Accelerator's kwargs handlers that start DeepSpeed on a CPU.

    accelerate's own CPU path (cpu=True) drops the DeepSpeed plugin (plain gloo DDP). With
    cpu=False and no GPU it finds no backend: DeepSpeed's process group starts, but accelerate
    reads "no backend" as one process and every rank calls itself process 0 of 1. Naming gloo
    (DeepSpeed's CPU accelerator's backend) makes it read the world size and rank from the group.
    DS_ACCELERATOR=cpu before DeepSpeed is imported spares its accelerator probe and warning.
    The collectives stay gloo's (`_no_shared_memory_op`).
    """
    from accelerate.utils import InitProcessGroupKwargs

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _no_shared_memory_op()
    return [InitProcessGroupKwargs(backend="gloo")]


def _no_shared_memory_op() -> None:
    """Keep DeepSpeed from building its shared-memory all-reduce on a CPU: its process group start
    compiles that C++ extension on first use in every new environment (a fresh clone, a new
    virtualenv: a C++ compile before the first step) where the op is listed
    as compatible. Marked incompatible, DeepSpeed's collectives go through torch.distributed (gloo),
    as they do on any platform without the op."""
    try:
        from deepspeed import ops

        compatible = ops.__compatible_ops__
    except (ImportError, AttributeError):  # no DeepSpeed, or one without the op registry
        return
    compatible["deepspeed_shm_comm"] = False


def _world_of_one() -> None:
    """Give a process started without a launcher (no LOCAL_RANK) the environment of a one-rank
    torchrun. DeepSpeed needs a process group even for one process, and without these variables
    its `init_distributed` (called by `zero.Init` at model load and by `deepspeed.initialize`)
    looks for MPI instead (mpi4py) and fails."""
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


def _deepspeed_prepare(
    accelerator: Any, model: torch.nn.Module, cfg: StageConfig, optimizer_for: OptimizerFor, mixed: str
) -> tuple[torch.nn.Module, Any]:
    fill_hidden_size_autos(accelerator, model)
    return _through_accelerate(accelerator, model, cfg, optimizer_for, mixed)


# ------------------------------------------------------------------------------------------
# FSDP2
# ------------------------------------------------------------------------------------------


def _fsdp_problems(cfg: StageConfig, facts: EngineFacts) -> list[str]:
    out = []
    if cfg.distributed.fsdp_sharding not in fsdp.SHARDING:
        out.append(
            f"distributed.fsdp_sharding: {cfg.distributed.fsdp_sharding} has no FSDP2 counterpart (FSDP2 always "
            f"shards); use {' or '.join(fsdp.SHARDING)}, or distributed.engine ddp for unsharded data parallelism"
        )
    if (problem := fsdp.unsupported_torch()) is not None:
        out.append(problem)  # FSDP2's API as this torch has it (the features asked for, not the version)
    if cfg.model.finetuning == "qlora" and (why := facts.no_qlora(None)):
        out.append(why)
    return out


def _fsdp_prepare(
    accelerator: Any, model: torch.nn.Module, cfg: StageConfig, optimizer_for: OptimizerFor, mixed: str
) -> tuple[torch.nn.Module, Any]:
    """The model sharded in place (pipeline/engine/fsdp.py: FSDP2 on CPU and CUDA alike, never
    through accelerate's plugin) and the optimizer built over its shards; only the optimizer goes
    to accelerate, which keeps the process group, accumulation and collectives."""
    fsdp.shard_model(model, accelerator.device, sharding=cfg.distributed.fsdp_sharding, mixed=mixed)
    return model, accelerator.prepare(optimizer_for(model))


RUNTIMES: dict[str, EngineRuntime] = {
    "ddp": EngineRuntime(),
    "deepspeed": EngineRuntime(
        problems=_deepspeed_problems,
        accelerator_kwargs=_deepspeed_kwargs,
        after_creation=_deepspeed_fill_in,
        prepare=_deepspeed_prepare,
    ),
    "fsdp": EngineRuntime(problems=_fsdp_problems, prepare=_fsdp_prepare),
}
"""`distributed.engine` -> how it runs; the same names as pipeline/config/engines.py's ENGINES."""
