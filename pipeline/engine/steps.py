"""One optimizer step, the same in every stage: accumulation over micro-batches on accelerate's
own mechanism (`micro_step`), token-normalised language-modelling losses (`lm_train_step`),
gradient clipping and the non-finite guard (the held-out loop: pipeline.engine.held_out).

Loss normalisation (the contract `lm_train_step` keeps for PT and SFT): every supervised token
gets a weight computed from token counts over the *whole* accumulated batch on *every* rank
(all-reduced before the first backward), so the gradient of one optimizer step is the same
whether its samples arrive as 1 x 8, 8 x 1 or 2 ranks x 4 micro-batches. Without task weights
the weight is 1 / N_total (the token mean); with them it is w_t / (N_t * sum of w over the tasks
present), see `token_weights`. PPO token-normalises the same way over its mini-batch
(`pipeline.rl.ppo.ppo_update`). A stage whose loss is a mean per micro-batch of
equal-sized micro-batches (RM) passes it to `accelerator.backward` as it is: accelerate divides it
by the number of micro-batches and DDP averages over ranks, which is the mean it wants.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Collection, Optional, Sequence

import torch
import torch.nn.functional as F

from data_formats.collate import IGNORE_INDEX
from pipeline.engine.fsdp import full_tensor, is_sharded, local_tensor
from pipeline.engine.supervised_head import head_split, supervised_forward
from pipeline.modeling.attention import attention_implementation, document_attention


class NonFiniteError(RuntimeError):
    """A loss or gradient became NaN/inf; raised before the optimizer steps on it."""


def check_finite(
    loss: torch.Tensor | float, model: torch.nn.Module, step: int, grad_norm: Optional[float] = None
) -> None:
    """Refuse a non-finite loss or gradient before the optimizer steps on it.

    `grad_norm`: the step's global gradient norm (`clip_gradients`, the same on every rank). A
    NaN or inf anywhere makes it NaN or inf, so a finite one clears every gradient without the
    per-parameter scan (a read of every gradient, a large share of a small model's step on a
    CPU). A non-finite norm (or none given) scans, to name the
    parameter; a non-finite norm whose scan names none (it overflowed) still stops the step.

    Under FSDP each rank holds its own shard of every gradient, so the ranks agree on the first
    offending parameter (one all-reduce), and every rank raises together.

    Raises:
        NonFiniteError: naming the step and the first offending parameter.
    """
    value = float(loss)
    if not math.isfinite(value):
        raise NonFiniteError(
            f"step {step}: loss is {value}; stopping before the optimizer step (last complete checkpoint kept)"
        )
    if grad_norm is not None and math.isfinite(grad_norm):
        return
    named = list(model.named_parameters())
    bad = next(
        (i for i, (_, p) in enumerate(named) if p.grad is not None and not torch.isfinite(local_tensor(p.grad)).all()),
        len(named),
    )
    if is_sharded(model) and torch.distributed.is_initialized():
        flag = torch.tensor([bad], device=named[0][1].device if named else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        bad = int(flag)
    if bad < len(named):
        raise NonFiniteError(
            f"step {step}: gradient of {named[bad][0]} is not finite; stopping before the optimizer step"
        )
    if grad_norm is not None and any(p.grad is not None for _, p in named):  # (DeepSpeed keeps its gradients to itself)
        raise NonFiniteError(f"step {step}: gradient norm is {grad_norm}; stopping before the optimizer step")


def token_weights(counts: torch.Tensor, task_weights: Optional[Sequence[float]] = None) -> torch.Tensor:
    """[num_tasks] weight of one supervised token of each task, from per-task token counts: the
    token mean (1 / N) without `task_weights`, else the `task_weights`-weighted mean of the tasks'
    token means (w_t / (N_t * sum of w over the tasks present)). Which a stage asks for is its
    own business (SFT's loss modes: pipeline.algorithms.multitask.MODES).

    Raises:
        ValueError: task_weights of the wrong length / summing to 0 over present tasks.
    """
    counts = counts.double()
    present = counts > 0
    if task_weights is None:
        total = counts.sum()
        return torch.where(present, 1.0 / total.clamp(min=1), torch.zeros_like(counts))
    w = torch.as_tensor(list(task_weights), dtype=torch.float64, device=counts.device)
    if w.shape != counts.shape:
        raise ValueError(f"task_weights has {w.numel()} entries for {counts.numel()} tasks")
    norm = w[present].sum()
    if present.any() and norm <= 0:
        raise ValueError("task weights of the tasks present in the batch sum to 0")
    return torch.where(present, w / (counts.clamp(min=1) * norm), torch.zeros_like(counts))


@contextlib.contextmanager
def micro_step(accelerator, model: torch.nn.Module, index: int, count: int):
    """Micro-batch `index` of the `count` that make one optimizer step, inside accelerate's
    `accumulate`: `accelerator.sync_gradients` is True only for the last one, so DDP and FSDP
    reduce gradients once per step and DeepSpeed's engine steps once per step (outside
    `accumulate` it is always True, and DeepSpeed would step after every micro-batch).
    `accelerator.backward` divides each loss by `count` (DeepSpeed's engine does the same).
    No accelerator: a plain context.

    Raises:
        ValueError: `count` is not the accelerator's gradient_accumulation_steps.
    """
    if accelerator is None:
        yield
        return
    if accelerator.gradient_accumulation_steps != count:
        raise ValueError(
            f"micro_step: {count} micro-batches per step, but the accelerator accumulates "
            f"{accelerator.gradient_accumulation_steps}"
        )
    # accelerate counts micro-batches since the start; pinning the count keeps it aligned with
    # this optimizer step whatever ran before (an interrupted step, an evaluation).
    accelerator.step = index
    with accelerator.accumulate(model):
        yield


def is_deepspeed(accelerator) -> bool:
    """Whether DeepSpeed's engine runs the step (it clips and steps inside `accelerator.backward`)."""
    return accelerator is not None and getattr(accelerator.state, "deepspeed_plugin", None) is not None


def clip_gradients(model: torch.nn.Module, accelerator, max_norm: float) -> float:
    """Clip the global gradient norm to `max_norm` (0: only measure it); return the norm before
    clipping, the same on every rank."""
    return float(grad_norm_tensor(model, accelerator, max_norm))


def grad_norm_tensor(model: torch.nn.Module, accelerator, max_norm: float) -> torch.Tensor:
    """`clip_gradients` without the host read: the norm stays a 0-d tensor on its device, so a
    step can read it together with its other figures.

    Under FSDP each rank holds the gradients of its own shards (DTensors): the norm over every
    rank's shards comes back as a DTensor, made whole here.
    """
    if is_deepspeed(accelerator):
        # The engine clips and steps inside accelerator.backward (gradient_clipping in the plugin),
        # so under DeepSpeed the non-finite guard cannot run before its step; report its norm.
        norm = model.get_global_grad_norm() if hasattr(model, "get_global_grad_norm") else None
        return torch.as_tensor(float(norm) if norm is not None else 0.0)
    limit = max_norm if max_norm and max_norm > 0 else float("inf")
    params = [p for p in model.parameters() if p.grad is not None]
    if accelerator is not None:
        norm = accelerator.clip_grad_norm_(params, limit)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
    return full_tensor(torch.as_tensor(norm))


def model_inputs(batch: dict, model: Optional[torch.nn.Module] = None) -> dict:
    """The keys of a batch the model's forward takes; for packed rows (`segment_ids`), also what
    keeps each sample inside its own document under `model`'s attention implementation, built on
    the batch's device (pipeline.modeling.attention.document_attention).

    Raises:
        ValueError: a packed batch without the model it is for.
    """
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    if "segment_ids" in batch:
        if model is None:
            raise ValueError("model_inputs: a packed batch (segment_ids) needs the model, to build its attention")
        inputs.update(document_attention(batch["segment_ids"], attention_implementation(model)))
    return inputs


def _shifted_targets(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([B, T-1] labels predicted at each position, supervised mask, task ids: -1 where unsupervised).
    A batch without `task_ids` is one task (0)."""
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE_INDEX
    tasks = batch.get("task_ids")
    tasks = torch.zeros_like(labels) if tasks is None else tasks[:, 1:].to(labels.device)
    return labels, mask, torch.where(mask, tasks, torch.full_like(tasks, -1))


def full_logits_token_losses(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy (fp32) from the full `[B, T, V]` logits: the reference path, and the
    one run where `supervised_head.head_split` declines the model (sharded engines, heads that are
    not a plain linear layer). Returns ([B, T-1] losses, 0 where unsupervised; [B, T-1] task ids)."""
    logits = model(**model_inputs(batch, model), use_cache=False).logits[:, :-1, :]
    labels, mask, tasks = _shifted_targets(batch)
    losses = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).clamp(min=0), reduction="none"
    ).view(labels.shape)
    return torch.where(mask, losses, torch.zeros_like(losses)), tasks


def weighted_token_losses(
    model: torch.nn.Module, batch: dict, weights: Optional[torch.Tensor] = None, accelerator=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(objective, [B, T-1] fp32 losses, [B, T-1] task ids) for one micro-batch, where objective =
    sum over supervised tokens of weights[task] * loss (0 when `weights` is None).

    The LM head and the cross-entropy run at supervised positions only, in chunks, with the
    gradient formed in the same pass (`pipeline.engine.supervised_head`), wherever that is exact;
    otherwise from the full logits. The per-token losses are detached on the first path (they are
    figures; the objective carries the gradient) and differentiable on the second.
    """
    labels, mask, tasks = _shifted_targets(batch)
    coef = (
        torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
        if weights is None
        else torch.where(
            mask, weights.to(labels.device, torch.float32)[tasks.clamp(min=0)], torch.zeros((), device=labels.device)
        )
    )
    head = head_split(model, accelerator)
    if head is not None:
        objective, losses = supervised_forward(model, model_inputs(batch, model), head, labels.clamp(min=0), mask, coef)
        return objective, losses, tasks
    losses, tasks = full_logits_token_losses(model, batch)
    return (losses * coef).sum(), losses, tasks


def token_losses(model: torch.nn.Module, batch: dict, accelerator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy (fp32, detached on the fast path) and the task index of each predicted token.

    Returns ([B, T-1] losses, 0 where unsupervised; [B, T-1] task ids, -1 where unsupervised).
    A batch without `task_ids` is one task (0).
    """
    _, losses, tasks = weighted_token_losses(model, batch, None, accelerator)
    return losses, tasks


def supervised_counts(batches: Sequence[dict], num_tasks: int) -> torch.Tensor:
    """[num_tasks] supervised-token counts per task over `batches` (float64 for exact sums), on the
    batches' device: a one-hot sum needs no host read (a boolean index or bincount would sync)."""
    counts = None
    for batch in batches:
        labels = batch["labels"][:, 1:]
        tasks = batch.get("task_ids")
        tasks = torch.zeros_like(labels) if tasks is None else tasks[:, 1:]
        valid = (labels != IGNORE_INDEX) & (tasks >= 0) & (tasks < num_tasks)
        hot = F.one_hot(tasks.clamp(0, num_tasks - 1), num_tasks) * valid.unsqueeze(-1)
        part = hot.sum((0, 1)).double()
        counts = part if counts is None else counts + part.to(counts.device)
    return counts if counts is not None else torch.zeros(num_tasks, dtype=torch.float64)


@dataclass
class StepOut:
    """What `optimizer_step` read back: the gradient norm before clipping and the step's figures
    (float64, on the host; figures[0] is the loss that was checked finite)."""

    grad_norm: float
    figures: torch.Tensor


def optimizer_step(
    model: torch.nn.Module,
    optimizer,
    accelerator,
    count: int,
    micro_batch: Callable[[int], torch.Tensor | float],
    *,
    step: int,
    max_grad_norm: float,
    figures: Optional[Callable[[], torch.Tensor]] = None,
) -> StepOut:
    """One optimizer step, the same in every stage: `micro_batch(index)` runs micro-batch `index`
    of `count` (its forward and `accelerator.backward`, inside accelerate's accumulation context
    here) and returns its loss; then the gradients are clipped to `max_grad_norm` (0: measured
    only), checked finite, stepped and zeroed. The caller steps the scheduler (once per engine
    step: GRPO's iterations take several optimizer steps in one).

    The host is read once, at the end: `figures()` (a 1-D tensor on any device whose first
    element is the loss to check; default: the sum of the micro-batches' losses) together with
    the gradient norm. A .cpu() or float() per micro-batch is a device sync each on a GPU.

    Raises:
        NonFiniteError: a non-finite loss or gradient (the optimizer has not stepped).
    """
    losses = []
    for index in range(count):
        with micro_step(accelerator, model, index, count):
            losses.append(micro_batch(index))
    vector = figures() if figures is not None else _summed(losses).view(1)
    norm = grad_norm_tensor(model, accelerator, max_grad_norm)
    read = torch.cat([vector.detach().double().flatten(), norm.detach().to(vector.device, torch.float64).view(1)]).cpu()
    grad_norm = float(read[-1])
    check_finite(read[0], model, step, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOut(grad_norm, read[:-1])


def _summed(values: Sequence[torch.Tensor | float]) -> torch.Tensor:
    """The sum of losses given as tensors (on one device) or numbers, as a float64 tensor there."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for v in values:
        total = total + (v.detach().double() if isinstance(v, torch.Tensor) else float(v))
    return total


def rank_mean(values: dict[str, float], accelerator, totals: Collection[str] = ()) -> dict[str, float]:
    """Each figure's mean over ranks (itself on one process), the ones named in `totals` summed
    over ranks instead (counts of the whole step): one all-reduce for all of them."""
    if accelerator is None or accelerator.num_processes == 1 or not values:
        return dict(values)
    keys = sorted(values)
    sums = all_reduce_sum(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64), accelerator)
    return {k: v if k in totals else v / accelerator.num_processes for k, v in zip(keys, sums.tolist())}


def pooled_means(means: torch.Tensor, counts: torch.Tensor, accelerator) -> torch.Tensor:
    """Figures that are means over each micro-batch's own items (`means` [M, F]; `counts` [M, F] or
    [M], the items each mean is over: response tokens, or sequences) as the means over every
    micro-batch's items on every rank ([F], on the device, one all-reduce): what the step reads
    whatever its split into micro-batches and ranks (a mean of micro-batch means is not: it weighs
    a short micro-batch's items more)."""
    counts = counts.to(means.device, means.dtype)
    counts = counts if counts.dim() == 2 else counts[:, None].expand_as(means)
    sums = all_reduce_sum(torch.cat([(means * counts).sum(0), counts.sum(0)]), accelerator)
    width = means.shape[1]
    return sums[:width] / sums[width:].clamp(min=1.0)


def all_reduce_sum(tensor: torch.Tensor, accelerator) -> torch.Tensor:
    """Sum of `tensor` over ranks (itself on one process)."""
    if accelerator is None or accelerator.num_processes == 1:
        return tensor
    return accelerator.reduce(tensor.to(accelerator.device), reduction="sum").to(tensor.device)


@dataclass
class StepResult:
    """What one optimizer step measured (already reduced over ranks)."""

    loss: float
    task_losses: list[float]
    task_tokens: list[float]
    grad_norm: float
    tokens: int


def lm_train_step(
    model: torch.nn.Module,
    optimizer,
    micro_batches: Sequence[dict],
    accelerator,
    *,
    step: int,
    num_tasks: int = 1,
    task_weights: Optional[Sequence[float]] = None,
    max_grad_norm: float = 0.0,
) -> StepResult:
    """One optimizer step over this rank's micro-batches with token-normalised accumulation; each
    token weighs `token_weights(counts of the whole step, task_weights)`.

    Backward runs per micro-batch (memory stays one micro-batch) inside `micro_step`. Gradients are clipped to
    `max_grad_norm` (0: measured, not clipped), checked finite,
    then the optimizer steps. The caller steps the scheduler.

    Raises:
        NonFiniteError: loss or gradients not finite (the optimizer has not stepped).
    """
    counts = all_reduce_sum(supervised_counts(micro_batches, num_tasks), accelerator)
    weights = token_weights(counts, task_weights)
    world = accelerator.num_processes if accelerator is not None else 1
    # The weights already normalise over the whole step: undo accelerate's division by the number
    # of micro-batches and DDP's average over ranks.
    scale = float(world * len(micro_batches)) if accelerator is not None else 1.0
    # The figures stay on the model's device until the step's end (optimizer_step reads them
    # once, with the gradient norm): [objective, per-task loss sums..., real tokens], float64.
    state: dict = {}

    def micro_batch(index: int) -> torch.Tensor:
        batch = micro_batches[index]
        autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
        with autocast:
            loss, losses, tasks = weighted_token_losses(model, batch, weights, accelerator)
        if accelerator is not None:
            accelerator.backward(loss * scale)
        else:
            (loss * scale).backward()
        if "figures" not in state:
            state["figures"] = torch.zeros(num_tasks + 2, dtype=torch.float64, device=loss.device)
        figures, valid = state["figures"], tasks >= 0
        figures[0] += loss.detach().double()
        figures[1:-1].index_add_(
            0, tasks.clamp(min=0).flatten(), torch.where(valid, losses.detach().double(), 0.0).flatten()
        )
        figures[-1] += (batch["task_ids"] >= 0).sum() if "task_ids" in batch else batch["input_ids"].numel()
        return loss

    def step_figures() -> torch.Tensor:
        figures = state.get("figures", torch.zeros(num_tasks + 2, dtype=torch.float64))
        figures = all_reduce_sum(figures, accelerator)  # one all-reduce for every figure
        return torch.cat([figures, counts.to(figures.device)])

    out = optimizer_step(
        model,
        optimizer,
        accelerator,
        len(micro_batches),
        micro_batch,
        step=step,
        max_grad_norm=max_grad_norm,
        figures=step_figures,
    )
    totals, grad_norm = out.figures, out.grad_norm
    objective, loss_sums, tokens = totals[0], totals[1 : num_tasks + 1], int(totals[num_tasks + 1])
    counts = totals[num_tasks + 2 :]
    task_losses = [float(loss_sums[t] / counts[t]) if counts[t] > 0 else float("nan") for t in range(num_tasks)]
    return StepResult(float(objective), task_losses, counts.tolist(), grad_norm, tokens)
