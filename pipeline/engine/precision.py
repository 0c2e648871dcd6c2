"""Master weights: under bf16/fp16 autocast the trainable weights (and so the optimizer's state)
are kept in fp32, whatever dtype the model was loaded in. A bf16 weight of magnitude 1 cannot take
an update smaller than 2^-8 of it: a small learning rate's steps round away. DeepSpeed keeps fp32
masters of its own; this makes the other engines (one process, DDP, FSDP) agree with it.
`train.precision: bf16-pure` keeps the loaded dtype, for memory."""

from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)


def keeps_masters(precision: str, mixed: str) -> bool:
    """Whether trainable weights get fp32 masters: `mixed` is accelerate's resolved
    mixed_precision (engine.accelerator.resolve_precision); 'bf16-pure' opts out."""
    return precision != "bf16-pure" and mixed in ("bf16", "fp16")


def fp32_masters(model: torch.nn.Module) -> int:
    """Cast every trainable half-precision parameter of `model` to fp32 in place (frozen weights,
    a LoRA run's base, keep their dtype); returns how many were cast."""
    cast = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype in HALF:
            p.data = p.data.float()
            cast += 1
    return cast
