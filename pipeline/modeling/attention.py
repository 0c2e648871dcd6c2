"""Per-document attention for packed rows: the one place that turns a batch's segment ids into what
the model's attention implementation needs, built where the segment ids are (the model's device).

A packed batch (data_formats.collate) carries `segment_ids` [B, T]: which document of its row each
slot holds (the padding tail is a document of its own), so no token may attend across a change of
segment id, whatever the batch size. What each implementation gets:

- flash_attention_2 (and 3): no mask; the varlen kwargs `cu_seq_lens_q/k`, `max_length_q/k` over
  the whole flattened batch, as TRL's padding-free collator passes them. transformers infers
  packing from `position_ids` only at batch size 1 (`_is_packed_sequence`); with more rows it ran
  plain causal attention over each row, so documents sharing a row attended to each other.
- flex_attention: a document `BlockMask`, so the kernel skips every block that crosses documents.
- sdpa: a [B, 1, T, T] boolean block-causal mask (True = attend); eager: the same as an additive
  float32 mask (0 or the float32 minimum, which promotes correctly when added to bf16/fp16 scores).
  transformers passes a 4D mask through unchanged (masking_utils: "If the mask is already 4D,
  simply return as-is"); position_ids alone do not stop sdpa/eager from attending to earlier
  documents of a row.
"""

from __future__ import annotations

import torch

VARLEN = ("flash_attention_2", "flash_attention_3")
MASKED = ("sdpa", "eager")
FLEX = "flex_attention"


def attention_implementation(model: torch.nn.Module) -> str:
    """The transformers attention implementation a (possibly wrapped) model runs: through DDP's or
    DeepSpeed's `.module` and PEFT's base model to the config's `_attn_implementation`.

    Raises:
        ValueError: no transformers config found on the model.
    """
    inner = model
    while isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    if hasattr(inner, "get_base_model"):
        inner = inner.get_base_model()
    name = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if not isinstance(name, str):
        raise ValueError(
            f"packed batch: cannot tell which attention {type(model).__name__} runs (no config._attn_implementation)"
        )
    return name


def block_causal_mask(segments: torch.Tensor, attn_implementation: str = "sdpa") -> torch.Tensor:
    """[B, 1, T, T] mask letting each token attend to itself and earlier tokens of its own segment,
    on `segments`' device: boolean for sdpa, additive float32 for eager.

    Raises:
        ValueError: an implementation that takes no dense 4D mask.
    """
    t = segments.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    allowed = ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=segments.device)
        return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)
    raise ValueError(f"no dense 4D mask for attn_implementation {attn_implementation!r} (sdpa or eager)")


def varlen_kwargs(segments: torch.Tensor) -> dict:
    """flash-attention's varlen kwargs for the batch flattened to one sequence of B*T tokens:
    `cu_seq_lens_q/k` (int32, the offset where each document starts, then B*T) and
    `max_length_q/k`.

    Every row boundary starts a document, and so does every change of segment id within a row.
    `max_length` is the row width, a bound every document meets (no document spans rows); an exact
    maximum would cost a device sync, and the bound only adds blocks that return at once. The
    document starts are data-dependent in number, so `nonzero` costs one sync per forward (the
    inferred path from position_ids costs one in every layer).
    """
    b, t = segments.shape
    flat = segments.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::t] = True
    total = torch.full((1,), b * t, dtype=torch.int32, device=segments.device)
    cu = torch.cat([starts.nonzero().view(-1).to(torch.int32), total])
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": t, "max_length_k": t}


def document_block_mask(segments: torch.Tensor):
    """flex attention's `BlockMask` of per-document causal attention, on `segments`' device.
    Compiled mask construction on CUDA (as transformers builds its own), eager elsewhere, where
    compiling costs more than it saves."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, t = segments.shape

    def document_causal(batch, head, q, kv):
        return (segments[batch, q] == segments[batch, kv]) & (q >= kv)

    return create_block_mask(
        document_causal, B=b, H=None, Q_LEN=t, KV_LEN=t, device=segments.device, _compile=segments.device.type == "cuda"
    )


def document_attention(segments: torch.Tensor, attn_implementation: str) -> dict:
    """The forward kwargs that keep every token inside its own document for `attn_implementation`
    (see the module docstring), built on `segments`' device.

    Raises:
        ValueError: an implementation this module does not know.
    """
    if attn_implementation in VARLEN:
        return varlen_kwargs(segments)
    if attn_implementation == FLEX:
        return {"attention_mask": document_block_mask(segments)}
    if attn_implementation in MASKED:
        return {"attention_mask": block_causal_mask(segments, attn_implementation)}
    raise ValueError(
        f"packed rows: no per-document attention for attn_implementation {attn_implementation!r} "
        f"(one of {', '.join(MASKED + VARLEN + (FLEX,))})"
    )
