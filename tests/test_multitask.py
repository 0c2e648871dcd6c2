"""Task-weighted losses (none / case3) and CoBa weights on constructed losses, checked by hand and
against weights derived from MFTCoder's CoBa code."""

import json
import math

import pytest
import torch

from pipeline.algorithms.multitask import CoBa, fit_slope, task_weighted_loss, token_weights

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


# The CoBa expectations below follow codefuse-ai/MFTCoder commit 8ba13f44e2036f1412a343bc343dc6cda7383d73,
# mftcoder_accelerate/src/utils/loss_utils.py (CoBaStatus.compute_per_task_weight, fit_window_slope) with
# the call timeline of mftcoder_accelerate/src/pefts/mft_trainer.py: the first update() is the reference
# (MFTCoder's full evaluation before training, not a history point); update u (u = completed_steps) with
# u >= warmup recomputes the weights from the u - 1 history points.


def test_coba_uniform_during_warmup_then_rcs_dominates():
    coba = CoBa(2, warmup_steps=3, history_length=4, tau=1.0)
    coba.update([2.0, 4.0])  # the reference
    coba.update([2.0, 4.0])  # relative [1, 1]
    assert coba.weights() == [0.5, 0.5]
    coba.update([1.0, 5.0])  # relative [.5, 1.25]: slopes -0.5, +0.25; one slope so far -> DF = 1
    rcs = sm(-4 / 3, 2 / 3)  # softmax(K * slope / sum|slope|)
    assert coba.weights() == pytest.approx(sm(2 * rcs[0], 2 * rcs[1]), abs=1e-12)
    assert coba.weights() == pytest.approx([0.1789925040, 0.8210074960], abs=1e-9)  # the fast-converging task gets less


def _hand_case(**kw):
    coba = CoBa(2, warmup_steps=3, history_length=4, tau=1.0, **kw)
    for losses in ([2.0, 4.0], [2.0, 4.0], [1.0, 5.0], [1.0, 5.0]):
        coba.update(losses)
    return coba


# u = 4: history [1, .5, .5] and [1, 1.25, 1.25]; slopes -0.25, +0.125; slope lists [-.5, -.25], [.25, .125];
# total (max per point) [1, 1.25, 1.25] -> total slopes [.25, .125].
HAND_RCS = sm(-4 / 3, 2 / 3)
HAND_ACS = sm(2 / 3, -2 / 3)  # -M * s_last / sum|s| with M = 2
HAND_DF = 2 * sm(-4 / 3, -2 / 3)[1]  # N * softmax(tau * -N * S / sum|S|)[last] = 1.3215 > 1: not clamped


def test_coba_divergence_factor_is_not_clamped():
    coba = _hand_case()
    logits = [HAND_DF * r + (1 - HAND_DF) * a for r, a in zip(HAND_RCS, HAND_ACS)]
    assert HAND_DF > 1 and coba.divergence == pytest.approx(HAND_DF, abs=1e-12)
    assert coba.weights() == pytest.approx(sm(2 * logits[0], 2 * logits[1]), abs=1e-12)
    assert coba.weights() == pytest.approx([0.0841187646, 0.9158812354], abs=1e-9)  # over the 1/20 floor


def test_coba_options_clamp_and_floor():
    """Relay's options (not MFTCoder's defaults): DF capped at 1, and a higher floor."""
    clamped = _hand_case(clamp_divergence=True)
    assert clamped.divergence == 1.0
    assert clamped.weights() == pytest.approx(sm(2 * HAND_RCS[0], 2 * HAND_RCS[1]), abs=1e-12)
    floored = _hand_case(min_weight=0.1)
    raw = _hand_case().weights()
    assert floored.weights() == pytest.approx([w * (1 - 0.2) + 0.1 for w in raw], abs=1e-12)


def test_coba_default_floor_is_one_tenth_of_uniform():
    assert CoBa(3).min_weight == pytest.approx(1 / 30)
    assert CoBa(3, min_weight=0.2).min_weight == 0.2


# Three tasks, warmup 3, window 6, tau 5: the reference then 14 measurements (one with task 0 absent).
# Losses are multiples of 1/64 over power-of-two references, so the relative losses are exact (MFTCoder
# divides in float32). Task 1 plateaus, rises, then drops fast at the end: DF = 12.47 at u = 15, where
# task 1's raw weight is ~0 and the 1/(10K) floor lifts it to exactly 1/30.
GOLDEN_REFERENCE = [2.0, 4.0, 1.0]
GOLDEN_LOSSES = [
    [1.875, 3.75, 0.75],
    [1.75, 3.5, 0.625],
    [1.625, 3.5, 0.5625],
    [1.5, 3.5, 0.53125],
    [1.5, 3.25, 0.5],
    [1.375, 3.25, 0.5],
    [1.25, 3.5, 0.5],
    [math.nan, 3.75, 0.5],
    [1.0, 4.0, 0.5],
    [1.0, 4.25, 0.46875],
    [0.875, 4.0, 0.4375],
    [0.875, 3.5, 0.4375],
    [0.75, 3.0, 0.4375],
    [0.75, 2.5, 0.40625],
]
# Weights after update u, derived from MFTCoder's compute_per_task_weight(completed_steps=u) on this history.
GOLDEN_WEIGHTS = {
    3: [0.3956999267, 0.3956999267, 0.2086001466],
    4: [0.3829158314, 0.2936824591, 0.3234017095],
    5: [0.4222353505, 0.2603587308, 0.3174059187],
    6: [0.3640133823, 0.3273538311, 0.3086327866],
    7: [0.3387119014, 0.3718570263, 0.2894310722],
    8: [0.4501724264, 0.2646040753, 0.2852234983],
    9: [0.5762476120, 0.1558028159, 0.2679495721],
    10: [0.7233478574, 0.0950484521, 0.1816036905],
    11: [0.6896685343, 0.0953442880, 0.2149871778],
    12: [0.3228768777, 0.1125216051, 0.5646015172],
    13: [0.2002150716, 0.1266232464, 0.6731616821],
    14: [0.2365280964, 0.3078728201, 0.4555990834],
    15: [0.1578375560, 0.0333333333, 0.8088291106],
}


def test_coba_golden_weights_match_mftcoder():
    coba = CoBa(3, warmup_steps=3, history_length=6, tau=5.0)
    for u, losses in enumerate([GOLDEN_REFERENCE] + GOLDEN_LOSSES, start=1):
        coba.update(losses)
        want = GOLDEN_WEIGHTS.get(u, [1 / 3] * 3)
        assert coba.weights() == pytest.approx(want, abs=1e-6), f"after update {u}"
    assert coba.divergence == pytest.approx(12.465179, abs=1e-5)
    clamped = CoBa(3, warmup_steps=3, history_length=6, tau=5.0, clamp_divergence=True)
    for losses in [GOLDEN_REFERENCE] + GOLDEN_LOSSES:
        clamped.update(losses)
    assert clamped.divergence == 1.0 and clamped.weights() != pytest.approx(GOLDEN_WEIGHTS[15], abs=1e-3)


def test_coba_absent_task_point_is_dropped_from_its_fit():
    coba = CoBa(2, warmup_steps=3, history_length=4, tau=1.0)
    for losses in ([2.0, 4.0], [2.0, 4.0], [float("nan"), 5.0], [1.0, 6.0]):
        coba.update(losses)
    assert math.isnan(coba.history[1][0])
    # task 0: [1, -, .5] is fitted as the consecutive points [1, .5] (MFTCoder: y = y[y != 0]; x = x[:len(y)])
    assert coba.task_slopes[-1] == pytest.approx([-0.5, 0.25])  # task 1: [1, 1.25, 1.5]
    with pytest.raises(ValueError, match="first"):
        CoBa(2).update([float("nan"), 1.0])
    with pytest.raises(ValueError, match="finite"):
        coba.update([float("inf"), 1.0])


def test_coba_state_roundtrips_through_json_and_loads_the_old_layout():
    coba = CoBa(3, warmup_steps=3, history_length=6, tau=5.0)
    for losses in [GOLDEN_REFERENCE] + GOLDEN_LOSSES[:9]:  # includes the NaN point
        coba.update(losses)
    clone = CoBa(3, warmup_steps=3, history_length=6, tau=5.0)
    clone.load_state_dict(json.loads(json.dumps(coba.state_dict(), allow_nan=False)))
    for losses in GOLDEN_LOSSES[9:]:
        clone.update(losses), coba.update(losses)
        assert clone.weights() == coba.weights()
    # Relay's earlier state (no version) kept the reference as a first history row of 1s.
    state = coba.state_dict()
    old = {k: v for k, v in state.items() if k not in ("version", "divergence")}
    old["history"] = [[1.0, 1.0, 1.0]] + state["history"]
    loaded = CoBa(3)
    loaded.load_state_dict(old)
    assert len(loaded.history) == len(coba.history) and loaded.weights() == coba.weights()
