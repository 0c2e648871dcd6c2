"""Read a GGUF file back and compare it with the model folder it was written from: next-token logits
as transformers loads the file back, given the rope and biases llama.cpp reads from it
(gguf_logit_error, measured by logit_error), the tokenizer as transformers rebuilds it from the
file's metadata (gguf_tokenizer_problem), and one string of the file's metadata (gguf_string).

Nothing here writes a GGUF or knows a `--gguf` type: gguf_export writes the file and holds each
type's tolerance, the bound a measured logit_error is held to (gguf_export.logit_problem).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

PROBE = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]
POSITION_PROBE = "\n".join(f"Line {i}: {PROBE[i % len(PROBE)]} {i * 7}." for i in range(40))
"""A prompt of a few hundred tokens: its next-token logits rest on attention across distant
positions, where a rope written otherwise than the model applies it shows (the short PROBE
prompts barely rotate)."""
LOGIT_PROBES = (*PROBE, POSITION_PROBE)
"""The prompts whose next-token logits the export check compares (gguf_logit_error)."""


def logit_error(reference, candidate) -> float:
    """The normalised squared error (llama.cpp's test-backend-ops NMSE: sum of squared differences
    over the reference's sum of squares) of two next-token logit vectors, each centred on its mean
    (pure). Centring leaves what softmax sees: the same for logits and log-probabilities, blind to a
    shift of every logit (which changes no probability), and relative to the logits' spread, so a
    model with confident logits and a random one with flat logits are held to the same rule."""
    a = reference.double() - reference.double().mean()
    b = candidate.double() - candidate.double().mean()
    return float(((a - b) ** 2).sum() / (a**2).sum().clamp_min(1e-300))


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF metadata value type -> struct format (8 is a string, 9 an array)."""


def gguf_string(path: Path, key: str) -> Optional[str]:
    """One string value of a GGUF file's metadata, read up to its key only (general.* keys come
    first; gguf.GGUFReader parses every field, the 49k-token vocabulary included, which takes seconds).

    Raises:
        ValueError: not a GGUF file (or a truncated one).
        OSError: it cannot be read.
    """
    import struct

    with open(path, "rb") as fh:

        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = fh.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: truncated GGUF metadata")
            return struct.unpack("<" + fmt, data)[0]

        def skip(kind: int) -> None:
            if kind == 8:
                fh.seek(read("Q"), 1)
            elif kind == 9:
                item, count = read("I"), read("Q")
                if item in _SCALARS:
                    fh.seek(struct.calcsize("<" + _SCALARS[item]) * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                fh.seek(struct.calcsize("<" + _SCALARS[kind]), 1)

        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        read("I"), read("Q")  # version, tensor count
        for _ in range(read("Q")):
            name = fh.read(read("Q")).decode("utf-8")
            kind = read("I")
            if name == key and kind == 8:
                return fh.read(read("Q")).decode("utf-8")
            skip(kind)
    return None


TOKENIZER_PROBE = [*PROBE, "héllo wörld\t123 4567  <|im_end|>\n\nnaïve café 日本語 🙂"]
"""Texts the GGUF's tokenizer must split as the folder's (with a chat turn rendered by the template)."""


def gguf_tokenizer_problem(folder: Path, gguf_file: Path, texts: Sequence[str] = TOKENIZER_PROBE) -> Optional[str]:
    """Where the GGUF's tokenizer, as transformers rebuilds it from the file's tokenizer.ggml.*
    metadata, gives other ids than the folder's tokenizer: the probe texts with its special tokens
    added as each adds them, and a user turn rendered by the folder's chat template; None when they
    agree. (The logits check feeds both models the folder's ids, so it cannot see the tokenizer.)
    The GGUF is read from a folder of its own: beside a tokenizer.json, transformers reads that one."""
    import tempfile

    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(folder)
    with tempfile.TemporaryDirectory(prefix="relay-gguf-") as alone:
        (Path(alone) / gguf_file.name).symlink_to(gguf_file.resolve())
        try:
            theirs = AutoTokenizer.from_pretrained(alone, gguf_file=gguf_file.name)
        except Exception as err:  # transformers' GGUF reader raises what its parsing meets
            return f"tokenizer cannot be read back by transformers ({type(err).__name__}: {err})"
    if ours.chat_template:
        turn = [{"role": "user", "content": texts[0]}]
        texts = [*texts, ours.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)]
    for text in texts:
        want, got = ours(text)["input_ids"], theirs(text)["input_ids"]
        if want != got:
            at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            return (
                f"tokenizer splits {text[:40]!r} otherwise than the model's: ids differ from token {at} "
                f"({want[at : at + 3]} vs {got[at : at + 3]})"
            )
    return None


def llama_cpp_reading(gguf_file: Path) -> tuple[Any, dict]:
    """What llama.cpp's Llama graph takes from a GGUF that transformers' GGUF loader leaves out:
    (the rotary inverse frequencies, config overrides for the reloaded model).

    The frequencies (a float32 tensor, computed as transformers computes the plain ones) are
    rope.freq_base ** (-2i / rope.dimension_count), divided by rope.scaling.factor where the file has
    one (llama.cpp scales positions by its inverse) and by the `rope_freqs` tensor's factors where it
    has that. The overrides say which biases the layers have: llama.cpp adds every bias tensor the
    file holds, while transformers builds a Llama without biases and drops them."""
    import gguf
    import torch

    reader = gguf.GGUFReader(str(gguf_file))

    def value(key: str):
        found = reader.get_field(f"llama.{key}")
        return None if found is None else found.contents()

    dim, factor = int(value("rope.dimension_count")), value("rope.scaling.factor")
    inv_freq = 1.0 / (float(value("rope.freq_base")) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if factor:
        inv_freq = inv_freq / factor
    freqs_name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
    freqs = next((t for t in reader.tensors if t.name == freqs_name), None)
    if freqs is not None:
        inv_freq = inv_freq / torch.tensor(freqs.data, dtype=torch.float32)
    biases = {t.name.split(".")[-2] for t in reader.tensors if t.name.startswith("blk.") and t.name.endswith(".bias")}
    overrides = {
        "attention_bias": any(name.startswith("attn_") for name in biases),
        "mlp_bias": any(name.startswith("ffn_") for name in biases),
    }
    return inv_freq, overrides


def gguf_logit_error(folder: Path, gguf_file: Path, prompts: Sequence[str] = LOGIT_PROBES) -> float:
    """The worst logit_error over `prompts` (each cut to the model's max_position_embeddings) of the
    GGUF loaded back by transformers (which dequantizes its tensors with the gguf package), given what
    llama.cpp reads from the file that transformers does not (llama_cpp_reading: the rope, biases),
    against the model folder, both in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    inv_freq, overrides = llama_cpp_reading(gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, **overrides
    ).eval()
    rotary = reloaded.model.rotary_emb
    rotary.inv_freq, rotary.original_inv_freq = inv_freq, inv_freq.clone()
    limit = reference.config.max_position_embeddings
    worst = 0.0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer(prompt)["input_ids"][:limit]])
            worst = max(
                worst, logit_error(reference(input_ids=ids).logits[0, -1], reloaded(input_ids=ids).logits[0, -1])
            )
    return worst
