"""oneDNN's fp32 linear kernels on a CPU: prepacked weights for decoding (`packed_linears`) and an
autograd linear for training forwards and backwards (`onednn_linears`).

    with packed_linears(model):   # decode.generate: no-grad fp32 forwards on prepacked weights
        ...
    with onednn_linears(model):   # Stage.fast_linears: train steps and evaluations
        ...

On some CPUs oneDNN's fp32 kernel is about twice as fast as torch's default GEMM (MKL) at training
shapes and faster still on a prepacked weight at decode shapes (bench/RESULTS.md, "CPU kernel
choices"). Same fp32 math, another summation order.

Training (`OneDNNLinear`, `onednn_linears`): every plain fp32 `nn.Linear` runs oneDNN's kernel
forward and for both gradients (the input's and, where it trains, the weight's).

Decoding (`packed_linears`): at the batch sizes of decoding (a few rows a step) a decode step is a stream of the weights
through matrix-vector-like products, and oneDNN's kernel streams a weight reordered once into its
blocked layout faster than MKL's fp32 GEMM streams the plain one. Three things
make the engine's steps cheaper than a plain forward, each the same math in another summation
order (logits agree with a plain forward to ~1e-6, not bit for bit):

- **Prepacking.** Every plain `nn.Linear` runs `mkldnn._linear_pointwise` on its prepacked weight.
- **LoRA folded into the packed weight.** A vanilla peft LoRA layer whose adapters are active decodes
  on one packed W + sum(scaling * B @ A) instead of the base product plus two small products and
  peft's per-call Python (LoRA's decode overhead was about as large as the base model's step). The
  base weight is not touched (nothing is merged into the model); with the adapter disabled
  (`adapter_disabled`, the reference policy) the layer decodes on its base weight.
- **Sibling projections fused.** q/k/v of an attention block and gate/up of an MLP read the same
  input: they run as one product over their concatenated weights, and each sibling takes its
  slice. Fewer, larger products stream the weights faster.

Lifetime: a packing whose every weight is frozen (`requires_grad=False`: a LoRA base, a served
model) is kept on its module and reused while those weights are unchanged (their version and
storage); any other (a trainable weight, a LoRA adapter in training) is built on first use inside
the context and dropped at its exit. The RL samplers keep nothing (`keep=False`): the update
between two rollouts is the step's peak of memory, and a kept copy of the frozen head (113 MB for
the embedded model) would sit in it; repacking it costs ~20 ms a rollout. The fused optimizers
may update a weight without bumping its version, which is why trainable weights are never cached.

Anything else keeps its own forward: quantised or non-fp32 layers, LoRA variants (DoRA, ...),
LoRA with biases, calls with grad enabled or mixed-adapter batches, and any layer whose forward
something else already replaced on the instance (accelerate's offload hooks, another wrapper).
Each path is taken where it pays on the CPU it runs on (pipeline/modeling/cpu_kernels.py: a
one-time paired micro-measurement per machine; where MKL is as fast as oneDNN at training shapes,
`onednn_linears` stands aside; the measured CPU kinds are in bench/RESULTS.md). RELAY_CPU_ONEDNN,
RELAY_DECODE_PACKED and RELAY_DECODE_FUSED force a path on (1) or off (0).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch

from pipeline.modeling.cpu_kernels import choice
from pipeline.modeling.onednn_ops import OneDNNLinear, onednn_linear

FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Child layers of one module that read the same input (Llama, Qwen2, Mistral, Gemma names)."""


def cpu_fp32(model: torch.nn.Module) -> bool:
    """A CPU model in fp32 with oneDNN available: where oneDNN's paths can apply at all."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def packing_enabled(model: torch.nn.Module) -> bool:
    """Prepack a CPU model in fp32 where prepacked decoding pays on this CPU
    (`cpu_kernels.choice("decode_packed")`; RELAY_DECODE_PACKED=1/0 forces it)."""
    return cpu_fp32(model) and choice("decode_packed")


def lora_layer_type():
    """peft's LoRA `Linear` class, or None while peft is not imported: no module can be one of its
    layers then, and importing it (bitsandbytes with it, which sets up torch.compile) costs
    seconds that decoding a plain model (chat, serve, a gold table of merged models) need not pay."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.lora.layer import Linear

    return Linear


def is_plain_linear(module: torch.nn.Module) -> bool:
    return type(module) is torch.nn.Linear and module.weight.dtype == torch.float32


def is_vanilla_lora(module: torch.nn.Module) -> bool:
    """A peft LoRA Linear this module can fold: an fp32 plain base, every adapter plain (no variant
    such as DoRA, no biases, no fan-in/fan-out transpose)."""
    lora = lora_layer_type()
    if lora is None or type(module) is not lora or not is_plain_linear(module.base_layer):
        return False
    if module.fan_in_fan_out or getattr(module, "lora_variant", {}):
        return False
    return all(
        type(m) is torch.nn.Linear and m.bias is None and m.weight.dtype == torch.float32
        for adapters in (module.lora_A, module.lora_B)
        for m in adapters.values()
    )


class Member:
    """One layer of a packing: where its effective weight comes from and when it may use it."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.lora = is_vanilla_lora(module)
        self.adapters = tuple(a for a in module.active_adapters if a in module.lora_A) if self.lora else ()
        base = module.base_layer if self.lora else module
        self.base = base
        self.out_features = base.out_features

    def applies(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call computes exactly what the packed weight holds."""
        if args or torch.is_grad_enabled():
            return False
        if not self.lora:
            return not kwargs
        m = self.module
        dropping = m.training and any(getattr(m.lora_dropout[a], "p", 0) > 0 for a in self.adapters)
        return (
            not kwargs
            and not dropping
            and not m.disable_adapters
            and not m.merged
            and tuple(a for a in m.active_adapters if a in m.lora_A) == self.adapters
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every weight the effective weight is made of."""
        out = [self.base.weight] + ([self.base.bias] if self.base.bias is not None else [])
        for a in self.adapters:
            out += [self.module.lora_A[a].weight, self.module.lora_B[a].weight]
        return out

    def weight(self) -> torch.Tensor:
        """W, or W + sum(scaling * B @ A) over the active adapters (a new tensor; W is not touched)."""
        w = self.base.weight.detach()
        for a in self.adapters:
            w = torch.addmm(
                w,
                self.module.lora_B[a].weight.detach(),
                self.module.lora_A[a].weight.detach(),
                alpha=self.module.scaling[a],
            )
        return w


class Packing:
    """One prepacked product serving one layer or a group of sibling layers that read one input."""

    def __init__(self, owner: torch.nn.Module, key: str, members: list[Member], keep: bool = True):
        self.owner, self.key, self.members = owner, key, members
        self.sizes = [m.out_features for m in members]
        self.frozen = not any(t.requires_grad for m in members for t in m.tensors())
        self.cached = keep and self.frozen
        self.packed: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        self.pending: Optional[tuple[torch.Tensor, dict[int, torch.Tensor]]] = None

    def identity(self) -> tuple:
        return tuple((t._version, t.data_ptr()) for m in self.members for t in m.tensors())

    def build(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        with torch.no_grad():
            weights = [m.weight() for m in self.members]
            weight = weights[0] if len(weights) == 1 else torch.cat(weights)
            biases = [m.base.bias for m in self.members]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([b.detach() if b is not None else torch.zeros(n) for b, n in zip(biases, self.sizes)])
            return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()), bias

    def weights(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The packed weight and bias: built once per context, or reused from the owner's cache while
        every weight is frozen and unchanged."""
        if self.packed is not None:
            return self.packed
        if not self.cached:
            self.packed = self.build()
            return self.packed
        cache = self.owner.__dict__.setdefault("_relay_packed", {})
        hit, identity = cache.get(self.key), self.identity()
        if hit is None or hit[0] != identity:
            hit = (identity, self.build())
            cache[self.key] = hit
        self.packed = hit[1]
        return self.packed

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for input `x`; the first sibling called with `x` computes every
        sibling's, the others take theirs."""
        if self.pending is not None and self.pending[0] is x and index in self.pending[1]:
            out = self.pending[1].pop(index)
            if not self.pending[1]:
                self.pending = None
            return out
        y = onednn_linear(x, *self.weights())
        if len(self.members) == 1:
            return y
        parts = {i: part.contiguous() for i, part in enumerate(y.split(self.sizes, -1))}
        own = parts.pop(index)
        self.pending = (x, parts)
        return own


def packed_forward(packing: Packing, index: int):
    member = packing.members[index]
    module = member.module
    original = type(module).forward

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if x.dtype != torch.float32 or not member.applies(args, kwargs):
            return original(module, x, *args, **kwargs)
        return packing.output(index, x)

    return forward


def free(module: torch.nn.Module) -> bool:
    """Whether nothing else has replaced this layer's forward on the instance (`onednn_linears`'
    own replacement aside: decoding inside it packs the layer and gives the replacement back)."""
    forward = module.__dict__.get("forward")
    return forward is None or getattr(forward, "relay_onednn", False)


def packings(model: torch.nn.Module, keep: bool = True, fuse: bool = True) -> list[Packing]:
    """Every packing of `model`: its sibling groups (fused where `fuse` and every sibling is the
    same kind of layer with the same input width) and every other plain or LoRA linear layer alone.
    `keep`: packings of frozen weights are kept on the model for the next call (see the module
    docstring)."""
    out: list[Packing] = []
    grouped: set[int] = set()
    candidate = lambda m: free(m) and (is_plain_linear(m) or is_vanilla_lora(m))  # noqa: E731
    for parent in model.modules() if fuse else ():
        for names in FUSED_SIBLINGS:
            layers = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, torch.nn.Module) and candidate(m) for m in layers):
                continue
            members = [Member(m) for m in layers]
            same_kind = (
                len({(m.lora, m.adapters, m.base.in_features, m.base.weight.requires_grad) for m in members}) == 1
            )
            if not same_kind:
                continue
            out.append(Packing(parent, "+".join(names), members, keep))
            grouped.update(id(m) for m in layers)
    # Every other layer alone, LoRA bases included: a LoRA layer whose adapter is disabled (or not
    # foldable) runs peft's forward, which calls its base.
    out += [Packing(m, "self", [Member(m)], keep) for m in model.modules() if id(m) not in grouped and candidate(m)]
    return out


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, keep: bool = True):
    """Run `model`'s linear layers on prepacked weights for the body (see the module docstring),
    where `packing_enabled`; a no-op otherwise. `keep=False` drops every packing at the exit, those
    of frozen weights too (the RL samplers: the update that follows should not carry them)."""
    if not packing_enabled(model):
        yield
        return
    patched = []
    for packing in packings(model, keep, fuse=choice("decode_fused")):
        for index, member in enumerate(packing.members):
            patched.append((member.module, member.module.__dict__.get("forward")))
            member.module.forward = packed_forward(packing, index)
    try:
        yield
    finally:
        for module, previous in patched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous


# ------------------------------------------------------------------------------------------
# oneDNN linear layers for training forwards and backwards (CPU, fp32)
# ------------------------------------------------------------------------------------------


def onednn_enabled(model: torch.nn.Module) -> bool:
    """oneDNN linears on a CPU model in fp32 where they pay on this CPU for training
    (`cpu_kernels.choice("train_onednn")`; RELAY_CPU_ONEDNN=1/0 forces it)."""
    return cpu_fp32(model) and choice("train_onednn")


def _onednn_forward(module: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            return torch.nn.Linear.forward(module, x)
        return OneDNNLinear.apply(x, module.weight, module.bias)

    forward.relay_onednn = True
    return forward


@contextlib.contextmanager
def onednn_linears(*models: Optional[torch.nn.Module]):
    """Run every plain fp32 `nn.Linear` of `models` (LoRA's base and adapter layers included) through
    `OneDNNLinear` for the body, with gradients; where `onednn_enabled`, a no-op otherwise. Layers
    whose forward something else replaced on the instance keep it (and a layer already inside
    another `onednn_linears` is left to it). Every stage's train steps and evaluations run under it
    (`Stage.fast_linears`); decoding inside it switches to its own prepacked path and back."""
    patched = []
    for model in models:
        if model is None or not onednn_enabled(model):
            continue
        for module in model.modules():
            if is_plain_linear(module) and "forward" not in module.__dict__:
                module.forward = _onednn_forward(module)
                patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward
