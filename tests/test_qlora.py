"""QLoRA on CPU: a 4-bit nf4 base (bitsandbytes) with LoRA trains, and its adapter merges into the
full-precision base (dequantised merge, see pipeline/modeling/merge.py)."""

from __future__ import annotations

import json

import bitsandbytes as bnb
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.config import LoraConfig, ModelConfig
from pipeline.modeling.merge import merge_adapter
from pipeline.modeling.models import load_model, trainable_parameter_names

TEXT = "<|im_start|>user\nName a prime number.<|im_end|>\n<|im_start|>assistant\nSeven is prime.<|im_end|>\n"
STEPS = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on the shared, busy 2-core machine two threads thrash (a QLoRA step
    and an embedded-model forward both ran 10-25x slower with 2), and tiny models gain nothing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """(model, batch, losses, adapter folder) after STEPS AdamW steps of QLoRA on one batch."""
    torch.manual_seed(0)
    cfg = ModelConfig(path=str(tiny_model_dir), finetuning="qlora", gradient_checkpointing=True)
    model = load_model(cfg, LoraConfig(r=8, alpha=16, dropout=0.0))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # On a GPU the 4-bit base loads onto it (load_model's device_map); the batch follows it.
    batch = {k: v.to(model.device) for k, v in tokenizer([TEXT], return_tensors="pt").items()}
    batch["labels"] = batch["input_ids"].clone()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.eval()
    adapter = tmp_path_factory.mktemp("qlora") / "adapter"
    model.save_pretrained(adapter)
    return model, batch, losses, adapter


def test_qlora_base_is_4bit_nf4_double_quant_and_only_lora_trains(trained):
    model, _, _, _ = trained
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit)
    state = q_proj.base_layer.weight.quant_state
    assert state.quant_type == "nf4" and state.nested
    names = trainable_parameter_names(model)
    assert names and all("lora_A" in n or "lora_B" in n for n in names)


def test_qlora_loss_falls(trained):
    _, _, losses, _ = trained
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.75, losses


def test_qlora_adapter_merges_into_the_full_precision_base(trained, tiny_model_dir, tmp_path):
    model, batch, losses, adapter = trained
    merged = merge_adapter(str(tiny_model_dir), str(adapter), str(tmp_path / "merged"), stage="sft")
    full = AutoModelForCausalLM.from_pretrained(merged).to(model.device).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(model.device).eval()
    with torch.no_grad():
        merged_loss = full(**batch).loss.item()
        base_loss = base(**batch).loss.item()
        quantized_loss = model(**batch).loss.item()
        logit_gap = (full(**batch).logits - model(**batch).logits).abs().max().item()
    # Merging dequantises: W + BA instead of nf4(W) + BA, so the merged model is close to the 4-bit
    # one it was trained as (off by W's quantisation error) and keeps what training learned.
    assert merged_loss < base_loss - 0.75, (merged_loss, base_loss)
    assert abs(merged_loss - quantized_loss) < 0.1 * (base_loss - merged_loss), (merged_loss, quantized_loss, base_loss)
    manifest = json.loads((merged / "manifest.json").read_text())
    assert manifest["merge_check"]["reload_max_abs_diff"] < 1e-3
    print(
        f"qlora: losses {losses[0]:.3f}->{losses[-1]:.3f}; base {base_loss:.3f}, 4-bit {quantized_loss:.4f}, "
        f"merged {merged_loss:.4f}, max |logit| 4-bit vs merged {logit_gap:.4f}"
    )


def test_an_eval_forward_leaves_the_4bit_base_trainable(tiny_model_dir, monkeypatch):
    """On a CPU with AVX512-BF16 bitsandbytes repacks a 4-bit layer, after its first eval-mode forward
    without grad, for a bf16 kernel that has no backward (pipeline/modeling/models.py
    `_keep_the_trainable_4bit_layout`); its flag is forced on here, as such a CPU sets it. A QLoRA
    model trains after a sampled rollout or a held-out evaluation with the loss and gradients of one
    that never evaluated: every adapter gets its gradient (before the fix: none below the last
    4-bit layer; measured on an AMD EPYC with AVX512-BF16)."""
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True, raising=False)  # 0.48 has no repack
    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))

    def step(evaluate_first: bool):
        torch.manual_seed(0)
        model = load_model(ModelConfig(path=str(tiny_model_dir), finetuning="qlora"), LoraConfig(dropout=0.0))
        ids = tokens.to(model.device)  # on a GPU the 4-bit base loads onto it (and bitsandbytes repacks nothing)
        if evaluate_first:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids[:1, :3])
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    (want, want_grads), (got, got_grads) = step(False), step(True)
    assert torch.equal(got, want)
    assert got_grads.keys() == want_grads.keys()
    assert all(torch.equal(got_grads[k], want_grads[k]) for k in want_grads)
    assert all(bool(g.abs().max() > 0) for k, g in got_grads.items() if "lora_B" in k)
