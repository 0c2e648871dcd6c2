"""oneDNN's fp32 linear product as an op and as an autograd function: the primitives that
`onednn` (where each is used) and `cpu_kernels` (which times them against torch's default GEMM)
both need, apart so that neither imports the other's policy."""

from __future__ import annotations

from typing import Optional

import torch


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ weight.T + bias through oneDNN's fp32 kernel (a plain or prepacked weight, any leading shape)."""
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), weight, bias, "none", [], "")
    return out.reshape(*shape[:-1], out.shape[-1])


class OneDNNLinear(torch.autograd.Function):
    """`F.linear` with oneDNN's fp32 kernel forward and backward (the input's and the weight's
    gradients): where it pays (`cpu_kernels`; speeds in bench/RESULTS.md), the same fp32 math in
    another summation order (both within fp32 rounding of a float64 product)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(grad, weight.t().contiguous(), None)
        if ctx.needs_input_grad[1]:  # grad_out.T @ x, as oneDNN's x.T-weighted product of grad_out.T
            grad_w = torch.ops.mkldnn._linear_pointwise(
                flat.t().contiguous(), x.reshape(-1, x.shape[-1]).t().contiguous(), None, "none", [], ""
            )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat.sum(0)
        return grad_x, grad_w, grad_b
