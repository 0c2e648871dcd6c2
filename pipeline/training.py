"""The shared pieces of every training loop: accelerator, optimizer, data order, the accumulated
optimizer step, evaluation, checkpoint state, early stopping, final save.

Loss normalisation (the contract PT, SFT and anything else built on `train_step` keeps): every
supervised token gets a weight computed from token counts over the *whole* accumulated batch on
*every* rank (all-reduced before the first backward), so the gradient of one optimizer step is
the same whether its samples arrive as 1 x 8, 8 x 1 or 2 ranks x 4 micro-batches. In mode
'none' the weight is 1 / N_total (the token mean); in 'case3'/'coba' it is
w_t / (N_t * sum of w over the tasks present), see pipeline.multitask.token_weights.

Hidden debugging knob (documented here, not in the config): the environment variable
`RELAY_STOP_AFTER_STEP=k` makes a stage save a checkpoint right after step k and exit, which
is how the resume tests stop a run at an exact step instead of killing processes by timing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from pipeline.config import StageConfig, TrainConfig
from pipeline.checkpoint import load_trainable_state, trainable_state  # noqa: F401 (re-exported)
from data_formats.sampling import DataCursor, epoch_tail, next_micro_batches
from pipeline.multitask import token_weights
from pipeline.tracking import EarlyStopping, History

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
STOP_ENV = "RELAY_STOP_AFTER_STEP"


class NonFiniteError(RuntimeError):
    """A loss or gradient became NaN/inf; raised before the optimizer steps on it."""


# ------------------------------------------------------------------------------------------
# Accelerator and optimizer
# ------------------------------------------------------------------------------------------


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

    Gradient accumulation is done by `train_step` (accelerate's own accumulation divides the loss
    by the number of micro-batches, which is not token normalisation), so the accelerator is built
    with one micro-batch per step; DeepSpeed gets the real count because its engine decides when
    to step.

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


def check_finite(loss: torch.Tensor | float, model: torch.nn.Module, step: int) -> None:
    """Refuse a non-finite loss or gradient before the optimizer steps on it.

    Raises:
        NonFiniteError: naming the step and the first offending parameter.
    """
    value = float(loss)
    if not math.isfinite(value):
        raise NonFiniteError(f"step {step}: loss is {value}; stopping before the optimizer step (last complete checkpoint kept)")
    for name, param in model.named_parameters():
        if param.grad is not None and not torch.isfinite(param.grad).all():
            raise NonFiniteError(f"step {step}: gradient of {name} is not finite; stopping before the optimizer step")


def write_summary(output_dir: str | Path, summary: dict) -> None:
    """Write `<output_dir>/summary.json` (the stage's headline figures)."""
    path = Path(output_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=float) + "\n", encoding="utf-8")


def stop_after_step() -> Optional[int]:
    """The step from RELAY_STOP_AFTER_STEP (see the module docstring), or None.

    Raises:
        ValueError: the variable is set but not an integer.
    """
    text = os.environ.get(STOP_ENV, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError as err:
        raise ValueError(f"{STOP_ENV}={text!r} is not a step number") from err


# ------------------------------------------------------------------------------------------
# Loss and the accumulated optimizer step
# ------------------------------------------------------------------------------------------


def model_inputs(batch: dict) -> dict:
    """The keys of a batch the model's forward takes."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}


def token_losses(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy (fp32) and the task index of each predicted token.

    Returns ([B, T-1] losses, 0 where unsupervised; [B, T-1] task ids, -1 where unsupervised).
    A batch without `task_ids` is one task (0).
    """
    logits = model(**model_inputs(batch), use_cache=False).logits[:, :-1, :]
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE_INDEX
    losses = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).clamp(min=0), reduction="none"
    ).view(labels.shape)
    losses = torch.where(mask, losses, torch.zeros_like(losses))
    tasks = batch.get("task_ids")
    tasks = torch.zeros_like(labels) if tasks is None else tasks[:, 1:].to(labels.device)
    tasks = torch.where(mask, tasks, torch.full_like(tasks, -1))
    return losses, tasks


def supervised_counts(batches: Sequence[dict], num_tasks: int) -> torch.Tensor:
    """[num_tasks] supervised-token counts per task over `batches` (float64 for exact sums)."""
    counts = torch.zeros(num_tasks, dtype=torch.float64)
    for batch in batches:
        labels = batch["labels"][:, 1:]
        tasks = batch.get("task_ids")
        tasks = torch.zeros_like(labels) if tasks is None else tasks[:, 1:]
        valid = (labels != IGNORE_INDEX) & (tasks >= 0)
        counts += torch.bincount(tasks[valid].cpu(), minlength=num_tasks)[:num_tasks].double()
    return counts


def all_reduce_sum(tensor: torch.Tensor, accelerator) -> torch.Tensor:
    """Sum of `tensor` over ranks (itself on one process)."""
    if accelerator is None or accelerator.num_processes == 1:
        return tensor
    return accelerator.reduce(tensor.to(accelerator.device), reduction="sum").cpu()


@dataclass
class StepResult:
    """What one optimizer step measured (already reduced over ranks)."""

    loss: float
    task_losses: list[float]
    task_tokens: list[float]
    grad_norm: float
    tokens: int


def _is_deepspeed(accelerator) -> bool:
    return accelerator is not None and getattr(accelerator.state, "deepspeed_plugin", None) is not None


def train_step(
    model: torch.nn.Module,
    optimizer,
    micro_batches: Sequence[dict],
    accelerator,
    *,
    step: int,
    num_tasks: int = 1,
    mode: str = "none",
    task_weights: Optional[Sequence[float]] = None,
    max_grad_norm: float = 0.0,
) -> StepResult:
    """One optimizer step over this rank's micro-batches with token-normalised accumulation.

    Backward runs per micro-batch (memory stays one micro-batch); DDP gradient sync only on the
    last. Gradients are clipped to `max_grad_norm` (0: measured, not clipped), checked finite,
    then the optimizer steps. The caller steps the scheduler.

    Raises:
        NonFiniteError: loss or gradients not finite (the optimizer has not stepped).
    """
    counts = all_reduce_sum(supervised_counts(micro_batches, num_tasks), accelerator)
    weights = token_weights(counts, mode, task_weights)
    world = accelerator.num_processes if accelerator is not None else 1
    # DDP/FSDP average gradients over ranks; the weights already divide by the global count.
    scale = float(world)
    if _is_deepspeed(accelerator):
        scale *= len(micro_batches)  # the DeepSpeed engine divides every backward by its accumulation steps
    loss_sums = torch.zeros(num_tasks, dtype=torch.float64)
    objective = torch.zeros((), dtype=torch.float64)
    tokens = 0
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or accelerator is None else accelerator.no_sync(model)
        with sync:
            autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
            with autocast:
                losses, tasks = token_losses(model, batch)
            valid = tasks >= 0
            per_token = torch.where(valid, weights.to(losses.device, torch.float32)[tasks.clamp(min=0)], torch.zeros_like(losses))
            loss = (losses * per_token).sum()
            if accelerator is not None:
                accelerator.backward(loss * scale)
            else:
                (loss * scale).backward()
        objective += loss.detach().double().cpu()
        loss_sums.index_add_(0, tasks[valid].cpu(), losses[valid].detach().double().cpu())
        tokens += int((batch["task_ids"] >= 0).sum()) if "task_ids" in batch else batch["input_ids"].numel()
    # One all-reduce for every figure: [objective, per-task loss sums..., real tokens].
    totals = all_reduce_sum(torch.cat([objective.view(1), loss_sums, torch.tensor([float(tokens)], dtype=torch.float64)]), accelerator)
    objective, loss_sums, tokens = totals[0], totals[1:-1], int(totals[-1])
    grad_norm = clip_gradients(model, accelerator, max_grad_norm)
    if not (math.isfinite(float(objective)) and math.isfinite(grad_norm)):
        # The global norm is non-finite iff some gradient is, so the per-parameter scan that
        # names the culprit runs only then.
        check_finite(objective, model, step)
        raise NonFiniteError(f"step {step}: gradient norm is {grad_norm}; stopping before the optimizer step")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    task_losses = [float(loss_sums[t] / counts[t]) if counts[t] > 0 else float("nan") for t in range(num_tasks)]
    return StepResult(float(objective), task_losses, counts.tolist(), grad_norm, tokens)


def clip_gradients(model: torch.nn.Module, accelerator, max_norm: float) -> float:
    """Clip the global gradient norm to `max_norm` (0: only measure it); return the norm before clipping."""
    if _is_deepspeed(accelerator):
        # The engine clips and steps inside accelerator.backward (gradient_clipping in the plugin),
        # so under DeepSpeed the non-finite guard cannot run before its step; report its norm.
        norm = model.get_global_grad_norm() if hasattr(model, "get_global_grad_norm") else None
        return float(norm) if norm is not None else 0.0
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_norm if max_norm and max_norm > 0 else float("inf")
    if accelerator is not None:
        norm = accelerator.clip_grad_norm_(params, limit)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
    return float(norm)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Sequence[dict], accelerator, num_tasks: int = 1) -> dict:
    """Token-mean loss over `batches` (this rank's share) reduced over ranks, per task too.

    Every rank must pass the same number of batches (see `eval_shards`), because sharded engines
    (FSDP, ZeRO-3) need all ranks in every forward; a batch may carry a [B] bool `eval_weight`
    whose False rows run but are not counted (the padding batches of a short rank).

    Returns {'loss', 'ppl', 'task_losses' (nan where a task has no tokens), 'tokens'}.
    """
    from pipeline.models import eval_mode

    sums = torch.zeros(num_tasks, dtype=torch.float64)
    counts = torch.zeros(num_tasks, dtype=torch.float64)
    with eval_mode(model):
        for batch in batches:
            autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
            with autocast:
                losses, tasks = token_losses(model, batch)
            valid = (tasks >= 0) & batch.get("eval_weight", torch.ones(1, dtype=torch.bool)).to(tasks.device).view(-1, 1).bool()
            sums.index_add_(0, tasks[valid].cpu(), losses[valid].double().cpu())
            counts.index_add_(0, tasks[valid].cpu(), torch.ones(int(valid.sum()), dtype=torch.float64))
    sums = all_reduce_sum(sums, accelerator)
    counts = all_reduce_sum(counts, accelerator)
    total = float(counts.sum())
    loss = float(sums.sum() / total) if total > 0 else float("nan")
    per_task = [float(sums[t] / counts[t]) if counts[t] > 0 else float("nan") for t in range(num_tasks)]
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan"), "task_losses": per_task, "tokens": total}


def eval_shards(n: int, batch_size: int, world_size: int, rank: int, max_batches: Optional[int] = None) -> list[tuple[list[int], bool]]:
    """This rank's evaluation batches as (sample indices, counts?) pairs, the same number on every rank.

    Samples are dealt round-robin; a rank whose share runs out repeats its first batch with
    counts=False (the forward runs, its losses are not counted), so no sample is counted twice.
    """
    mine = list(range(rank, n, world_size))
    per_rank = math.ceil(math.ceil(n / world_size) / batch_size) if n else 0
    if max_batches is not None:
        per_rank = min(per_rank, max_batches)
    out = []
    for b in range(per_rank):
        chunk = mine[b * batch_size : (b + 1) * batch_size]
        out.append((chunk, True) if chunk else (list(range(min(batch_size, n))), False))
    return out


# ------------------------------------------------------------------------------------------
# A run: everything a stage's loop touches, built once by `build_run`, saved by `checkpoint_state`
# ------------------------------------------------------------------------------------------


def data_problems(entries: Sequence[str], key: str) -> list[str]:
    """Data path entries that name no file (a missing path or an empty folder/glob)."""
    from data_formats.sources import expand_entry

    out = []
    for entry in entries:
        files, dataset = expand_entry(entry)
        if dataset is None and (not files or not all(f.is_file() for f in files)):
            out.append(f"{key}: {entry!r} names no data file")
    return out


def launched_world_size() -> int:
    """Processes torchrun started (WORLD_SIZE), known before the accelerator exists (validation)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def parent_problems(model_path: str) -> list[str]:
    """Mismatches between a local parent model's manifest and its folder's tokenizer/template."""
    from pipeline.manifest import check_parent_compatible, read_manifest

    folder = Path(model_path)
    if not folder.is_dir() or read_manifest(folder) is None:
        return []
    return [f"model.path: {p}" for p in check_parent_compatible(folder, folder)]


@dataclass
class Run:
    """The state of one training run (the loop reads and advances it)."""

    cfg: Any
    stage: str
    accelerator: Any
    model: Any
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    collator: Any
    train_samples: list
    eval_samples: list
    tasks: list
    checkpointer: Any
    tracker: Any
    model_path: str
    chat_template: Optional[str] = None
    cursor: DataCursor = field(default_factory=DataCursor)
    step: int = 0
    history: History = field(default_factory=History)
    early: EarlyStopping = field(default_factory=EarlyStopping)
    extra: dict = field(default_factory=dict)
    """Named objects with state_dict/load_state_dict (e.g. CoBa) that checkpoints carry."""
    last_saved: int = -1
    batch_ids: list = field(default_factory=list)
    """Sample indices of every step's micro-batches on this rank (the resume tests compare them)."""
    model_kind: str = "causal"
    """'causal' or 'reward' (the RM stage): how the model is loaded and merged."""

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process


def build_run(cfg, stage: str, *, tokenizer, collator, train_samples: list, eval_samples: list, tasks: list,
              chat_template: Optional[str] = None, extra: Optional[dict] = None, accelerator=None,
              model_kind: str = "causal") -> Run:
    """Load the model (full / LoRA / QLoRA), optimizer and scheduler, wrap them with accelerate,
    open trackers and resume from a checkpoint when cfg.checkpoint says so.

    Raises:
        ValueError / OSError: from the model loader; FileNotFoundError: bad checkpoint.resume path.
    """
    from accelerate.utils import set_seed

    from pipeline.checkpoint import Checkpointer
    from pipeline.config import to_dict
    from pipeline.models import load_model, resolve_model_path
    from pipeline.schedule import build_scheduler
    from pipeline.tracking import Tracker, default_run_name

    accelerator = accelerator or setup_accelerator(cfg)
    set_seed(cfg.train.seed)
    model_path = resolve_model_path(cfg.model.path)
    model = load_model(cfg.model, cfg.lora, kind=model_kind, tokenizer=tokenizer)
    optimizer = build_optimizer(model, cfg.train)
    model, optimizer = accelerator.prepare(model, optimizer)
    # from_pretrained returns a model in eval mode: without this, dropout never runs and
    # transformers never checkpoints a layer (it does so only when `training` is set).
    model.train()
    # The scheduler is not prepared: accelerate would step it once per process per step.
    scheduler = build_scheduler(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer, cfg.train)
    out = Path(cfg.output_dir)
    checkpointer = Checkpointer(out / "checkpoints", cfg.checkpoint, rank=accelerator.process_index,
                                world_size=accelerator.num_processes, barrier=accelerator.wait_for_everyone)
    tracker = Tracker(cfg.tracking, out, default_run_name(stage), to_dict(cfg), enabled=accelerator.is_main_process)
    run = Run(cfg, stage, accelerator, model, optimizer, scheduler, tokenizer, collator, train_samples, eval_samples,
              tasks, checkpointer, tracker, model_path, chat_template, extra=extra or {}, model_kind=model_kind)
    run.early.patience = cfg.train.early_stopping_stall_num
    tail = epoch_tail(len(train_samples), cfg.train.batch_size, accelerator.num_processes) if train_samples else 0
    if tail:
        log.info("%d training sample(s) per epoch do not fill a global micro-batch and sit out that epoch "
                 "(each epoch reshuffles, so a different %d)", tail, tail)
    path = checkpointer.resume_path()
    if path is not None:
        restore(run, checkpointer.load(path))
        log.info("resumed from %s at step %d", path, run.step)
    return run


def checkpoint_state(run: Run) -> dict:
    """Every part of a checkpoint: trainable weights, optimizer, scheduler, RNG, data cursor, trainer."""
    from pipeline.checkpoint import rng_state

    return {
        "model": trainable_state(run.model, run.accelerator),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "rng": rng_state(),
        "data": asdict(run.cursor),
        "trainer": {"step": run.step, "early_stopping": run.early.state_dict(),
                    "extra": {k: v.state_dict() for k, v in run.extra.items()},
                    "history": {"steps": run.history.steps, "evals": run.history.evals, "tokens": run.history.tokens}},
    }


def restore(run: Run, state: dict) -> None:
    """Put a loaded checkpoint back into the run.

    Raises:
        KeyError: the checkpoint does not match the model or lacks a part.
    """
    from pipeline.checkpoint import set_rng_state

    load_trainable_state(run.model, state["model"], run.accelerator)
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.cursor = DataCursor(**state["data"])
    trainer = state["trainer"]
    run.step = int(trainer["step"])
    run.last_saved = run.step
    run.early.load_state_dict(trainer["early_stopping"])
    for name, obj in run.extra.items():
        obj.load_state_dict(trainer["extra"][name])
    run.history.steps = trainer["history"]["steps"]
    run.history.evals = trainer["history"]["evals"]
    run.history.tokens = trainer["history"]["tokens"]
    if "rng" in state:
        set_rng_state(state["rng"])


def next_batches(run: Run) -> list[dict]:
    """This rank's micro-batches for the next optimizer step (advances the cursor)."""
    t = run.cfg.train
    acc = run.accelerator
    groups, run.cursor = next_micro_batches(len(run.train_samples), run.cursor, seed=t.seed, batch_size=t.batch_size,
                                            grad_accum=t.grad_accum, world_size=acc.num_processes, rank=acc.process_index)
    run.batch_ids.append(groups)
    return [{k: v.to(acc.device) for k, v in run.collator([run.train_samples[i] for i in g]).items()} for g in groups]


def next_stream_batches(run: Run, stream) -> list[dict]:
    """This rank's micro-batches for the next optimizer step from a streamed source (anything with
    `next_row()`): every rank reads the same stream and keeps every world_size-th row from its own
    rank on, so the global batch is the same whatever the number of processes."""
    t, acc = run.cfg.train, run.accelerator
    batches = []
    for _ in range(t.grad_accum):
        rows = [stream.next_row() for _ in range(t.batch_size * acc.num_processes)]
        mine = rows[acc.process_index :: acc.num_processes]
        batches.append({k: v.to(acc.device) for k, v in run.collator(mine).items()})
    return batches


def log_step(run: Run, result: StepResult, lr: float, seconds: float, batches: Sequence[dict],
             task_weights: Optional[Sequence[float]] = None) -> None:
    """Record the step in the history and, every log_steps, in the trackers (ARCHITECTURE.md tags).
    Packing efficiency is real tokens / token slots of this rank's batches (padding counts as waste)."""
    record = {"step": run.step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
              "tokens_per_s": result.tokens / seconds if seconds > 0 else 0.0}
    run.history.steps.append(record)
    run.history.tokens += result.tokens
    if run.step % run.cfg.train.log_steps and run.step != run.cfg.train.max_steps:
        return
    metrics = {f"train/{k}": v for k, v in record.items() if k != "step"}
    metrics["train/packing_efficiency"] = sum(int((b["task_ids"] >= 0).sum()) for b in batches) / sum(b["task_ids"].numel() for b in batches)
    if len(run.tasks) > 1:
        for name, value, tokens in zip(run.tasks, result.task_losses, result.task_tokens):
            if tokens > 0:
                metrics[f"train/loss_task/{name}"] = value
        for name, weight in zip(run.tasks, task_weights or []):
            metrics[f"train/task_weight/{name}"] = weight
    run.tracker.log(metrics, run.step)


def eval_batches(run: Run, max_batches: Optional[int] = None, offset: int = 0) -> list[dict]:
    """This rank's evaluation batches (the same number on every rank, see eval_shards)."""
    acc = run.accelerator
    t = run.cfg.train
    shards = eval_shards(len(run.eval_samples), t.batch_size, acc.num_processes, acc.process_index)
    if max_batches is not None and shards:
        shards = [shards[(offset + i) % len(shards)] for i in range(min(max_batches, len(shards)))]
    out = []
    for indices, counts in shards:
        batch = {k: v.to(acc.device) for k, v in run.collator([run.eval_samples[i] for i in indices]).items()}
        batch["eval_weight"] = torch.full((batch["input_ids"].shape[0],), counts, dtype=torch.bool, device=acc.device)
        out.append(batch)
    return out


def run_eval(run: Run) -> Optional[dict]:
    """Evaluate on the held-out split, log eval/* tags, update early stopping; None without eval data."""
    if not run.eval_samples:
        return None
    result = evaluate(run.model, eval_batches(run, run.cfg.train.eval_batches), run.accelerator, len(run.tasks))
    run.history.evals.append({"step": run.step, "loss": result["loss"], "task_losses": result["task_losses"]})
    metrics = {"eval/loss": result["loss"], "eval/ppl": result["ppl"]}
    if len(run.tasks) > 1:
        metrics.update({f"eval/loss_task/{n}": v for n, v in zip(run.tasks, result["task_losses"]) if math.isfinite(v)})
    run.tracker.log(metrics, run.step)
    result["stop"] = run.early.update(result["loss"])
    return result


def save_checkpoint(run: Run, kind: str) -> Path:
    """Save the run's state as a checkpoint of the current step (every rank calls this)."""
    path = run.checkpointer.save(run.step, checkpoint_state(run), kind=kind)
    run.last_saved = run.step
    return path


def maybe_checkpoint(run: Run) -> None:
    """Save when the keep policy or the save interval says so."""
    kind = run.checkpointer.due(run.step)
    if kind is not None:
        save_checkpoint(run, kind)


def end_of_step(run: Run, stop_at: Optional[int], evaluate_fn: Callable[[], bool]) -> Optional[str]:
    """The bookkeeping after every optimizer step, the same in every stage: evaluate every
    `eval_steps` (`evaluate_fn` returns True when early stopping says stop), checkpoint by the keep
    policy, and honour RELAY_STOP_AFTER_STEP (saved, so a restart resumes here).

    Returns "interrupted", "early_stop" or None (go on).
    """
    t = run.cfg.train
    stop = bool(t.eval_steps and run.step % t.eval_steps == 0 and evaluate_fn())
    maybe_checkpoint(run)
    if stop_at is not None and run.step == stop_at:
        if run.last_saved != run.step:
            save_checkpoint(run, "temporary")
        log.warning("RELAY_STOP_AFTER_STEP=%d: saved and stopping", stop_at)
        return "interrupted"
    if stop:
        log.info("early stopping at step %d (no better eval loss in %d evaluations)", run.step, t.early_stopping_stall_num)
        return "early_stop"
    return None


def finish(run: Run, extra_manifest: Optional[dict] = None) -> Optional[Path]:
    """Final checkpoint, adapter + merged model (or full export), summary.json; returns merged/
    on rank 0 (None on the other ranks). Every rank must call it. The run's model, optimizer and
    scheduler are released (None) afterwards.

    Raises:
        MergeError / FileExistsError: from the merge module.
    """
    from pipeline.config import save_config, to_dict
    from pipeline.merge import export_full_model, merge_adapter

    if run.last_saved != run.step:
        save_checkpoint(run, "permanent")
    acc = run.accelerator
    out = Path(run.cfg.output_dir)
    summary = run.history.summary()
    full = run.cfg.model.finetuning == "full"
    unwrapped = acc.unwrap_model(run.model)
    if full and acc.num_processes > 1 and acc.distributed_type.name in ("FSDP", "DEEPSPEED"):
        # Sharded weights: gather the full state (every rank takes part) into a fresh copy on rank 0.
        state = acc.get_state_dict(run.model)
        if acc.is_main_process:
            from pipeline.models import load_model

            unwrapped = load_model(run.cfg.model, None, kind=run.model_kind, tokenizer=run.tokenizer)
            unwrapped.load_state_dict(state)
    merged = None
    extras = {"tasks": run.tasks, "summary": summary, **(extra_manifest or {})}
    if acc.is_main_process and full:
        merged = export_full_model(unwrapped, run.tokenizer, str(out / "merged"), parent=run.model_path, stage=run.stage,
                                   config=to_dict(run.cfg), extra_manifest=extras, chat_template=run.chat_template,
                                   overwrite=True)
    elif acc.is_main_process:
        unwrapped.save_pretrained(out / "adapter", safe_serialization=True)
        run.tokenizer.save_pretrained(out / "adapter")
    # Everything trained is on disk now: drop it before the merge loads the base again, so the
    # stage's peak memory is not the training model plus the merge's copies.
    unwrapped = None
    run.model, run.optimizer, run.scheduler = acc.free_memory(run.model, run.optimizer, run.scheduler)
    if acc.is_main_process:
        if not full:
            merged = merge_adapter(run.model_path, str(out / "adapter"), str(out / "merged"), kind=run.model_kind, stage=run.stage,
                                   config=to_dict(run.cfg), extra_manifest=extras, chat_template=run.chat_template,
                                   overwrite=True)
        write_summary(out, summary)
        save_config(run.cfg, out / "config.yaml")
    run.tracker.close()
    acc.wait_for_everyone()
    return merged
