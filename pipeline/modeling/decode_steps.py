"""One decode step of the model, the two fast ways `Decoder` (pipeline/modeling/decode.py) takes when
the model allows: `FastStep`, the decoder layer of a `SIMPLE_DECODERS` model computed from its own
modules without the forward's per-call machinery, and `GraphStep`, the model's own forward captured
in a CUDA graph; `step_kind` says which a model gets."""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from pipeline.modeling.cpu_kernels import override
from pipeline.modeling.onednn import cpu_fp32


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


SIMPLE_DECODERS = ("llama", "qwen2", "mistral")
"""Model types whose decoder layer `FastStep` reproduces: pre-norm RMSNorm, rotary q/k, grouped-query
attention over the whole context, a gated MLP."""


class FastStep:
    """One decode step of a `SIMPLE_DECODERS` model, computed from its own modules with none of the
    forward's per-call machinery (mask building, output records, cache bookkeeping, peft's
    dispatch): embed, then per layer RMSNorm, q/k/v (one fused packed product), the model's own
    rotary embedding, a write into the static cache, attention over the slots written so far, the
    output projection, RMSNorm and the gated MLP; the final norm and the head. Same math as the
    model's forward (another summation order in the attention; logits agree within ~1e-6).

    It calls the layers, so on a CPU (fp32, packing on) they run packed with LoRA folded, and
    adapters are honoured everywhere (an adapter disabled decodes the base). On CUDA its
    fixed-shape variant (`static`) is what `GraphStep` captures (`step_kind`)."""

    def __init__(self, model: torch.nn.Module, cache, valid: torch.Tensor):
        hf = hf_model(model)
        self.backbone, self.head, self.cache, self.valid = hf.model, hf.lm_head, cache, valid
        self.slot_index = torch.arange(valid.shape[1], device=valid.device)
        self.layer_list = list(self.backbone.layers)
        attention = self.layer_list[0].self_attn
        self.rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        config = hf.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = attention.head_dim, attention.scaling

    @staticmethod
    def supports(model: torch.nn.Module, cache) -> bool:
        """The model is one `FastStep` reproduces, with nothing hooked into its modules and a cache
        whose layers it can write."""
        hf = hf_model(model)
        config = hf.config
        if config.model_type not in SIMPLE_DECODERS or getattr(config, "hidden_act", "silu") != "silu":
            return False
        if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
            return False
        if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
            return False
        if config._attn_implementation not in ("sdpa", "eager"):
            return False
        if any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in hf.modules()):
            return False
        layers = getattr(getattr(hf, "model", None), "layers", None)
        if layers is None or not hasattr(hf.model, "rotary_emb") or not hasattr(hf, "lm_head"):
            return False
        module = sys.modules[type(layers[0].self_attn).__module__]
        if not hasattr(module, "apply_rotary_pos_emb"):
            return False
        return all(
            hasattr(layer, "keys") and hasattr(layer, "cumulative_length") for layer in getattr(cache, "layers", [None])
        )

    @staticmethod
    def norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        # fp32: one fused op, the same formula. Otherwise the module itself: it rounds to the input
        # dtype before the weight, which rms_norm does not.
        if x.dtype != torch.float32:
            return module(x)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, write, read) -> torch.Tensor:
        """Logits [B, V]: `write(cache_layer, k, v)` stores the step's keys and values, `read(cache_layer)`
        gives the (keys, values) to attend over, `allowed` [B, S] which of those a row may see."""
        rows, H, KV, D = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        h = self.backbone.embed_tokens(tokens[:, None])
        cos, sin = self.backbone.rotary_emb(h, positions)
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=h.device).masked_fill_(~allowed, float("-inf"))[
            :, None, None
        ]
        for index, layer in enumerate(self.layer_list):
            attention, mlp = layer.self_attn, layer.mlp
            x = self.norm(layer.input_layernorm, h)
            q = attention.q_proj(x).view(rows, 1, H, D).transpose(1, 2)
            k = attention.k_proj(x).view(rows, 1, KV, D).transpose(1, 2)
            v = attention.v_proj(x).view(rows, 1, KV, D).transpose(1, 2)
            q, k = self.rotate(q, k, cos, sin)
            cache = self.cache.layers[index]
            write(cache, k, v)
            cache.cumulative_length.add_(1)
            keys, values = read(cache)
            scores = torch.matmul(q.reshape(rows, KV, H // KV, D), keys.transpose(-1, -2)).float()  # softmax in fp32
            probs = torch.softmax(scores.mul_(self.scaling).add_(bias), dim=-1).to(values.dtype)
            out = torch.matmul(probs, values).reshape(rows, 1, H * D)
            h = h + attention.o_proj(out)
            x = self.norm(layer.post_attention_layernorm, h)
            h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        return self.head(self.norm(self.backbone.norm, h))[:, -1]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits [B, V] after feeding `tokens` [B] at `positions` [B, 1] into cache slot `slot`,
        attending over the slots written so far only."""
        seen = slot + 1

        def write(cache, k, v):
            cache.keys[:, :, slot] = k[:, :, 0]
            cache.values[:, :, slot] = v[:, :, 0]

        return self.run(
            tokens,
            positions,
            self.valid[:, :seen],
            write,
            lambda cache: (cache.keys[:, :, :seen], cache.values[:, :, :seen]),
        )

    def static(self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The same step with every shape fixed and the slot a tensor ([1]): it attends over the whole
        cache with the slots past `slot` masked, so one CUDA graph serves every step (`GraphStep`)."""
        allowed = self.valid & (self.slot_index <= slot)

        def write(cache, k, v):
            cache.keys.index_copy_(2, slot, k)
            cache.values.index_copy_(2, slot, v)

        return self.run(tokens, positions, allowed, write, lambda cache: (cache.keys, cache.values))


class GraphStep:
    """`FastStep.static` captured once as a CUDA graph and replayed for every later step: a decode
    step becomes one launch instead of a few hundred kernels each launched from Python. The inputs
    are copied into static tensors before each replay. The first call runs the step for real (which
    also warms up the kernels the capture records), then captures; if capturing fails (an op that
    cannot be captured, such as a dynamic RoPE's host-side check), every step runs
    `FastStep.static` eagerly instead, with one warning."""

    def __init__(self, fast: FastStep, rows: int, device: torch.device):
        self.fast, self.graph, self.failed = fast, None, False
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.logits: Optional[torch.Tensor] = None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slot.fill_(slot)
        if self.graph is not None:
            self.graph.replay()
            return self.logits.clone()
        logits = self.fast.static(self.tokens, self.positions, self.slot)
        if not self.failed:
            self.capture()
        return logits

    def capture(self) -> None:
        """Record the step (capturing runs no kernel: the cache and its counters are untouched until
        the first replay)."""
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                self.logits = self.fast.static(self.tokens, self.positions, self.slot)
            self.graph = graph
        except Exception as err:  # noqa: BLE001 - any capture failure falls back to eager steps
            import logging

            self.failed = True
            logging.getLogger("relay.decode").warning("decode: CUDA graph capture failed (%s); decoding eagerly", err)


def step_kind(model: torch.nn.Module) -> str:
    """How `generate` runs a decode step: 'fast' (`FastStep`, a CPU in fp32, unless
    RELAY_DECODE_PACKED=0), 'graph' (`GraphStep`, CUDA, unless RELAY_DECODE_GRAPHS=0) or 'hf' (the
    model's own forward, the reference; also wherever `FastStep.supports` says no). The fast step
    saves the model's per-step Python whether or not this CPU's products run prepacked
    (`cpu_kernels.choice("decode_packed")`), so a CPU that decodes on plain weights keeps it."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return "graph" if os.environ.get("RELAY_DECODE_GRAPHS", "1") != "0" else "hf"
    return "fast" if cpu_fp32(model) and override("decode_packed") is not False else "hf"
