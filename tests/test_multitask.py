"""Task-weighted losses (none / case3) and CoBa weights on constructed losses, checked by hand."""

import math

import pytest
import torch

from pipeline.multitask import CoBa, fit_slope, task_weighted_loss, token_weights

LOSSES = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
TASKS = torch.tensor([[0, 0, 1, -1]])  # the 4.0 token is unsupervised


def test_none_is_the_token_mean():
    loss, means = task_weighted_loss(LOSSES, TASKS, "none", num_tasks=2)
    assert loss.item() == pytest.approx(2.0)
    assert means.tolist() == [1.5, 3.0]


def test_case3_averages_task_means():
    loss, _ = task_weighted_loss(LOSSES, TASKS, "case3", num_tasks=2)
    assert loss.item() == pytest.approx((1.5 + 3.0) / 2)
    loss, _ = task_weighted_loss(LOSSES, TASKS, "case3", [1.0, 3.0])
    assert loss.item() == pytest.approx((1.5 * 1 + 3.0 * 3) / 4)


def test_absent_task_is_left_out_of_the_normalisation():
    loss, means = task_weighted_loss(LOSSES, TASKS, "case3", [1.0, 3.0, 5.0])
    assert loss.item() == pytest.approx((1.5 * 1 + 3.0 * 3) / 4)
    assert math.isnan(means[2].item())


def test_token_weights_are_per_token_shares():
    w = token_weights(torch.tensor([2.0, 1.0, 0.0]), "case3")
    assert w.tolist() == [0.25, 0.5, 0.0]
    assert token_weights(torch.tensor([2.0, 1.0]), "none").tolist() == pytest.approx([1 / 3, 1 / 3])
    with pytest.raises(ValueError, match="entries"):
        token_weights(torch.tensor([2.0, 1.0]), "case3", [1.0])
    with pytest.raises(ValueError, match="not one of"):
        token_weights(torch.tensor([1.0]), "case4")


def test_fit_slope():
    assert fit_slope([1.0, 0.5, 0.5]) == pytest.approx(-0.25)
    assert fit_slope([3.0]) == 0.0


def sm(*xs):
    e = [math.exp(x) for x in xs]
    return [v / sum(e) for v in e]


def test_coba_uniform_during_warmup_then_rcs_dominates():
    coba = CoBa(2, warmup_steps=2, history_length=3, tau=1.0)
    coba.update([2.0, 4.0])
    assert coba.weights() == [0.5, 0.5]
    coba.update([1.0, 4.0])  # relative losses [.5, 1]: slopes -0.5 and 0, total slope 0 -> DF = 1
    rcs = sm(-2.0, 0.0)  # softmax(K * slope / sum|slope|)
    want = sm(2 * rcs[0], 2 * rcs[1])
    assert coba.weights() == pytest.approx(want, abs=1e-12)
    assert coba.weights()[0] == pytest.approx(0.178993, abs=1e-6)  # the fast-converging task gets less


def test_coba_divergence_factor_mixes_in_acs_and_state_roundtrips():
    coba = CoBa(2, warmup_steps=2, history_length=3, tau=1.0)
    for losses in ([2.0, 4.0], [1.0, 4.0], [1.0, 6.0]):
        coba.update(losses)
    # slopes over [1, .5, .5] and [1, 1, 1.5]: -0.25, +0.25; total (max row) slope 0.25
    rcs = sm(-1.0, 1.0)
    acs = sm(2 / 3, -2.0)  # -M * s / sum|s| of slope histories [-.5, -.25] and [0, .25], latest
    df = 2 * sm(0.0, -2.0)[1]  # divergence over total slopes [0, .25]
    logits = [df * r + (1 - df) * a for r, a in zip(rcs, acs)]
    want = sm(2 * logits[0], 2 * logits[1])
    assert coba.weights() == pytest.approx(want, abs=1e-12)
    clone = CoBa(2, warmup_steps=2, history_length=3, tau=1.0)
    clone.load_state_dict(coba.state_dict())
    clone.update([0.9, 6.0]), coba.update([0.9, 6.0])
    assert clone.weights() == coba.weights()


def test_coba_floor():
    coba = CoBa(2, warmup_steps=2, history_length=3, tau=1.0, min_weight=0.3)
    coba.update([2.0, 4.0]), coba.update([1.0, 4.0])
    raw = sm(*[2 * r for r in sm(-2.0, 0.0)])
    assert coba.weights() == pytest.approx([w * (1 - 0.6) + 0.3 for w in raw], abs=1e-12)
    with pytest.raises(ValueError, match="finite"):
        coba.update([float("inf"), 1.0])
    coba.update([float("nan"), 4.0])  # task 0 absent: its previous relative loss (0.5) repeats
    assert coba.history[-1] == [0.5, 1.0]
    with pytest.raises(ValueError, match="first"):
        CoBa(2).update([float("nan"), 1.0])
