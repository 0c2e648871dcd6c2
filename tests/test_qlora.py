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
    `_keep_the_trainable_4bit_layout`); its flag is forced on here, as such a CPU sets it. After a
    forward as a rollout or a held-out evaluation makes, a QLoRA model's loss and adapter gradients
    are those of plain torch on the dequantized weights with the same adapters (peft's LoRA on
    fp32 linears): before the fix no adapter below the last 4-bit layer got a gradient (bench/RESULTS.md)."""
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True, raising=False)  # 0.48 has no repack
    torch.manual_seed(0)
    lora = LoraConfig(dropout=0.0)
    model = load_model(ModelConfig(path=str(tiny_model_dir), finetuning="qlora", dtype="fp32"), lora)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0)).to(model.device)
    # the reference: the same adapters on fp32 linears holding the 4-bit weights dequantized
    reference = load_model(ModelConfig(path=str(tiny_model_dir), finetuning="lora", dtype="fp32"), lora)
    reference.to(model.device)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert quantized
    with torch.no_grad():
        for name, layer in reference.named_modules():
            if name in quantized:
                weight = bnb.functional.dequantize_4bit(quantized[name].weight.data, quantized[name].weight.quant_state)
                layer.weight.copy_(weight.to(layer.weight.dtype))
        trained = dict(model.named_parameters())
        for name, param in reference.named_parameters():
            if param.requires_grad:
                param.copy_(trained[name])
    model.eval()
    with torch.no_grad():
        model(input_ids=ids[:1, :3])  # a sampled rollout's forward
    losses = []
    for net in (model, reference):
        net.train()
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and any("layers.0." in k for k in got)
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=1e-4, atol=1e-6, msg=name)
    assert all(bool(g.abs().max() > 0) for k, g in got.items() if "lora_B" in k)
