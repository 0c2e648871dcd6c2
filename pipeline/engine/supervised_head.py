"""The LM head and cross-entropy only where a label is supervised, in chunks, with the gradient
computed in the same pass: the full `[B, T, V]` logits of a batch never exist.

A causal LM's forward ends in `logits = lm_head(hidden)`; in an SFT batch most positions carry no
label (system and user turns, padding), yet the usual path multiplies every position by the
`[V, H]` head, keeps the fp32 logits, a log-softmax of the same size for the backward, and its
gradient (each 4 * B * T * V bytes: 400 MB for 4 x 512 tokens of a 49k vocabulary).

Here the backbone runs through the model's own forward (so DDP's hooks, gradient checkpointing
and PEFT adapters behave as always) with the head swapped for the identity, which returns the
final hidden states; `fused_weighted_cross_entropy` then takes the rows with a label, `chunk`
rows at a time, and computes each row's loss and, because the objective is a weighted sum
`sum_t c_t * CE_t` with weights known before the forward, also its gradient
`c_t * (softmax_t - onehot_t)` in the same chunk: the gradients with respect to the hidden rows
(and to the head's weight when it trains) are kept, the chunk's logits are freed. Backward then
only scales the kept gradients. Memory: `chunk x V` floats instead of several `B x T x V`;
compute: the head at supervised rows only. The result equals the full-logits path within fp32
rounding (tests/test_supervised_head.py checks losses and gradients).

The path is taken only where it is exact and safe (`head_split`): the output head is a plain
`nn.Linear` and the model's logits are exactly `head(hidden)` (checked once per model on a tiny
input, so post-processed logits such as Gemma's soft-capping fall back), and no sharded engine
(FSDP, DeepSpeed) owns the head's weight. Elsewhere the full-logits path runs.

The RL stages (PPO, GRPO) take the same path for their log-probs (`sampled_token_logps`): the
log-prob of each sampled token at the sampling temperature, and its distribution's entropy where
asked, chunk by chunk from the backbone's hidden states (pipeline.rl.rollout.policy_logprobs);
at Qwen's 151936-token vocabulary the `[B, R, V]` logits of a 4096-token micro-batch are 2.5 GB
each, and the full path keeps several (logits, their log-softmax, its gradient).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

CHUNK_ROWS = 1024
"""Supervised rows per chunk: 1024 x 49152 fp32 logits = 200 MB transient at most."""


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The head's matmul dtype: autocast's where it is on (as the model's own head would run), else
    the weight's. Softmax and losses are fp32 either way."""
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


def _add_chunk_grads(
    grad: torch.Tensor,
    h: torch.Tensor,
    w: torch.Tensor,
    dtype: torch.dtype,
    rows: slice,
    grad_h: Optional[torch.Tensor],
    grad_w: Optional[torch.Tensor],
    grad_b: Optional[torch.Tensor],
) -> None:
    """Add one chunk's gradients from d(loss)/d(logits) `grad` to those asked for (None: not asked)."""
    if grad_h is not None:
        grad_h[rows] = (grad.to(dtype) @ w).to(grad_h.dtype)
    if grad_w is not None:
        grad_w.add_(grad.t().to(dtype) @ h)
    if grad_b is not None:
        grad_b.add_(grad.sum(0))


class _FusedWeightedCE(torch.autograd.Function):
    """sum_t coef_t * CE(hidden_t @ W.T + b, label_t), with per-row losses as a second,
    non-differentiable output; gradients computed in forward, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, coef, chunk):
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        device, dtype = hidden.device, _compute_dtype(hidden, weight)
        n = hidden.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_b else None
        with torch.autocast(device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            for start in range(0, n, chunk):
                h = hidden[start : start + chunk].to(dtype)
                y = labels[start : start + chunk]
                logits = F.linear(h, w, b).float()
                lse = torch.logsumexp(logits, dim=-1)
                losses[start : start + chunk] = lse - logits.gather(1, y.unsqueeze(1)).squeeze(1)
                if need_h or need_w or need_b:
                    grad = logits.sub_(lse.unsqueeze(1)).exp_()
                    grad[torch.arange(grad.shape[0], device=device), y] -= 1.0
                    grad.mul_(coef[start : start + chunk].unsqueeze(1))
                    _add_chunk_grads(grad, h, w, dtype, slice(start, start + chunk), grad_h, grad_w, grad_b)
                del logits
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.has = (need_h, need_w, need_b)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(losses)
        return (losses.double() * coef.double()).sum().float(), losses

    @staticmethod
    def backward(ctx, grad_sum, _grad_losses):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        need_h, need_w, need_b = ctx.has
        return (
            grad_h * grad_sum.to(grad_h.dtype) if need_h else None,
            (grad_w * grad_sum).to(ctx.weight_dtype) if need_w else None,
            (grad_b * grad_sum).to(ctx.weight_dtype) if need_b else None,
            None,
            None,
            None,
        )


def fused_weighted_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, coef: torch.Tensor, chunk: int = CHUNK_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_t coef_t * CE_t, [N] fp32 per-row losses) for `hidden` [N, H] rows with `labels` [N].

    The sum is differentiable (with respect to `hidden` and the head's parameters); the per-row
    losses are for logging. `coef` [N] is fixed (not differentiated).
    """
    return _FusedWeightedCE.apply(hidden, head.weight, head.bias, labels, coef.detach().float(), chunk)


def _chunk_logp(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], temperature: float) -> torch.Tensor:
    """One chunk's fp32 log-softmax of `h @ w.T + b` at `temperature`: the same operations, in the
    same order, as `log_softmax(logits.float() / temperature)` on the full logits (the RL stages'
    `rl.logprobs_from_logits`), so each row's numbers are those of that path."""
    logits = F.linear(h, w, b).float()
    if temperature != 1.0:
        logits = logits / temperature
    return F.log_softmax(logits, dim=-1)


class _ChunkedTokenLogps(torch.autograd.Function):
    """log p(label_t) of each row at a sampling temperature, computed chunk by chunk, with each
    row's entropy as a second, non-differentiable output when asked (an empty tensor otherwise);
    the backward recomputes each chunk's logits from the saved rows (`chunk x V` floats alive at a
    time, never `N x V`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, temperature, entropy):
        device, dtype = hidden.device, _compute_dtype(hidden, weight)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=device)
        ent = torch.empty(hidden.shape[0] if entropy else 0, dtype=torch.float32, device=device)
        with torch.autocast(device.type, enabled=False):
            w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                logp = _chunk_logp(hidden[rows].to(dtype), w, b, temperature)
                out[rows] = logp.gather(1, labels[rows].unsqueeze(1)).squeeze(1)
                if entropy:  # rl.entropy_from_logits' formula
                    ent[rows] = -(logp.exp() * logp).sum(-1)
                del logp
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunk, ctx.dtype, ctx.temperature = chunk, dtype, temperature
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_ent):
        hidden, weight, bias, labels = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        dtype, chunk, device, temperature = ctx.dtype, ctx.chunk, hidden.device, ctx.temperature
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=device) if need_b else None
        with torch.autocast(device.type, enabled=False):
            w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h = hidden[rows].to(dtype)
                # d logp_t / d logits = (onehot(y_t) - softmax_t) / temperature, times the incoming gradient.
                grad = _chunk_logp(h, w, b, temperature).exp_().neg_()
                grad[torch.arange(grad.shape[0], device=device), labels[rows]] += 1.0
                grad.mul_((grad_out[rows].float() / temperature).unsqueeze(1))
                _add_chunk_grads(grad, h, w, dtype, rows, grad_h, grad_w, grad_b)
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
        )


def token_logps(
    hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, chunk: int = CHUNK_ROWS
) -> torch.Tensor:
    """[N] fp32 log p(labels_t) of `hidden` [N, H] rows under `head`, differentiable (the
    backward recomputes each chunk's logits rather than keeping them)."""
    return _ChunkedTokenLogps.apply(hidden, head.weight, head.bias, labels, chunk, 1.0, False)[0]


def chunk_rows(vocab: int) -> int:
    """Rows per chunk for a `vocab`-wide head: CHUNK_ROWS at a 49k vocabulary, fewer at wider ones
    (Qwen's 151936: 331 rows, the same ~200 MB of fp32 logits per chunk)."""
    return max(1, CHUNK_ROWS * 49152 // vocab)


def sampled_token_logps(
    hidden: torch.Tensor, head: torch.nn.Linear, tokens: torch.Tensor, temperature: float, entropy: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """([N] fp32 log p(tokens_t) under softmax(head(hidden_t) / temperature), differentiable with
    respect to `hidden` [N, H] and the head; [N] fp32 entropies of those distributions, without
    gradient, when `entropy`, else None). The RL stages' log-probs and entropies without the
    `[N, V]` logits: equal to `rl.logprobs_from_logits` / `rl.entropy_from_logits` on the full
    logits row for row (tests/test_rl_logprobs.py)."""
    logp, ent = _ChunkedTokenLogps.apply(
        hidden, head.weight, head.bias, tokens, chunk_rows(head.weight.shape[0]), float(temperature), entropy
    )
    return logp, ent if entropy else None


def labelled_token_logps(
    model: torch.nn.Module, inputs: dict, head: torch.nn.Linear, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T-1] fp32 log-prob of each labelled token, 0 elsewhere; [B, T-1] bool mask of them) for
    HF-aligned `labels` [B, T] (the logits at t-1 predict labels[t], -100 where nothing is scored):
    the head runs at labelled positions only."""
    causal = _unwrapped_causal_lm(model)
    with _hidden_states_as_logits(causal, head):
        hidden = model(**inputs, use_cache=False).logits[:, :-1, :]
    shifted = labels[:, 1:]
    mask = shifted != -100
    rows = token_logps(hidden[mask], head, shifted[mask])
    out = torch.zeros(shifted.shape, dtype=rows.dtype, device=rows.device)
    return out.masked_scatter(mask, rows), mask


def _unwrapped_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside DDP (`.module`) and PEFT (`get_base_model()`) wrappers."""
    inner = getattr(model, "module", model)
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    return inner


def _is_sharded(accelerator) -> bool:
    return accelerator is not None and accelerator.distributed_type.name in ("FSDP", "DEEPSPEED", "XLA", "MEGATRON_LM")


@contextlib.contextmanager
def _hidden_states_as_logits(causal: torch.nn.Module, head: torch.nn.Module):
    """The model's forward returns its final hidden states as `.logits` (head swapped for the identity)."""
    causal.set_output_embeddings(torch.nn.Identity())
    try:
        yield
    finally:
        causal.set_output_embeddings(head)


@contextlib.contextmanager
def hidden_states_as_logits(model: torch.nn.Module, head: torch.nn.Module):
    """`model`'s forward (through its DDP / PEFT wrappers) returns its final hidden states as
    `.logits` for the body, at the positions `logits_to_keep` keeps."""
    with _hidden_states_as_logits(_unwrapped_causal_lm(model), head):
        yield


def head_split(model: torch.nn.Module, accelerator=None) -> Optional[torch.nn.Linear]:
    """The model's output head when the supervised-rows path is exact and safe for it, else None.

    Exactness is checked once per model (cached on it): on a 1 x 4 input in eval mode, the
    logits must equal `head(final hidden states)`.
    """
    from pipeline.engine.fsdp import is_sharded

    if _is_sharded(accelerator) or is_sharded(model):
        return None
    causal = _unwrapped_causal_lm(model)
    if not hasattr(causal, "get_output_embeddings") or not hasattr(causal, "set_output_embeddings"):
        return None
    head = causal.get_output_embeddings()
    if type(head) is not torch.nn.Linear or any(hasattr(p, "ds_id") for p in head.parameters()):
        return None  # a LoRA'd or otherwise wrapped head; ZeRO-3's partitioned weight (gathered by module hooks only)
    if model is not causal and hasattr(model, "module") and head.weight.requires_grad:
        # DDP: a trainable head used outside the wrapper's forward is fine unless it is only
        # reachable there (an untied head); the tied case shares the input embedding.
        embeddings = causal.get_input_embeddings() if hasattr(causal, "get_input_embeddings") else None
        if embeddings is None or embeddings.weight is not head.weight:
            return None
    verdict = getattr(causal, "_relay_head_split_exact", None)
    if verdict is None:
        verdict = _check_exact(model, causal, head)
        causal._relay_head_split_exact = verdict
    return head if verdict else None


@torch.no_grad()
def _check_exact(model: torch.nn.Module, causal: torch.nn.Module, head: torch.nn.Linear) -> bool:
    from pipeline.modeling.models import eval_mode

    vocab = head.weight.shape[0]
    device = head.weight.device
    ids = torch.tensor([[1, 2, 3, 4]], device=device) % vocab
    mask = torch.ones_like(ids)
    with eval_mode(model):
        try:
            full = causal(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
            with _hidden_states_as_logits(causal, head):
                hidden = causal(input_ids=ids, attention_mask=mask, use_cache=False).logits
            mine = head(hidden).float()
        except Exception:  # any model this path cannot drive runs the full-logits path
            return False
    return full.shape == mine.shape and torch.allclose(full, mine, rtol=1e-4, atol=1e-4)


def supervised_forward(
    model: torch.nn.Module,
    inputs: dict,
    head: torch.nn.Linear,
    labels: torch.Tensor,
    mask: torch.Tensor,
    coef: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `model` on `inputs` and return (sum_t coef_t * CE_t over the masked positions, [B, T-1]
    fp32 per-token losses, 0 where unmasked, detached).

    `labels`, `mask` and `coef` are [B, T-1]: the label predicted at each position (shifted), which
    positions are supervised, and each supervised token's weight in the objective.
    """
    causal = _unwrapped_causal_lm(model)
    with _hidden_states_as_logits(causal, head):
        hidden = model(**inputs, use_cache=False).logits[:, :-1, :]
    objective, rows = fused_weighted_cross_entropy(hidden[mask], head, labels[mask], coef[mask])
    losses = torch.zeros(labels.shape, dtype=torch.float32, device=rows.device)
    losses[mask] = rows
    return objective, losses


def chunked_rows(
    fn: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    head: Optional[torch.nn.Linear],
    *rows: torch.Tensor,
    chunk: Optional[int] = None,
) -> torch.Tensor:
    """[N] fp32 values of `fn(logits, *row_chunks)` over `hidden` [N, H] rows under `head`,
    `chunk` rows at a time (default: ~200 MB of fp32 logits per chunk); differentiable, and each
    chunk's logits are recomputed in the backward (activation checkpointing per chunk), so
    `chunk x V` logits are alive at a time, never `N x V`. `fn` maps one chunk's fp32 logits
    [c, V] and the same rows of each of `rows` (a teacher's hidden rows, sampled tokens) to [c]
    values: a per-token divergence whose gradient is not known before the forward, unlike the
    cross-entropy of `fused_weighted_cross_entropy`. `head` None: `hidden` already holds logits
    (a model the chunked head cannot drive, `head_split`)."""
    from torch.utils.checkpoint import checkpoint

    if head is None:
        return torch.cat(
            [fn(hidden[s].float(), *(r[s] for r in rows)) for s in _row_slices(hidden, chunk, hidden.shape[-1])]
            or [hidden.new_zeros(0, dtype=torch.float32)]
        )
    weight, bias = head.weight, head.bias

    def one(h: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(h, weight)
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).float()
            return fn(logits, *parts)

    out = [
        checkpoint(one, hidden[s], *(r[s] for r in rows), use_reentrant=False)
        for s in _row_slices(hidden, chunk, weight.shape[0])
    ]
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def _row_slices(hidden: torch.Tensor, chunk: Optional[int], vocab: int) -> list[slice]:
    size = chunk or max(1, CHUNK_ROWS * 49152 // vocab)
    return [slice(start, start + size) for start in range(0, hidden.shape[0], size)]


def hidden_forward(model: torch.nn.Module, head: torch.nn.Module, **inputs) -> torch.Tensor:
    """`model(**inputs)` with its final hidden states in place of the logits (the head swapped for
    the identity for the forward, through DDP / PEFT wrappers, so their hooks run as always): the
    rows `chunked_rows` takes. `logits_to_keep` in `inputs` keeps those positions as usual."""
    with _hidden_states_as_logits(_unwrapped_causal_lm(model), head):
        return model(**inputs).logits
