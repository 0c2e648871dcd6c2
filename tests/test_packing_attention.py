"""Packed rows attend within their own document under every attention implementation and batch
size: each sample's logits and loss in a packed batch equal its own alone, and a packed step's
gradients equal a padded step's, for eager, sdpa, flash_attention_2 and flex_attention, at one row
and at several.

flash_attention_2 needs CUDA and the flash-attn package, so here transformers' own FA2 code path
(`_flash_attention_forward`: the varlen kwargs, the unpadding, the position-id inference) runs
with a reference kernel (per-sequence causal sdpa) in place of flash-attn's. flex attention has
no backward on a CPU and compiling it takes minutes on two cores, so here its forward runs
unfused (the same mask and scores; the fused kernel is PyTorch's business). The GPU-marked tests
at the end run the real kernels.

    HF_HUB_OFFLINE=1 python -m pytest -q tests/test_packing_attention.py
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from data_formats.collate import IGNORE_INDEX, AnswerPairCollator, Collator, PackedPairCollator, pack
from pipeline.engine.steps import model_inputs, token_losses, weighted_token_losses
from pipeline.modeling.attention import attention_implementation, block_causal_mask, document_attention, varlen_kwargs

SEQ = 24
LENGTHS = (7, 9, 5, 6, 8, 4)
"""Two rows of three documents each at SEQ = 24, balanced by `pack` into samples 0, 4, 5 (7 + 8 + 4 = 19
tokens: a padding tail at the batch's width of 20) and samples 1, 2, 3 (9 + 5 + 6 = 20)."""
IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flex_attention")
TRAINABLE = ("eager", "sdpa", "flash_attention_2")
"""flex attention has no CPU backward (PyTorch); its gradients are checked on the GPU."""


def _samples(count: int = len(LENGTHS), seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(LENGTHS[:count]):
        ids = [rng.randrange(10, 400) for _ in range(n)]
        prompt = 1 + i % 3
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:], "task_id": 0})
    return out


# ---- transformers' FA2 path with a reference kernel, and flex attention unfused -----------------


def _sdpa_bthd(q, k, v, causal, scale):
    """Causal sdpa on flash-attn's [B, T, H, D] layout (kv heads shared as flash-attn shares them)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.fixture
def reference_flash(monkeypatch):
    """transformers' flash-attention path on this CPU: flash-attn's functions replaced by sdpa per
    sequence. Returns the list of calls: ('dense', batch rows) or ('varlen', cu_seqlens)."""
    import transformers.modeling_flash_attention_utils as fa

    calls = []

    def flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False
    ):
        calls.append(("dense", q.shape[0]))
        return _sdpa_bthd(q, k, v, causal, softmax_scale)

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        deterministic=False,
    ):
        assert isinstance(max_seqlen_q, int) and torch.equal(cu_seqlens_q, cu_seqlens_k)
        assert cu_seqlens_q.dtype == torch.int32 and int(cu_seqlens_q[-1]) == q.shape[0]
        calls.append(("varlen", cu_seqlens_q.tolist()))
        bounds = cu_seqlens_q.tolist()
        assert max(b - a for a, b in zip(bounds, bounds[1:])) <= max_seqlen_q
        return torch.cat(
            [
                _sdpa_bthd(q[None, a:b], k[None, a:b], v[None, a:b], causal, softmax_scale)[0]
                for a, b in zip(bounds, bounds[1:])
            ]
        )

    functions = (flash_attn_func, flash_attn_varlen_func, None, fa._pad_input, fa._unpad_input)
    processing = (fa._lazy_define_process_function(flash_attn_varlen_func), dict)
    monkeypatch.setattr(fa, "lazy_import_flash_attention", lambda *args, **kwargs: (functions, processing))
    return calls


@pytest.fixture
def unfused_flex(monkeypatch):
    """transformers' flex-attention path without compiling flex attention (forward only on a CPU)."""
    import transformers.integrations.flex_attention as fx
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(
        fx,
        "compile_friendly_flex_attention",
        lambda q, k, v, training=False, **kwargs: flex_attention(q, k, v, **kwargs),
    )


def _model(path, attn: str, request=None):
    """The tiny model running `attn` (transformers reads `config._attn_implementation` at every forward)."""
    if attn == "flash_attention_2":
        request.getfixturevalue("reference_flash")
    if attn == "flex_attention":
        request.getfixturevalue("unfused_flex")
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    model.config._attn_implementation = attn
    return model.eval()


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**model_inputs(batch, model), use_cache=False).logits


def _spans(batch) -> list[tuple[int, slice]]:
    """(row, columns) of every real sample of a packed batch, in packing order."""
    out = []
    for row, segments in enumerate(batch["segment_ids"].tolist()):
        real = int((batch["task_ids"][row] >= 0).sum())
        for seg in range(max(segments[:real]) + 1):
            cols = [c for c in range(real) if segments[c] == seg]
            out.append((row, slice(cols[0], cols[-1] + 1)))
    return out


def _mean_loss(losses: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean of one sample's per-token losses over its supervised predictions ([n-1] each)."""
    mask = labels[1:] != IGNORE_INDEX
    return float(losses[mask].mean())


# ---- the varlen kwargs (FA2's batch > 1) --------------------------------------------------------


def test_varlen_kwargs_cover_two_rows_of_three_documents(tiny_model_dir, request):
    """cu_seq_lens over the flattened batch: every row boundary and every document start, the
    padding tail its own sequence; transformers' position-id inference says "not packed" at two
    rows, which is why the batch must carry them."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    batch = Collator(0, "pack", SEQ, "flash_attention_2")(_samples())
    assert batch["input_ids"].shape == (2, 20) and "attention_mask" not in batch
    assert not _is_packed_sequence(batch["position_ids"], batch_size=2)
    model = _model(tiny_model_dir, "flash_attention_2", request)
    inputs = model_inputs(batch, model)
    expected = [0, 7, 15, 19, 20, 29, 34, 40]  # row 0: 7, 8, 4, then 1 padding slot; row 1 from 20: 9, 5, 6
    assert inputs["cu_seq_lens_q"].tolist() == expected and inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["cu_seq_lens_k"] is inputs["cu_seq_lens_q"]
    assert inputs["max_length_q"] == inputs["max_length_k"] == 20 and "attention_mask" not in inputs
    # One segment per row still restarts at every row (segment id 0 on both sides of the boundary).
    assert varlen_kwargs(torch.zeros(2, 5, dtype=torch.long))["cu_seq_lens_q"].tolist() == [0, 5, 10]


def test_flash_path_runs_varlen_at_two_rows(tiny_model_dir, request):
    calls = request.getfixturevalue("reference_flash")
    model = _model(tiny_model_dir, "flash_attention_2", request)
    _logits(model, Collator(0, "pack", SEQ)(_samples()))
    layers = model.config.num_hidden_layers
    assert calls == [("varlen", [0, 7, 15, 19, 20, 29, 34, 40])] * layers


# ---- packed == alone, per sample, for every implementation and batch size -----------------------


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("attn", IMPLEMENTATIONS)
def test_packed_equals_alone_per_sample(tiny_model_dir, request, attn, rows):
    """Each sample's logits and mean loss in packed rows (the loss by the PT/SFT step's own
    `token_losses`) == the sample alone in a row without any mask (the loss from its logits).
    flex attention's sample alone runs on sdpa: without a mask of ours, transformers compiles a
    block mask for every length, minutes on two cores."""
    model = _model(tiny_model_dir, attn, request)
    samples = _samples(3 * rows)
    batch = Collator(0, "pack", SEQ, attn)(samples)
    assert batch["input_ids"].shape[0] == rows
    logits = _logits(model, batch)
    with torch.no_grad():
        losses, _ = token_losses(model, batch)
    spans = _spans(batch)
    order = [i for row in pack(samples, SEQ) for i in row["samples"]]  # the samples in packing order
    assert len(spans) == len(samples) and sorted(order) == list(range(len(samples)))
    if attn == "flex_attention":
        model.config._attn_implementation = "sdpa"
    for sample, (row, cols) in zip((samples[i] for i in order), spans):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([sample["input_ids"]]), use_cache=False).logits[0]
        torch.testing.assert_close(logits[row, cols], alone, rtol=0, atol=2e-5)
        labels = torch.tensor(sample["labels"])
        alone_loss = F.cross_entropy(alone[:-1], labels[1:], ignore_index=IGNORE_INDEX)
        packed_loss = _mean_loss(losses[row, cols.start : cols.stop - 1], batch["labels"][row, cols])
        assert packed_loss == pytest.approx(float(alone_loss), abs=1e-5)


@pytest.mark.parametrize("attn", IMPLEMENTATIONS)
def test_a_change_in_one_document_is_invisible_to_the_others(tiny_model_dir, request, attn):
    model = _model(tiny_model_dir, attn, request)
    samples = _samples()
    changed = [dict(samples[0], input_ids=[x + 1 for x in samples[0]["input_ids"]])] + samples[1:]
    base, other = (_logits(model, Collator(0, "pack", SEQ)(s)) for s in (samples, changed))
    assert not torch.equal(base[0, :7], other[0, :7])
    assert torch.equal(base[0, 7:], other[0, 7:]) and torch.equal(base[1], other[1])


@pytest.mark.parametrize("attn", TRAINABLE)
def test_packed_step_gradients_equal_padded(tiny_model_dir, request, attn):
    """The objective (summed token losses) and every parameter's gradient: packed rows == the same
    samples right-padded one per row."""
    model = _model(tiny_model_dir, attn, request).train()
    samples = _samples()
    ones = torch.ones(1)

    def grads(batch):
        model.zero_grad(set_to_none=True)
        objective, _, _ = weighted_token_losses(model, batch, ones)
        objective.backward()
        return float(objective.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed, padded = grads(Collator(0, "pack", SEQ, attn)(samples)), grads(Collator(0, "padding")(samples))
    assert packed[0] == pytest.approx(padded[0], rel=1e-6)
    for name, grad in packed[1].items():
        torch.testing.assert_close(grad, padded[1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_preference_pairs_score_as_padded(tiny_model_dir, request, attn):
    """DPO's packed sides (PackedPairCollator, several rows) reach the same per-document attention."""
    from pipeline.algorithms.preference import sequence_logps

    model = _model(tiny_model_dir, attn, request)
    s = _samples()
    pairs = [
        {
            "chosen_input_ids": s[i]["input_ids"],
            "chosen_answer_len": 3,
            "rejected_input_ids": s[i + 3]["input_ids"],
            "rejected_answer_len": 2,
        }
        for i in range(3)
    ]
    packed = PackedPairCollator(0, SEQ, attn)(pairs)
    assert packed["input_ids"].shape[0] > 1
    with torch.no_grad():
        sums_packed, counts_packed = sequence_logps(model, packed, None)
        sums_padded, counts_padded = sequence_logps(model, AnswerPairCollator(0)(pairs), None)
    assert counts_packed.tolist() == counts_padded.tolist()
    torch.testing.assert_close(sums_packed, sums_padded, rtol=0, atol=1e-4)


# ---- where and how the mask is built ------------------------------------------------------------


def test_the_collator_ships_segment_ids_and_the_model_side_builds_on_their_device():
    batch = Collator(0, "pack", SEQ)(_samples())
    assert max(t.numel() for t in batch.values()) == batch["input_ids"].numel()  # nothing [B, 1, T, T]
    segments = batch["segment_ids"].to("meta")  # no data: whatever is built, is built there
    for attn in ("sdpa", "eager"):
        mask = document_attention(segments, attn)["attention_mask"]
        assert mask.device.type == "meta" and mask.shape == (2, 1, 20, 20)
    dense = block_causal_mask(batch["segment_ids"])
    assert dense[0, 0, 19].tolist() == [False] * 19 + [True]  # the padding tail sees only itself
    flex = document_attention(batch["segment_ids"], "flex_attention")["attention_mask"]
    assert flex.shape == (2, 1, 20, 20) and torch.equal(_dense_of(flex), dense)
    with pytest.raises(ValueError, match="no per-document attention for attn_implementation 'paged'"):
        document_attention(batch["segment_ids"], "paged")


def _dense_of(block_mask) -> torch.Tensor:
    """[B, 1, T, T] bool of a BlockMask's mask_mod evaluated at every position."""
    b, _, q, kv = block_mask.shape
    grid = torch.stack(torch.meshgrid(torch.arange(q), torch.arange(kv), indexing="ij"))
    return torch.stack([block_mask.mask_mod(torch.tensor(i), torch.tensor(0), grid[0], grid[1]) for i in range(b)])[
        :, None
    ]


def test_the_implementation_is_read_through_wrappers(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager", dtype=torch.float32)
    wrapped = torch.nn.Module()
    wrapped.module = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))  # as DDP / DeepSpeed wrap
    assert attention_implementation(wrapped) == attention_implementation(model) == "eager"
    with pytest.raises(ValueError, match="cannot tell which attention Linear runs"):
        attention_implementation(torch.nn.Linear(2, 2))


def test_flex_attention_is_refused_on_a_cpu_before_the_model_loads():
    from pipeline.modeling.models import check_attn_implementation

    if torch.cuda.is_available():
        pytest.skip("CUDA present: flex attention is allowed")
    with pytest.raises(ValueError, match="flex_attention' trains on a CUDA GPU only"):
        check_attn_implementation("flex_attention")


# ---- the real kernels (GPU) ---------------------------------------------------------------------


def _flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


GPU_KERNELS = [
    pytest.param(
        "flash_attention_2", marks=pytest.mark.skipif(not _flash_attn_installed(), reason="flash-attn not installed")
    ),
    "flex_attention",
    "sdpa",
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: flash-attn and compiled flex attention kernels")
@pytest.mark.parametrize("attn", GPU_KERNELS)
def test_packed_equals_alone_on_cuda_kernels(tiny_model_dir, attn):
    """bf16 on CUDA with the real kernels (flex attention compiled, backward included), two rows of
    three documents: each sample's loss as alone, the second row untouched by a change to the first
    row's first document, a packed step's objective and gradients as a padded one's (bf16 rounding
    apart)."""
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn, dtype=torch.bfloat16).to("cuda")
    on_cuda = lambda batch: {k: v.cuda() for k, v in batch.items()}
    samples = _samples()
    batch = on_cuda(Collator(0, "pack", SEQ, attn)(samples))
    changed = [dict(samples[0], input_ids=[x + 1 for x in samples[0]["input_ids"]])] + samples[1:]
    model.eval()
    logits = _logits(model, batch)
    assert torch.equal(logits[1], _logits(model, on_cuda(Collator(0, "pack", SEQ)(changed)))[1])
    with torch.no_grad():
        losses, _ = token_losses(model, batch)
        order = [i for row in pack(samples, SEQ) for i in row["samples"]]  # the samples in packing order
        for sample, (row, cols) in zip((samples[i] for i in order), _spans(batch)):
            alone = on_cuda(Collator(0, "padding")([sample]))
            alone_losses, _ = token_losses(model, alone)
            packed_loss = _mean_loss(losses[row, cols.start : cols.stop - 1], batch["labels"][row, cols])
            assert packed_loss == pytest.approx(_mean_loss(alone_losses[0], alone["labels"][0]), abs=3e-2)
    model.train()
    ones = torch.ones(1, device="cuda")
    steps = []
    for b in (batch, on_cuda(Collator(0, "padding")(samples))):
        model.zero_grad(set_to_none=True)
        objective, _, _ = weighted_token_losses(model, b, ones)
        objective.backward()
        steps.append((float(objective), torch.cat([p.grad.float().flatten() for p in model.parameters()])))
    assert steps[0][0] == pytest.approx(steps[1][0], rel=2e-2)
    assert float((steps[0][1] - steps[1][1]).norm() / steps[1][1].norm()) < 5e-2
