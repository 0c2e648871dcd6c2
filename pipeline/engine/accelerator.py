"""The accelerator and the optimizer every stage trains with (one place for both, so engines,
precision and accumulation behave the same in every stage)."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import torch

from pipeline.config import StageConfig, TrainConfig
from pipeline.config.engines import ENGINES, missing_package, resume_refusal
from pipeline.engine import fsdp
from pipeline.engine.engines import RUNTIMES, resumed_engine, would_resume
from pipeline.engine.engines import fill_hidden_size_autos as fill_hidden_size_autos


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
    loads (accelerate would otherwise fall back silently or fail mid-run). The engine's own come
    from its entries (pipeline/config/engines.py's facts, pipeline/engine/engines.py's runtime).

    Pure apart from asking torch whether CUDA is visible, whether the engine's package /
    `flash_attn` are installed and whether output_dir holds a checkpoint to resume.
    """
    engine = cfg.distributed.engine
    out = []
    if engine in RUNTIMES:
        facts = ENGINES[engine]
        if (line := missing_package(engine, lambda name: importlib.util.find_spec(name) is not None)) is not None:
            out.append(line)
        out += RUNTIMES[engine].problems(cfg, facts)
        if would_resume(cfg):  # a run of such an engine, or its checkpoint resumed under another
            written = resumed_engine(cfg)
            for name in dict.fromkeys(e for e in (engine, written) if e in ENGINES):
                if (line := resume_refusal(name)) is not None:
                    out.append(line)
    from pipeline.modeling.models import check_attn_implementation

    try:
        check_attn_implementation(cfg.model.attn_implementation)
    except ValueError as err:  # flash_attention_2 without CUDA or without flash-attn
        out.append(f"model.attn_implementation: {err}")
    return out


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


def zero3_hooks(model: torch.nn.Module) -> Any:
    """The object holding DeepSpeed's ZeRO-3 hooks on the modules of a prepared model (its
    optimizer's parameter offload), or None (not a ZeRO-3 engine with an optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    hooks = getattr(optimizer, "parameter_offload", optimizer)
    return hooks if hasattr(hooks, "forward_hooks") and hasattr(hooks, "empty_partition_cache") else None


def settle_zero3(model: torch.nn.Module) -> None:
    """Every parameter of a prepared ZeRO-3 model back in its partition (a no-op otherwise): a
    forward without a backward (an evaluation) can leave parameters it prefetched in flight, and
    gathering one then fails ("Cannot partition a param in flight"). Through the hooks' owner, not
    the engine's `empty_partition_cache`, which adds a full garbage collection at every call (before
    every rollout, checkpoint and export; bench/RESULTS.md). Every rank must call it."""
    hooks = zero3_hooks(model) if is_partitioned(model) else None
    if hooks is not None:
        hooks.empty_partition_cache()


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


def frozen_zero3_engine(accelerator, model: torch.nn.Module) -> Any:
    """A DeepSpeed engine without an optimizer for `model`, frozen and loaded partitioned by
    `zero.Init` under ZeRO-3 (a full-weight reference or a reward model beside the trained model):
    the engine hooks `model`'s modules so that its forwards, called on `model` itself, gather its
    partitions layer by layer as the trained model's do (a partitioned module outside an engine
    holds empty weights). TRL wraps its reference the same way. Keep the engine as long as `model`
    runs; call `model`, not the engine (whose `config` is DeepSpeed's). Call it after the trained
    model is prepared (the config's "auto" values are filled then); every rank must call it."""
    import copy

    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    config.get("zero_optimization", {}).pop("offload_optimizer", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # DeepSpeed's train() returns None, not the engine
    return engine


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


@contextlib.contextmanager
def sampling_weights(model: torch.nn.Module, policy: torch.nn.Module, gather: bool = True):
    """The weights `policy` (a module inside the prepared `model`) samples with, whole on every rank
    for the body, so that each rank's forwards run alone and ranks may stop at different lengths.
    Under FSDP `full_parameters`. Under DeepSpeed ZeRO-3 with `gather` (`generation.zero3_gather`):
    the policy's partitions gathered once, and the ZeRO-3 hooks on every module of `model` (which
    gather and release a module's partitions around each of its forwards) lifted for the body, then
    registered again and the partitions freed, as TRL's `ds3_gather_for_generation` and DeepSpeed's
    `unwrap_model_for_generation` do (the policy alone, not a critic or frozen copy beside it).
    Without `gather` (a policy too large for one device) the forwards gather layer by layer through
    the hooks: collectives, so every rank must keep stepping until all are done (`synced_gpus`).
    Every rank must enter it."""
    if is_fsdp(model):
        with fsdp.gathered(model):
            yield
        return
    if not (gather and is_partitioned(policy)):
        yield
        return
    import deepspeed

    hooks = zero3_hooks(model)
    if hooks is None:
        raise RuntimeError("ZeRO-3 sampling: the prepared model has no DeepSpeed ZeRO-3 optimizer holding its hooks")
    settle_zero3(model)  # nothing a forward prefetched left in flight
    with deepspeed.zero.GatheredParameters(list(policy.parameters()), modifier_rank=None):
        for hook in hooks.forward_hooks + hooks.backward_hooks:
            hook.remove()
        hooks.forward_hooks, hooks.backward_hooks = [], []
        try:
            yield
        finally:
            hooks._register_deepspeed_module(hooks.module)  # also drops the prefetch trace it recorded
            coordinator = hooks.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()


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
    """An accelerate.Accelerator for cfg.distributed (its engine's `RUNTIMES` entry: the
    Accelerator's options and what is filled in once it exists) and cfg.train.precision. Under
    fsdp it is the plain multi-process accelerator: `prepare_training` shards the model.

    The accelerator knows `train.grad_accum`: every stage runs its micro-batches through
    `pipeline.engine.steps.micro_step` (accelerate's `accumulate`), so gradients are reduced and
    the optimizer (DeepSpeed's engine included) steps once per optimizer step.

    Raises:
        ValueError: unknown engine, an engine without the config file it needs (deepspeed).
    """
    from accelerate import Accelerator

    engine = cfg.distributed.engine
    runtime = RUNTIMES.get(engine)
    if runtime is None:
        raise ValueError(f"distributed.engine: {engine!r} is not one of {', '.join(RUNTIMES)}")
    needs = ENGINES[engine].config_file
    if needs is not None and not getattr(cfg.distributed, needs):
        raise ValueError(f"distributed.{needs}: required when distributed.engine is {engine}")
    cuda = torch.cuda.is_available()
    accelerator = Accelerator(
        mixed_precision=resolve_precision(cfg.train.precision),
        step_scheduler_with_optimizer=False,
        **runtime.accelerator_kwargs(cfg, cuda),
    )
    runtime.after_creation(accelerator, cfg, cuda)
    return accelerator


def prepare_training(accelerator, model: torch.nn.Module, cfg: StageConfig) -> tuple[torch.nn.Module, Any]:
    """The trained module and its optimizer, ready for the engine, as its `RUNTIMES` entry prepares
    them: under fsdp the model sharded in place (pipeline.engine.fsdp) and the optimizer built over
    its shards, only the optimizer given to accelerate; otherwise both through `accelerator.prepare`
    (DDP, DeepSpeed)."""
    return RUNTIMES[cfg.distributed.engine].prepare(
        accelerator,
        model,
        cfg,
        lambda module: build_optimizer(module, cfg.train),
        resolve_precision(cfg.train.precision),
    )


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
        settle_zero3(model)
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
