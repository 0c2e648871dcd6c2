"""The LM head and cross-entropy at supervised positions only (pipeline.engine.supervised_head)
equal the full-logits path: per-token losses, the weighted objective and every gradient, for
LoRA and full fine-tuning, tied and untied heads, a head with a bias, chunks smaller than the
rows, and a model whose logits are post-processed (which must fall back to the full path)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from test_training import one_thread  # noqa: F401  (autouse: one intra-op thread)
from transformers import AutoModelForCausalLM

from data_formats.collate import Collator
from pipeline.algorithms.multitask import token_weights
from pipeline.engine import supervised_head
from pipeline.engine.steps import full_logits_token_losses, weighted_token_losses


def batch(seed=3, tasks=2):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(6):
        n = 7 + (i * 5) % 11
        ids = torch.randint(10, 4000, (n,), generator=g).tolist()
        labels = [-100] * (n // 2) + ids[n // 2 :]
        rows.append({"input_ids": ids, "labels": labels, "task_id": i % tasks})
    return Collator(0, "padding", 64)(rows)


def both_paths(model, data, weights):
    """(objective, losses, grads) from the supervised-rows path and from the full logits."""
    results = []
    for fast in (True, False):
        m = copy.deepcopy(model)
        m._relay_head_split_exact = None
        if not fast:
            m._relay_head_split_exact = False  # forces the full-logits path
        objective, losses, _ = weighted_token_losses(m, data, weights)
        objective.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        results.append((objective.detach(), losses.detach(), grads))
    return results


def assert_same(fast, full):
    torch.testing.assert_close(fast[0], full[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast[1], full[1], rtol=1e-5, atol=1e-5)
    assert fast[2].keys() == full[2].keys() and fast[2]
    for name in full[2]:
        torch.testing.assert_close(fast[2][name], full[2][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("tied", [True, False])
def test_full_finetuning_losses_and_gradients_equal_the_full_logits(tiny_model_dir, tied):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=tied).train()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    weights = token_weights(torch.tensor([7.0, 5.0]), "case3", [1.0, 3.0])
    assert_same(*both_paths(model, batch(), weights))


def test_lora_gradients_equal_the_full_logits(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
    )
    for name, p in model.named_parameters():  # LoRA B starts at 0: give it values so every path is exercised
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    fast, full = both_paths(model.train(), batch(tasks=1), token_weights(torch.tensor([30.0]), "none"))
    assert all("lora_" in n for n in full[2])
    assert_same(fast, full)


def test_chunks_bias_and_no_grad_rows(monkeypatch):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(37, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    coef = torch.rand(37)
    total, rows = supervised_head.fused_weighted_cross_entropy(hidden, head, labels, coef, chunk=8)
    (3.0 * total).backward()
    fused = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad = head.weight.grad = head.bias.grad = None
    reference = F.cross_entropy(head(hidden), labels, reduction="none")
    (3.0 * (reference * coef).sum()).backward()
    torch.testing.assert_close(rows, reference.detach())
    torch.testing.assert_close(total, (reference * coef).sum().detach())
    for got, want in zip(fused, (hidden.grad, head.weight.grad, head.bias.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        total, rows = supervised_head.fused_weighted_cross_entropy(hidden, head, labels, coef, chunk=8)
    torch.testing.assert_close(rows, reference.detach())


def test_post_processed_logits_fall_back_to_the_full_path(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    real_forward = model.forward

    def soft_capped(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        out.logits = 30.0 * torch.tanh(out.logits / 30.0)
        return out

    model.forward = soft_capped
    assert supervised_head.head_split(model) is None
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert supervised_head.head_split(plain) is plain.lm_head


def test_eval_losses_equal_the_full_logits_and_never_build_them(tiny_model_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    data = batch()
    with torch.no_grad():
        want, tasks = full_logits_token_losses(model, data)
        assert supervised_head.head_split(model) is model.lm_head  # (its one-off exactness check runs here)
        head_calls, rows = [], []
        model.lm_head.register_forward_hook(lambda module, args, out: head_calls.append(out.shape))
        real = supervised_head.fused_weighted_cross_entropy
        monkeypatch.setattr(
            supervised_head,
            "fused_weighted_cross_entropy",
            lambda hidden, *a, **k: (rows.append(hidden.shape[0]), real(hidden, *a, **k))[1],
        )
        _, got, got_tasks = weighted_token_losses(model, data, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(tasks, got_tasks)
    assert head_calls == []  # the [B, T, V] logits were never built
    assert rows == [int((data["labels"][:, 1:] != -100).sum())]  # the head ran on supervised rows only


def test_chunked_token_logps_and_gradients_equal_log_softmax():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(37, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    upstream = torch.randn(37)
    got = supervised_head.token_logps(hidden, head, labels, chunk=8)
    (got * upstream).sum().backward()
    mine = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad = head.weight.grad = head.bias.grad = None
    want = torch.log_softmax(head(hidden), -1).gather(1, labels.unsqueeze(1)).squeeze(1)
    (want * upstream).sum().backward()
    torch.testing.assert_close(got, want.detach())
    for a, b in zip(mine, (hidden.grad, head.weight.grad, head.bias.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_dpo_sequence_logps_and_gradients_equal_the_full_logits(tiny_model_dir, packed):
    """DPO's summed answer log-probs (plain and packed pairs) and the policy's gradients through
    them, against the full-logits path (`pref.token_logps` over every position)."""
    from peft import LoraConfig, get_peft_model

    from pipeline.algorithms.preference import sequence_logps

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
    ).train()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    data = batch()
    if packed:  # two rows of three samples each, sample_index naming them
        data["sample_index"] = torch.where(
            data["labels"] != -100, torch.arange(6).view(6, 1), torch.full_like(data["labels"], -1)
        )
    results = []
    for exact in (None, False):
        m = copy.deepcopy(model)
        m.get_base_model()._relay_head_split_exact = exact
        sums, counts = sequence_logps(m, data, None)
        (sums * torch.linspace(-1, 1, sums.shape[0])).sum().backward()
        results.append(
            (sums.detach(), counts, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
        )
    (s1, c1, g1), (s2, c2, g2) = results
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-4)
    assert torch.equal(c1, c2) and g1.keys() == g2.keys() and g1
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)
