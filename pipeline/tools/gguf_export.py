"""Write a Llama-architecture model folder as a GGUF file that llama.cpp reads as transformers does.

    relay export outputs/demo/sft --out release/ --gguf            # f32 (default)
    relay export outputs/demo/sft --out release/ --gguf q8_0       # or f16, bf16
    llama-quantize release/model.gguf release/model-Q4_K_M.gguf Q4_K_M   # k-quants: llama.cpp's own tool

What llama.cpp needs beyond the weights is the tokenizer exactly as the Hugging Face one behaves:
- `tokenizer.ggml.pre`, the name of llama.cpp's pre-tokenizer (the regex that splits text before
  BPE). llama.cpp's convert_hf_to_gguf.py identifies it by hashing the ids of a probe text and
  looking the hash up in a table of known models; a fine-tuned folder keeps its base's tokenizer,
  so we identify it from the tokenizer.json's pre_tokenizer itself (PRE_TOKENIZERS) and refuse
  one we do not know rather than writing "default" (which tokenizes digits, punctuation and
  unicode differently).
- token types: 3 (control) for special added tokens, so `<|im_start|>` stays one token; 4
  (user-defined) for other added tokens; 1 for the rest; 5 for padding rows beyond the tokenizer.
- add_bos/add_eos as the tokenizer really behaves, bos/eos/unk/pad ids, the end-of-turn id, the
  merges and the chat template.

And the rotary embedding as llama.cpp's Llama graph applies it: q/k projection rows (weights and
biases) in its interleaved layout, and the config's rope scaling in the keys and tensor llama.cpp's
convert_hf_to_gguf.py writes for it (ROPE_SCALINGS); another rope_type is refused before anything
is written.

Each `--gguf` type carries its tolerance, derived from its own rounding (GgufType.tolerance); the
written file is read back and compared with the model folder in pipeline.tools.gguf_check, and
logit_problem holds that comparison to the type's tolerance.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline.tools.gguf_check import LOGIT_PROBES


class ExportError(RuntimeError):
    """The export cannot be made; the message is one line for the user."""


GROWTH = 300.0
"""How much larger the next-token logits' error (logit_error) may be than the weights' rounding
error (rounding_error): every layer's rounding adds to the logits, so a correct export's logits err
by a roughly fixed multiple of its weights' error whatever the type; this allowance leaves room
above that multiple on the embedded model and stays far below what a broken layout gives
(bench/RESULTS.md, "GGUF export check")."""
FLOOR = 1e-6
"""The error allowed on top: f32 stores the weights exactly, and what is left is summation order."""


@dataclass(frozen=True)
class GgufType:
    """One `--gguf` choice."""

    file_type: str
    """gguf.LlamaFileType member recorded as general.file_type."""
    matrix_type: str
    """gguf.GGMLQuantizationType of the 2-D weights (1-D norms stay F32, as llama.cpp keeps them)."""

    @property
    def tolerance(self) -> float:
        """The largest logit_error (reloaded GGUF vs the model, worst PROBE prompt) accepted:
        derived from the type's own precision, GROWTH times its rounding_error plus FLOOR."""
        return GROWTH * rounding_error(self) + FLOOR


GGUF_TYPES = {
    "f32": GgufType("ALL_F32", "F32"),
    "f16": GgufType("MOSTLY_F16", "F16"),
    "bf16": GgufType("MOSTLY_BF16", "BF16"),
    "q8_0": GgufType("MOSTLY_Q8_0", "Q8_0"),
}


@functools.lru_cache(maxsize=None)  # pure: the same matrix every time
def rounding_error(kind: GgufType) -> float:
    """The normalised squared error of a fixed Gaussian matrix stored as `kind` (tensor_payload)
    and read back by the gguf package's dequantizer, as transformers' GGUF loader reads it."""
    import gguf
    import numpy as np

    weights = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    data, raw_dtype = tensor_payload(weights, kind)
    back = np.asarray(data, dtype=np.float32) if raw_dtype is None else gguf.quants.dequantize(data, raw_dtype)
    return float(((back - weights) ** 2).sum() / (weights**2).sum())


# tokenizer.json pre_tokenizer -> llama.cpp's pre-tokenizer name (llama-vocab.cpp). "gpt-2" is the
# byte-level regex alone; "smollm" (SmolLM/SmolLM2's own tokenizer, the name llama.cpp's converter
# derives for HuggingFaceTB/SmolLM2-*) adds a split into single digits before it.
_BYTE_LEVEL = {"type": "ByteLevel", "use_regex": True, "add_prefix_space": False}
PRE_TOKENIZERS = {
    "gpt-2": [_BYTE_LEVEL],
    "smollm": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
}


def _pre_steps(pre_tokenizer: Optional[dict]) -> list[dict]:
    """The pre-tokenizer as a flat list of steps, each reduced to the fields that change splitting."""
    if not pre_tokenizer:
        return []
    if pre_tokenizer.get("type") == "Sequence":
        return [step for p in pre_tokenizer.get("pretokenizers", []) for step in _pre_steps(p)]
    kept = ("type", "use_regex", "add_prefix_space", "individual_digits", "pattern", "behavior", "invert")
    return [{k: v for k, v in pre_tokenizer.items() if k in kept}]


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a byte-level BPE tokenizer.json (pure).

    Raises:
        ExportError: not byte-level BPE, a normalizer, or a pre-tokenizer llama.cpp is not known
            here to reproduce.
    """
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ExportError(
            "--gguf: the tokenizer is "
            f"{model.get('type')}{' with byte fallback' if model.get('byte_fallback') else ''}, "
            "not byte-level BPE; use llama.cpp's convert_hf_to_gguf.py on the exported folder"
        )
    if tokenizer_json.get("normalizer"):
        raise ExportError(
            f"--gguf: the tokenizer has a normalizer ({tokenizer_json['normalizer'].get('type')}) that this exporter "
            "cannot describe to llama.cpp; use llama.cpp's convert_hf_to_gguf.py"
        )
    steps = _pre_steps(tokenizer_json.get("pre_tokenizer"))
    for name, wanted in PRE_TOKENIZERS.items():
        if len(steps) == len(wanted) and all(
            all(s.get(k) == v for k, v in w.items()) and set(s) <= set(w) | {"type"} for s, w in zip(steps, wanted)
        ):
            return name
    raise ExportError(
        f"--gguf: unknown pre-tokenizer {json.dumps(tokenizer_json.get('pre_tokenizer'))[:200]}; "
        f"known: {', '.join(PRE_TOKENIZERS)} (llama.cpp's convert_hf_to_gguf.py knows more)"
    )


def token_table(tokenizer_json: dict, n_vocab: int) -> tuple[list[str], list[int]]:
    """(token texts by id, llama.cpp token types) for `n_vocab` rows (pure): 3 control for special
    added tokens, 4 user-defined for other added tokens, 1 normal, 5 unused for padding rows the
    model has beyond the tokenizer.

    Raises:
        ExportError: the tokenizer has more tokens than the model has rows, or a gap in its ids.
    """
    texts: dict[int, str] = {i: t for t, i in tokenizer_json["model"]["vocab"].items()}
    types = {i: 1 for i in texts}
    for added in tokenizer_json.get("added_tokens") or []:
        texts[added["id"]] = added["content"]
        types[added["id"]] = 3 if added.get("special") else 4
    if max(texts) >= n_vocab:
        raise ExportError(f"--gguf: the tokenizer has id {max(texts)} but the model only {n_vocab} embedding rows")
    missing = [i for i in range(max(texts) + 1) if i not in texts]
    if missing:
        raise ExportError(f"--gguf: the tokenizer has no token for id {missing[0]} ({len(missing)} gaps)")
    tokens = [texts[i] if i in texts else f"[PAD{i}]" for i in range(n_vocab)]
    return tokens, [types.get(i, 5) for i in range(n_vocab)]


def merges_of(tokenizer_json: dict) -> list[str]:
    """BPE merges as "a b" lines (tokenizers writes them as strings or, since 0.20, as pairs)."""
    return [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"].get("merges", [])]


def added_specials(tokenizer) -> tuple[bool, bool]:
    """(adds a token before, adds one after) plain text, as the tokenizer really behaves: llama.cpp's
    add_bos/add_eos (a tokenizer_config flag can say otherwise than the post-processor does)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    start = next(k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain)
    return start > 0, len(full) > start + len(plain)


def permute_rotary(weights, n_head: int):
    """q/k projection rows, or their biases, from the Hugging Face rotary layout (each head's first
    half of dimensions rotates with its second half) to llama.cpp's (adjacent pairs), as its
    convert_hf_to_gguf.py permutes Llama's `q_proj`/`k_proj` weights and biases; transformers' GGUF
    loader undoes it."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def tensor_payload(tensor, kind: GgufType):
    """(array, raw GGML type or None) to store one float32 numpy tensor as `kind`: 1-D tensors and
    rows that do not split into quantisation blocks stay F32 / F16 (as llama.cpp's converter does)."""
    import gguf
    import numpy as np

    if kind.matrix_type == "F32" or tensor.ndim == 1:
        return tensor.astype(np.float32), None
    if kind.matrix_type == "F16":
        return tensor.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[kind.matrix_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if tensor.shape[-1] % block:
        return tensor.astype(np.float16), None
    return gguf.quants.quantize(tensor.astype(np.float32), qtype), qtype


def llama3_rope_factors(params: dict, dim: int, base: float):
    """llama.cpp's `rope_freqs` for Llama 3's rope scaling (pure): per rotary frequency, what its
    base frequency is divided by (convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, here with
    `original_max_position_embeddings` read from the rope parameters, where transformers reads it).
    transformers' llama3 rope keeps frequencies whose wavelength is under original / high_freq_factor,
    divides those over original / low_freq_factor by `factor`, and blends the two in between."""
    import numpy as np

    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    with np.errstate(divide="ignore", invalid="ignore"):  # low == high leaves no band to blend
        smooth = (original / wavelength - low) / (high - low)
        blended = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelength > original / low, factor, np.where(wavelength < original / high, 1.0, blended))
    return factors.astype(np.float32)


def _no_scaling(writer, params: dict, dim: int, base: float) -> None:
    """Plain rope: rope.freq_base and rope.dimension_count say it all."""


def _linear_scaling(writer, params: dict, dim: int, base: float) -> None:
    """Positions divided by `factor`: llama.cpp's rope.scaling.type linear and rope.scaling.factor."""
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(float(params["factor"]))


def _llama3_scaling(writer, params: dict, dim: int, base: float) -> None:
    """Per-frequency factors: llama.cpp reads them from the `rope_freqs` tensor (no scaling keys)."""
    import gguf

    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    writer.add_tensor(name, llama3_rope_factors(params, dim, base))


@dataclass(frozen=True)
class RopeScaling:
    """One transformers rope_type as this exporter writes it for llama.cpp."""

    keys: tuple[str, ...]
    """The rope parameters it reads (config.json `rope_parameters`, or `rope_scaling` before transformers 5)."""
    write: Callable[[Any, dict, int, float], None]
    """(writer, rope parameters, rotary dimension, rope_theta): its metadata keys and tensors."""


ROPE_SCALINGS = {
    "default": RopeScaling((), _no_scaling),
    "linear": RopeScaling(("factor",), _linear_scaling),
    "llama3": RopeScaling(
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), _llama3_scaling
    ),
}
"""The rope types written, each as convert_hf_to_gguf.py writes it for llama.cpp's Llama graph. Others
(yarn, dynamic, longrope) are refused rather than written as plain rope."""


def rope_scaling(config: dict) -> tuple[RopeScaling, dict]:
    """(the ROPE_SCALINGS entry, its parameters) for a config.json (pure).

    Raises:
        ExportError: a rope_type this exporter does not write, or a parameter it needs missing.
    """
    source = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = config.get(source) or {}
    name = params.get("rope_type") or params.get("type") or "default"
    entry = ROPE_SCALINGS.get(name)
    if entry is None:
        raise ExportError(
            f"--gguf: config.json {source}.rope_type is {name!r}; this exporter writes {', '.join(ROPE_SCALINGS)} "
            "rope (use llama.cpp's convert_hf_to_gguf.py on the exported folder)"
        )
    missing = [key for key in entry.keys if params.get(key) is None]
    if missing:
        raise ExportError(f"--gguf: config.json {source} has rope_type {name!r} but no {', '.join(missing)}")
    return entry, params


def rotary_settings(config: dict) -> tuple[float, int]:
    """(rope_theta, rotary dimension per head) of a config.json (pure)."""
    n_head = config["num_attention_heads"]
    base = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return float(base), config.get("head_dim") or config["hidden_size"] // n_head


def write_metadata(writer, config: dict, name: str, kind: GgufType) -> None:
    """The model's hyper-parameters as llama.cpp's Llama loader reads them, its rope scaling included.

    Raises:
        ExportError: a rope scaling this exporter does not write (rope_scaling).
    """
    import gguf

    n_head = config["num_attention_heads"]
    scaling, params = rope_scaling(config)
    base, rotary_dim = rotary_settings(config)
    writer.add_name(name)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.get("num_key_value_heads", n_head))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(base)
    writer.add_rope_dimension_count(rotary_dim)
    scaling.write(writer, params, rotary_dim, base)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType[kind.file_type])


def write_tokenizer(writer, folder: Path, n_vocab: int) -> None:
    """The tokenizer as llama.cpp reads it (see the module docstring).

    Raises:
        ExportError: no tokenizer.json, or one llama.cpp could not reproduce (pre_tokenizer_name).
    """
    from transformers import AutoTokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"--gguf: {folder} has no tokenizer.json (a fast byte-level BPE tokenizer is needed)")
    tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
    pre = pre_tokenizer_name(tokenizer_json)
    tokens, types = token_table(tokenizer_json, n_vocab)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    add_bos, add_eos = added_specials(tokenizer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges_of(tokenizer_json))
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    for setter, token_id in (
        (writer.add_bos_token_id, tokenizer.bos_token_id),
        (writer.add_eos_token_id, tokenizer.eos_token_id),
        (writer.add_unk_token_id, tokenizer.unk_token_id),
        (writer.add_pad_token_id, tokenizer.pad_token_id),
        # a chat model's turns end with its EOS token (<|im_end|>); llama.cpp stops generation there
        (writer.add_eot_token_id, tokenizer.eos_token_id),
    ):
        if token_id is not None:
            setter(token_id)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(
    folder: Path, out: Path, dtype: str = "f32", name: Optional[str] = None, license_id: Optional[str] = None
) -> Path:
    """Write `folder` (a Llama-architecture causal LM) as a GGUF file named `name` (general.name),
    with `license_id` as general.license when known.

    Raises:
        ExportError: another architecture, a rope scaling this exporter does not write (both before
            anything is written), or a tokenizer llama.cpp could not reproduce.
    """
    import gguf
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ExportError(
            f"--gguf: {folder} is {config.get('architectures')}; this exporter writes LlamaForCausalLM "
            "(for others use llama.cpp's convert_hf_to_gguf.py on the exported folder)"
        )
    rope_scaling(config)
    kind = GGUF_TYPES[dtype]
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads", n_head)
    writer = gguf.GGUFWriter(str(out), "llama")
    write_metadata(writer, config, name or folder.name, kind)
    if license_id:
        writer.add_license(license_id)
    write_tokenizer(writer, folder, config["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                if "rotary_emb" in key:
                    continue
                tensor = fh.get_tensor(key).float().numpy()
                if key.endswith(("q_proj.weight", "q_proj.bias")):
                    tensor = permute_rotary(tensor, n_head)
                elif key.endswith(("k_proj.weight", "k_proj.bias")):
                    tensor = permute_rotary(tensor, n_kv)
                gguf_name = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if gguf_name is None:
                    raise ExportError(f"--gguf: no GGUF name for tensor {key!r}")
                data, raw_dtype = tensor_payload(tensor, kind)
                writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def logit_problem(error: float, dtype: str) -> Optional[str]:
    """One line for a gguf_logit_error beyond `dtype`'s tolerance (None within it): what was compared
    and what the file then holds otherwise than the model."""
    tolerance = GGUF_TYPES[dtype].tolerance
    if error <= tolerance:
        return None
    return (
        f"next-token logits differ from the model folder's on {len(LOGIT_PROBES)} probe prompts (one a few hundred "
        "tokens long) when transformers reads the GGUF back, with the rope and biases llama.cpp reads from it: "
        f"normalised squared error {error:.3g}, where {dtype}'s rounding explains {tolerance:.2g}; a tensor, its "
        "layout or a hyper-parameter (rope, norm epsilon, heads) is written otherwise than the model uses it"
    )
