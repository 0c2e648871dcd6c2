"""LR schedules: exact values at phase boundaries (Levanter's warmup/stable/decay, cycles, rewarmup)."""

import math

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.schedule import build_scheduler, cycle_ends, cycles_of, lr_at


def cfg(**kw):
    base = dict(learning_rate=1.0, max_steps=10, warmup=2, decay=None, lr_schedule="linear", min_lr_ratio=0.1)
    base.update(kw)
    return TrainConfig(**base)


def lrs(c):
    return [lr_at(s, c.max_steps, c) for s in range(c.max_steps)]


def test_linear_warmup_then_decay_to_min():
    got = lrs(cfg())
    assert got[0] == 0.0 and got[1] == 0.5 and got[2] == 1.0
    assert got[5] == pytest.approx(1 - 0.9 * 3 / 7, abs=1e-12)
    assert got[9] == pytest.approx(0.1, abs=1e-12)
    assert lr_at(50, 10, cfg()) == pytest.approx(0.1)  # past the end keeps the final LR


def test_cosine_with_stable_phase():
    got = lrs(cfg(lr_schedule="cosine", decay=4))
    assert got[2:6] == [1.0, 1.0, 1.0, 1.0]
    assert got[7] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 3)), abs=1e-12)
    assert got[9] == pytest.approx(0.1, abs=1e-12)


def test_fractions_of_the_cycle():
    c = cfg(warmup=0.2, decay=0.5, max_steps=20)  # 4 warmup, 10 decay, 6 stable
    cyc = cycles_of(20, c)[0]
    assert (cyc.warmup, cyc.stable, cyc.decay) == (4, 6, 10)


def test_two_cycles_with_rewarmup_from_previous_minimum():
    got = lrs(cfg(warmup=1, cycles=[2], rewarmup=0.4))
    want = [0.0, 1.0, 0.7, 0.4, 0.1, 0.1, 0.55, 1.0, 0.55, 0.1]
    assert got == pytest.approx(want, abs=1e-12)


def test_zero_rewarmup_jumps_back_to_peak():
    got = lrs(cfg(warmup=1, cycles=[2]))
    assert got[4] == pytest.approx(0.1) and got[5] == 1.0


def test_cycle_boundaries():
    assert cycle_ends(10, cfg(cycle_length=[4])) == [4, 8, 10]
    assert cycle_ends(10, cfg(cycle_length=[0.5])) == [5, 10]
    assert cycle_ends(10, cfg(cycles=[3, 7])) == [3, 7, 10]
    assert cycle_ends(10, cfg(cycle_length=[3, 3])) == [3, 6, 10]
    with pytest.raises(ValueError, match="not both"):
        cycle_ends(10, cfg(cycles=[2], cycle_length=[4]))


@pytest.mark.parametrize("shape,mid", [("inv", 1 / 5.5), ("inv_sqrt", 1 / math.sqrt(50.5)), ("constant", 1.0)])
def test_inverse_shapes_reach_min_at_the_end(shape, mid):
    c = cfg(lr_schedule=shape, warmup=0, max_steps=3)  # decay steps 0,1,2 -> progress 0, .5, 1
    got = lrs(c)
    assert got[0] == 1.0
    assert got[1] == pytest.approx(mid, abs=1e-12)
    assert got[2] == pytest.approx(1.0 if shape == "constant" else 0.1, abs=1e-12)


def test_inv_needs_positive_min_ratio():
    with pytest.raises(ValueError, match="min_lr_ratio > 0"):
        lr_at(2, 3, cfg(lr_schedule="inv", warmup=0, max_steps=3, min_lr_ratio=0.0))


def test_warmup_plus_decay_longer_than_cycle_is_refused():
    with pytest.raises(ValueError, match="fewer than warmup"):
        lr_at(0, 10, cfg(warmup=6, decay=6))


def test_scheduler_gives_the_optimizer_lr_at():
    c = cfg(learning_rate=3e-4, lr_schedule="cosine", warmup=2, cycles=[2], rewarmup=1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=c.learning_rate)
    sched = build_scheduler(opt, c)
    seen = []
    for _ in range(c.max_steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(lrs(c), rel=1e-12, abs=1e-15)
