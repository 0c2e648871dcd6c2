"""pipeline.modeling.models: from_pretrained arguments, trainable sets, pad tokens, adapters on/off."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

import pipeline.modeling.models as models
from pipeline.config import LoraConfig, ModelConfig
from pipeline.modeling.embedded import resolve_model_path
from pipeline.modeling.models import (
    apply_lora,
    ensure_pad_token,
    load_model,
    load_tokenizer,
    resolve_dtype,
    trainable_parameter_names,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on the shared, busy 2-core machine two threads thrash (a QLoRA step
    and an embedded-model forward both ran 10-25x slower with 2), and tiny models gain nothing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _lora(**kw) -> LoraConfig:
    return LoraConfig(**{"r": 4, "alpha": 8, "dropout": 0.0, **kw})


def _perturb(model, seed: int = 0) -> None:
    """Make the adapter non-zero (LoRA's B starts at zero, so a fresh adapter changes nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)


def _batch():
    ids = torch.tensor([[1, 504, 2994, 28, 2], [1, 17, 42, 0, 0]])
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


def test_resolve_model_path_and_dtype(embedded_path):
    assert resolve_model_path("embedded") == str(embedded_path)
    assert resolve_model_path(None) == str(embedded_path)
    assert resolve_model_path("/some/folder") == "/some/folder"
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("fp16") is torch.float16
    if not torch.cuda.is_available():
        assert resolve_dtype("auto") is torch.float32
    with pytest.raises(ValueError, match="'fp8' is not one of"):
        resolve_dtype("fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_flash_attention_is_refused_without_cuda(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir), attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="flash_attention_2' needs a CUDA GPU"):
        load_model(cfg)


@pytest.mark.parametrize("trust", [False, True])
def test_from_pretrained_gets_safe_arguments(tiny_model_dir, monkeypatch, trust):
    seen = {}
    real = models.AutoModelForCausalLM.from_pretrained

    def spy(path, **kwargs):
        seen.update(kwargs, path=path)
        return real(path, **kwargs)

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", spy)
    cfg = ModelConfig(path=str(tiny_model_dir), finetuning="full", attn_implementation="eager")
    if trust:
        cfg.trust_remote_code = True
    model = load_model(cfg)
    assert seen["path"] == str(tiny_model_dir)
    assert seen["trust_remote_code"] is trust
    assert seen["use_safetensors"] is True
    assert seen["dtype"] is torch.float32 and seen["attn_implementation"] == "eager"
    assert "quantization_config" not in seen
    assert model.config._attn_implementation == "eager"


def test_full_finetuning_trains_everything(tiny_model_dir):
    model = load_model(ModelConfig(path=str(tiny_model_dir), finetuning="full"), _lora())
    assert not hasattr(model, "peft_config")
    assert trainable_parameter_names(model) == [n for n, _ in model.named_parameters()]


def test_lora_causal_trains_exactly_the_adapters(tiny_model_dir):
    model = load_model(ModelConfig(path=str(tiny_model_dir), finetuning="lora"), _lora())
    expected = sorted(
        f"base_model.model.model.layers.{layer}.{'self_attn' if m in LINEARS[:4] else 'mlp'}"
        f".{m}.lora_{ab}.default.weight"
        for layer in range(2)
        for m in LINEARS
        for ab in "AB"
    )
    assert sorted(trainable_parameter_names(model)) == expected


def test_lora_reward_also_trains_the_score_head(tiny_reward_dir):
    model = load_model(ModelConfig(path=str(tiny_reward_dir), finetuning="lora"), _lora(), kind="reward")
    names = trainable_parameter_names(model)
    assert [n for n in names if "lora_" not in n] == ["base_model.model.score.modules_to_save.default.weight"]
    assert len(names) == 2 * len(LINEARS) * 2 + 1
    assert model.config.pad_token_id == 0


def test_gradient_checkpointing_with_lora_gives_the_same_gradients(tiny_model_dir):
    grads = []
    for checkpointing in (False, True):
        cfg = ModelConfig(path=str(tiny_model_dir), finetuning="lora", gradient_checkpointing=checkpointing)
        torch.manual_seed(0)
        model = load_model(cfg, _lora())
        _perturb(model)
        model.train()
        batch = _batch()
        model(**batch, labels=batch["input_ids"]).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[1]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] is not None
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_disable_adapter_gives_the_exact_base_scores(tiny_reward_dir):
    base = AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir, num_labels=1).eval()
    batch = _batch()
    with torch.no_grad():
        base_scores = base(**batch).logits
        model = load_model(ModelConfig(path=str(tiny_reward_dir), finetuning="lora"), _lora(), kind="reward").eval()
        _perturb(model)
        adapted = model(**batch).logits
        with model.disable_adapter():
            disabled = model(**batch).logits
        again = model(**batch).logits
    assert (adapted - base_scores).abs().min() > 1e-3, "negative control: the adapter must change the scores"
    assert torch.equal(disabled, base_scores)
    assert torch.equal(again, adapted)


def test_apply_lora_adds_a_named_second_adapter(tiny_model_dir):
    model = load_model(ModelConfig(path=str(tiny_model_dir), finetuning="full"))
    model = apply_lora(model, _lora(), adapter_name="policy")
    model = apply_lora(model, _lora(r=2), adapter_name="critic")
    assert set(model.peft_config) == {"policy", "critic"}
    assert model.active_adapter == "critic"
    with pytest.raises(ValueError, match="already has an adapter named 'policy'"):
        apply_lora(model, _lora(), adapter_name="policy")


def test_reward_pad_id_makes_padding_irrelevant(tiny_reward_dir):
    model = load_model(ModelConfig(path=str(tiny_reward_dir), finetuning="full"), kind="reward").eval()
    batch = _batch()
    with torch.no_grad():
        padded = model(**batch).logits[1]
        alone = model(input_ids=batch["input_ids"][1:, :3]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)


def test_pad_token_kept_when_distinct(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 0


def test_missing_pad_uses_an_unused_special_token(tiny_model_dir, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    with caplog.at_level("WARNING", logger="pipeline.modeling.models"):
        assert ensure_pad_token(tokenizer) is False
    assert (
        tokenizer.pad_token == "<|endoftext|>"
        and len(tokenizer) == AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    )
    assert "has no pad token" in caplog.text


def test_pad_equal_to_eos_is_replaced(tiny_model_dir, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    with caplog.at_level("WARNING", logger="pipeline.modeling.models"):
        ensure_pad_token(tokenizer)
    assert tokenizer.pad_token_id == 0 and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert "a token it trains on" in caplog.text


def test_pad_token_added_and_embeddings_resized_when_nothing_is_free(tiny_model_dir, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    n = len(tokenizer)
    tokenizer.eos_token = "<|endoftext|>"  # now unk == eos, so no existing token is free
    tokenizer.pad_token = None
    with caplog.at_level("WARNING", logger="pipeline.modeling.models"):
        assert ensure_pad_token(tokenizer) is True
        model = load_model(ModelConfig(path=str(tiny_model_dir), finetuning="full"), tokenizer=tokenizer)
    assert tokenizer.pad_token == models.ADDED_PAD_TOKEN and tokenizer.pad_token_id == n
    assert model.get_input_embeddings().weight.shape[0] == n + 1
    assert model.config.pad_token_id == n
    assert "added '<|relay_pad|>'" in caplog.text and "resizing embeddings" in caplog.text


def test_qlora_needs_a_lora_config(tiny_model_dir):
    with pytest.raises(ValueError, match="'qlora' but no LoRA config"):
        load_model(ModelConfig(path=str(tiny_model_dir), finetuning="qlora"))


def test_all_linear_cannot_be_mixed():
    with pytest.raises(ValueError, match="cannot be combined"):
        models.peft_lora_config(_lora(target_modules=["all-linear", "q_proj"]))
