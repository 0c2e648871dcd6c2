"""`relay export --gguf`'s rotary embedding as llama.cpp applies it: rope scaling (linear, llama3)
written in the keys and tensor llama.cpp reads, other rope types refused before writing, q/k biases
permuted like the weights, and the export check sensitive to all of them. Tiny models whose
attention depends on position (q/k projections scaled up), with llama.cpp itself where the binding
is installed (tests/llamacpp.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from tinymodels import make_tiny_model
from transformers import AutoModelForCausalLM

from pipeline.tools import gguf_check, gguf_export
from pipeline.tools.gguf_export import ExportError

LINEAR = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
"""original_max_position_embeddings 64 puts the tiny model's 8 frequencies on all three sides of the
blend (kept, blended, divided by factor), which Llama 3's 8192 would not at head_dim 16."""
SCALINGS = {"linear": LINEAR, "llama3": LLAMA3}


def position_sensitive(folder, seed: int = 1) -> None:
    """Scale q/k projections by 10 and v/o by 5 (and set q/k biases, where the model has them, to
    N(0, 3)): attention then depends on where tokens are, so a rope or bias laid out otherwise than
    the model's moves the logits far beyond any type's tolerance."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(10)
            elif name.endswith(("v_proj.weight", "o_proj.weight")):
                param.mul_(5)
            elif name.endswith(("q_proj.bias", "k_proj.bias")):
                param.copy_(torch.randn(param.shape, generator=generator) * 3)
    model.save_pretrained(folder)


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def scaled(request, tmp_path_factory):
    """(rope type, a tiny model with that rope scaling, attention sensitive to position)."""
    folder = make_tiny_model(tmp_path_factory.mktemp("rope") / request.param, rope_parameters=SCALINGS[request.param])
    position_sensitive(folder)
    return request.param, folder


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    """A tiny Llama with attention biases (q/k/v/o), attention sensitive to position."""
    folder = make_tiny_model(tmp_path_factory.mktemp("bias") / "model", attention_bias=True)
    position_sensitive(folder)
    return folder


def field(reader, key):
    found = reader.get_field(key)
    return None if found is None else found.contents()


def tensor(reader, name):
    return np.asarray(next(t for t in reader.tensors if t.name == name).data)


def test_llama3_rope_factors_are_what_transformers_divides_by():
    """Golden from transformers' own llama3 rope (modeling_rope_utils._compute_llama3_parameters):
    llama.cpp divides each base frequency by its rope_freqs factor, so the factors are transformers'
    plain frequencies over its llama3 ones; some kept (1), some divided by the whole factor, some blended."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=dict(LLAMA3))
    plain, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    factors = gguf_export.llama3_rope_factors(LLAMA3, 16, 10000.0)
    np.testing.assert_allclose(factors, (plain / scaled).numpy(), rtol=1e-5)
    assert factors.dtype == np.float32 and factors[0] == 1.0 and 1 < factors[1] < 8 and factors[-1] == 8.0


def test_rope_scaling_is_written_as_llama_cpp_reads_it(scaled, tmp_path):
    """llama.cpp's converter writes linear scaling as rope.scaling.type/factor and llama3's as a
    `rope_freqs` tensor (F32, one factor per rotary frequency): the gguf package reads them back."""
    import gguf

    name, folder = scaled
    reader = gguf.GGUFReader(str(gguf_export.write_gguf(folder, tmp_path / "model.gguf", "q8_0")))
    if name == "linear":
        assert field(reader, "llama.rope.scaling.type") == "linear"
        assert field(reader, "llama.rope.scaling.factor") == 4.0
    else:
        assert field(reader, "llama.rope.scaling.type") is None
        np.testing.assert_array_equal(
            tensor(reader, "rope_freqs.weight"), gguf_export.llama3_rope_factors(LLAMA3, 16, 1e4)
        )
    assert field(reader, "llama.rope.freq_base") == 10000.0 and field(reader, "llama.rope.dimension_count") == 16


def test_the_check_passes_a_scaled_rope_and_catches_it_left_out(scaled, tmp_path, monkeypatch):
    """f32 stores every weight exactly, so the check's error is float noise (the export was refused
    when the scaling went unwritten); written without its scaling, the long probe's logits move far
    beyond q8_0's tolerance, the widest (the three short prompts alone barely rotate)."""
    name, folder = scaled
    exact = gguf_export.write_gguf(folder, tmp_path / "exact.gguf", "f32")
    assert gguf_check.gguf_logit_error(folder, exact) <= gguf_export.GGUF_TYPES["f32"].tolerance
    entry = gguf_export.ROPE_SCALINGS[name]
    monkeypatch.setitem(gguf_export.ROPE_SCALINGS, name, dataclasses.replace(entry, write=gguf_export._no_scaling))
    plain = gguf_export.write_gguf(folder, tmp_path / "plain.gguf", "q8_0")
    error = gguf_check.gguf_logit_error(folder, plain)
    assert error > 10 * gguf_export.GGUF_TYPES["q8_0"].tolerance
    assert gguf_export.logit_problem(error, "q8_0").startswith("next-token logits differ from the model folder's")


@pytest.mark.parametrize(
    "rope, says",
    [
        (
            {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
            r"rope_type is 'yarn'; this exporter writes",
        ),
        ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, r"rope_parameters.rope_type is 'dynamic'"),
        ({"rope_type": "linear", "rope_theta": 1e4}, r"rope_parameters has rope_type 'linear' but no factor"),
    ],
)
def test_a_rope_it_does_not_write_is_one_line_before_writing(tiny_model_dir, tmp_path, rope, says):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    with pytest.raises(ExportError, match=says):
        gguf_export.write_gguf(folder, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_q_and_k_biases_are_permuted_like_their_rows(biased, tmp_path):
    """Hand-derived: llama.cpp's converter permutes `q_proj.bias` / `k_proj.bias` as the weights'
    rows (LlamaModel.modify_tensors): each head's dimensions [first half | second half] become
    adjacent pairs, so a head of 16 holding 0..15 reads 0, 8, 1, 9, ..., 7, 15. v/o biases stay."""
    import gguf
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(biased, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.arange(64, dtype=torch.float32)  # 4 heads of 16
    weights["model.layers.0.self_attn.k_proj.bias"] = torch.arange(32, dtype=torch.float32)  # 2 kv heads
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    reader = gguf.GGUFReader(str(gguf_export.write_gguf(folder, tmp_path / "model.gguf", "f32")))
    head = [value for pair in zip(range(8), range(8, 16)) for value in pair]
    assert tensor(reader, "blk.0.attn_q.bias").tolist() == [16 * h + v for h in range(4) for v in head]
    assert tensor(reader, "blk.0.attn_k.bias").tolist() == [16 * h + v for h in range(2) for v in head]
    np.testing.assert_array_equal(
        tensor(reader, "blk.0.attn_v.bias"), weights["model.layers.0.self_attn.v_proj.bias"].numpy()
    )


def test_the_check_reads_a_biased_model_exactly(biased, tmp_path, monkeypatch):
    """transformers builds the reloaded Llama without biases unless told (llama.cpp adds every bias
    the file holds): the check tells it, so an f32 export's error is float noise (it was refused);
    biases left in the Hugging Face layout are caught at q8_0's tolerance."""
    path = gguf_export.write_gguf(biased, tmp_path / "model.gguf", "f32")
    assert gguf_check.llama_cpp_reading(path)[1] == {"attention_bias": True, "mlp_bias": False}
    assert gguf_check.gguf_logit_error(biased, path) <= gguf_export.GGUF_TYPES["f32"].tolerance
    rows = gguf_export.permute_rotary
    monkeypatch.setattr(gguf_export, "permute_rotary", lambda w, n_head: w if w.ndim == 1 else rows(w, n_head))
    unpermuted = gguf_export.write_gguf(biased, tmp_path / "unpermuted.gguf", "q8_0")
    assert gguf_check.gguf_logit_error(biased, unpermuted) > 10 * gguf_export.GGUF_TYPES["q8_0"].tolerance


# ------------------------------------------------------------------------------------------
# llama.cpp itself
# ------------------------------------------------------------------------------------------


LLAMA_CPP_F32 = 1e-4
"""llama.cpp's f32 against transformers: its own kernels and its f16 KV cache leave errors around
1e-6 here; a rope or bias laid out otherwise gives 0.05 and more (1 and more at 400 tokens)."""


def llama_cpp_errors(llama_cpp, folder, path, lengths=(8, 64, 400)) -> list[float]:
    """logit_error of llama.cpp's next-token logits against transformers' on random prompts."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = llama_cpp(path, n_ctx=1024)
    generator = torch.Generator().manual_seed(0)
    errors = []
    try:
        for n in lengths:
            ids = torch.randint(10, 2000, (n,), generator=generator).tolist()
            with torch.no_grad():
                expected = model(input_ids=torch.tensor([ids])).logits[0, -1]
            errors.append(gguf_check.logit_error(expected, torch.tensor(runner.logits(ids))))
    finally:
        runner.close()
    return errors


def test_llama_cpp_applies_the_scaled_rope_as_transformers(llama_cpp, scaled, tmp_path):
    _, folder = scaled
    path = gguf_export.write_gguf(folder, tmp_path / "model.gguf", "f32")
    assert max(llama_cpp_errors(llama_cpp, folder, path)) < LLAMA_CPP_F32


def test_llama_cpp_adds_the_biases_as_transformers(llama_cpp, biased, tmp_path):
    path = gguf_export.write_gguf(biased, tmp_path / "model.gguf", "f32")
    assert max(llama_cpp_errors(llama_cpp, biased, path)) < LLAMA_CPP_F32
