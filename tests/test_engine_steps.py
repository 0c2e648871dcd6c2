"""The engine's step reads the host once at its end, whatever the accumulation: figures, counts and
the gradient norm stay on the model's device until then (each .cpu(), float() or int() of a device
tensor is a sync on a GPU), and the weight check reads every parameter's peak in one go."""

from __future__ import annotations

import contextlib

import torch

from pipeline.engine.divergence import largest_weight
from pipeline.engine.steps import lm_train_step


@contextlib.contextmanager
def host_reads():
    """Counts the calls that move a tensor's value to the host (on a CPU they are free, on a GPU
    each one waits for the device)."""
    calls = {"n": 0}
    names = ("cpu", "item", "tolist", "__float__", "__int__", "__bool__")
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def counting(name):
        def wrapper(self, *a, **k):
            calls["n"] += 1
            return originals[name](self, *a, **k)

        return wrapper

    for n in names:
        setattr(torch.Tensor, n, counting(n))
    try:
        yield calls
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_):
        return type("Out", (), {"logits": self.head(self.embed(input_ids))})()


def _batches(n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 11, (2, 6), generator=g)
        labels = ids.clone()
        labels[:, :2] = -100
        out.append({"input_ids": ids, "labels": labels, "task_ids": torch.zeros_like(ids)})
    return out


def _reads(n_micro):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches(n_micro)
    with host_reads() as calls:
        result = lm_train_step(model, opt, batches, None, step=1, max_grad_norm=1.0)
    return calls["n"], result


def test_a_step_reads_the_host_as_often_with_8_micro_batches_as_with_1():
    one, r1 = _reads(1)
    eight, r8 = _reads(8)
    assert eight == one, f"host reads grow with accumulation: {one} for 1 micro-batch, {eight} for 8"
    assert r8.tokens == 8 * 2 * 6 and r8.task_tokens == [8 * 2 * 4] and r8.grad_norm > 0


def test_largest_weight_reads_the_host_once_and_sees_nan():
    params = [torch.randn(4, 4) for _ in range(30)] + [torch.tensor([-9.0])]
    with host_reads() as calls:
        assert largest_weight(params) == 9.0
    assert calls["n"] <= 2
    assert largest_weight(params + [torch.tensor([float("nan")])]) != largest_weight(params)
