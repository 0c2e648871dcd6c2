"""Shared loop pieces: token-normalised accumulation (1x8 == 8x1 == 2x4, none and case3), the
non-finite stop, data order and evaluation sharding."""

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from data_formats.collate import Collator
from data_formats.sampling import DataCursor, epoch_order, next_micro_batches
from pipeline.algorithms.multitask import step_weights, task_weighted_loss
from pipeline.engine.held_out import eval_shards
from pipeline.engine.steps import NonFiniteError, check_finite, token_losses
from pipeline.engine.steps import lm_train_step as train_step
from pipeline.engine.tracking import EarlyStopping


class Capture:
    """An optimizer stand-in that records the gradients it is asked to step on."""

    def __init__(self, model):
        self.model = model
        self.grads = None
        self.steps = 0

    def step(self):
        self.steps += 1
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread (see test_pt_sft.fresh_accelerate_state for why)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()


def samples():
    """Eight samples of two tasks with different lengths and supervised spans."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(8):
        n = 5 + (i * 3) % 7
        ids = torch.randint(10, 4000, (n,), generator=g).tolist()
        labels = [-100] * (n // 2) + ids[n // 2 :]
        out.append({"input_ids": ids, "labels": labels, "task_id": 0 if i < 6 else 1})
    return out


def step(model, split, mode, weights=None):
    collate = Collator(0, "padding", 64)
    data = samples()
    batches = []
    start = 0
    for size in split:
        batches.append(collate(data[start : start + size]))
        start += size
    opt = Capture(model)
    result = train_step(model, opt, batches, None, step=1, num_tasks=2, task_weights=step_weights(mode, weights, 2))
    return result, opt.grads


@pytest.mark.parametrize("mode,weights", [("none", None), ("case3", [1.0, 3.0])])
def test_accumulation_is_invariant_to_the_split(model, mode, weights):
    whole, g_whole = step(model, [8], mode, weights)
    for split in ([1] * 8, [3, 5]):
        part, g_part = step(model, split, mode, weights)
        assert part.loss == pytest.approx(whole.loss, rel=1e-6)
        for name, grad in g_whole.items():
            torch.testing.assert_close(g_part[name], grad, rtol=1e-4, atol=1e-6)
    # The loss is the one-batch definition of the mode...
    with torch.no_grad():
        losses, tasks = token_losses(model, Collator(0, "padding", 64)(samples()))
    direct, _ = task_weighted_loss(losses, tasks, mode, weights, num_tasks=2)
    assert whole.loss == pytest.approx(direct.item(), rel=1e-6)
    # ...and a naive mean of per-micro-batch losses (the negative control) is not.
    naive = []
    for s in samples():
        with torch.no_grad():
            losses, t = token_losses(model, Collator(0, "padding", 64)([s]))
        naive.append(task_weighted_loss(losses, t, mode, weights, num_tasks=2)[0].item())
    assert abs(sum(naive) / len(naive) - whole.loss) > 1e-3


def test_case3_differs_from_token_mean(model):
    none, _ = step(model, [8], "none")
    case3, _ = step(model, [8], "case3")
    assert none.task_tokens == case3.task_tokens
    mean_of_tasks = sum(case3.task_losses) / 2
    assert case3.loss == pytest.approx(mean_of_tasks, rel=1e-6)
    assert abs(none.loss - case3.loss) > 1e-4


def test_non_finite_stops_before_the_optimizer_steps(tiny_model_dir):
    bad = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        bad.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    before = copy.deepcopy(bad.state_dict())
    opt = Capture(bad)
    with pytest.raises(NonFiniteError, match="step 7"):
        train_step(bad, opt, [Collator(0, "padding", 64)(samples()[:2])], None, step=7)
    assert opt.steps == 0
    for name, value in bad.state_dict().items():
        assert torch.equal(value, before[name]) or torch.isnan(value).any()


def test_batch_order_is_a_function_of_seed_and_epoch_and_the_split():
    assert epoch_order(10, 1, 0) == epoch_order(10, 1, 0)
    assert epoch_order(10, 1, 0) != epoch_order(10, 1, 1)
    one, cur1 = next_micro_batches(10, DataCursor(), seed=1, batch_size=4, grad_accum=2)
    r0, cur2 = next_micro_batches(10, DataCursor(), seed=1, batch_size=2, grad_accum=2, world_size=2, rank=0)
    r1, _ = next_micro_batches(10, DataCursor(), seed=1, batch_size=2, grad_accum=2, world_size=2, rank=1)
    assert sorted(sum(one, [])) == sorted(sum(r0 + r1, []))
    assert cur1 == cur2 == DataCursor(0, 8)  # two global micro-batches of 4 samples
    # The epoch rolls over: 10 samples give two global micro-batches of 4, then epoch 1 starts.
    three, cur = next_micro_batches(10, DataCursor(0, 8), seed=1, batch_size=4, grad_accum=1)
    assert cur == DataCursor(1, 4) and three[0] == epoch_order(10, 1, 1)[:4]
    with pytest.raises(ValueError, match="cannot fill"):
        next_micro_batches(3, DataCursor(), seed=1, batch_size=2, grad_accum=1, world_size=2)


def test_eval_shards_count_every_sample_once_with_equal_batches_per_rank():
    shards = [eval_shards(5, 2, 2, r) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 2
    counted = [i for rank in shards for idx, counts in rank if counts for i in idx]
    assert sorted(counted) == [0, 1, 2, 3, 4]


def test_early_stopping():
    early = EarlyStopping(patience=2)
    assert [early.update(x) for x in (3.0, 2.0, 2.5, 2.1)] == [False, False, False, True]
    clone = EarlyStopping(patience=2)
    clone.load_state_dict(early.state_dict())
    assert clone.best == 2.0 and clone.stalls == 2 and not math.isinf(clone.best)


def test_the_fused_optimizer_updates_as_the_reference_adamw():
    """build_optimizer takes torch's fused AdamW kernel where it can (TRL's default too); its
    updates equal the per-parameter reference implementation (foreach=False) within fp32 rounding,
    weight decay groups included."""
    from types import SimpleNamespace

    from pipeline.engine.accelerator import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    cfg = SimpleNamespace(learning_rate=1e-2, beta1=0.9, beta2=0.95, epsilon=1e-8, weight_decay=0.1)
    fused = build_optimizer(model, cfg)
    assert fused.defaults["fused"] is True
    params = list(twin.parameters())
    reference = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    x = torch.randn(32, 8)
    for _ in range(5):
        for m, opt in ((model, fused), (twin, reference)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _with_grads(*values):
    model = torch.nn.Linear(len(values), 1, bias=False)
    model.weight.grad = torch.tensor([values])
    return model


def test_a_finite_gradient_norm_clears_the_step_without_the_parameter_scan():
    # Every step already has the global norm (clip_gradients); a NaN or inf gradient makes it
    # non-finite, so a finite one needs no pass over every gradient (issue 33: 0.26 s a step on
    # the 135M model). The gradient here is deliberately NaN to show the scan did not run.
    check_finite(1.0, _with_grads(1.0, float("nan")), 3, grad_norm=2.0)
    with pytest.raises(NonFiniteError, match="step 3: gradient of weight is not finite"):
        check_finite(1.0, _with_grads(1.0, float("nan")), 3, grad_norm=float("nan"))
    with pytest.raises(NonFiniteError, match="step 3: gradient norm is inf"):  # overflowed from finite gradients
        check_finite(1.0, _with_grads(3e38, 3e38), 3, grad_norm=float("inf"))
    check_finite(
        1.0, torch.nn.Linear(2, 1), 3, grad_norm=float("inf")
    )  # no gradient held here (DeepSpeed's engine keeps them)
    with pytest.raises(NonFiniteError, match="step 3: gradient of weight"):  # no norm given: the scan
        check_finite(1.0, _with_grads(float("inf"), 0.0), 3)
    with pytest.raises(NonFiniteError, match="step 3: loss is nan"):
        check_finite(float("nan"), _with_grads(1.0, 1.0), 3, grad_norm=1.0)
