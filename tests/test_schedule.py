"""LR schedules: exact values at phase boundaries (Levanter's warmup/stable/decay, cycles, rewarmup)."""

import math

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.engine.schedule import build_scheduler, cycle_ends, cycles_of, lr_at


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
    got = lrs(cfg(warmup=1, cycles=2, rewarmup=0.4))
    want = [0.0, 1.0, 0.7, 0.4, 0.1, 0.1, 0.55, 1.0, 0.55, 0.1]
    assert got == pytest.approx(want, abs=1e-12)


def test_zero_rewarmup_jumps_back_to_peak():
    got = lrs(cfg(warmup=1, cycles=2))
    assert got[4] == pytest.approx(0.1) and got[5] == 1.0


def test_cycle_boundaries():
    assert cycle_ends(10, cfg(cycle_length=4)) == [4, 10]  # Levanter: the remainder joins the last cycle
    assert cycle_ends(10, cfg(cycle_length=0.5)) == [5, 10]
    assert cycle_ends(10, cfg(cycles=[3, 7])) == [3, 7, 10]
    assert cycle_ends(10, cfg(cycle_length=[3, 3])) == [3, 6, 10]
    with pytest.raises(ValueError, match="not both"):
        cycle_ends(10, cfg(cycles=2, cycle_length=4))


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
    c = cfg(learning_rate=3e-4, lr_schedule="cosine", warmup=2, cycles=2, rewarmup=1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=c.learning_rate)
    sched = build_scheduler(opt, c)
    seen = []
    for _ in range(c.max_steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(lrs(c), rel=1e-12, abs=1e-15)


# Golden values derived by reading stanford-crfm/levanter commit 9263f81e8b453241332c2c0b2d2001bfb2d2241c,
# src/levanter/optim/config.py (OptimizerConfig.lr_scheduler, _get_cycle_minima, _convert_frac_or_steps),
# with optax's linear_schedule / cosine_decay_schedule / join_schedules (google-deepmind/optax
# optax/schedules/_schedule.py, _join.py). Only points where Relay's documented decay-endpoint difference
# does not apply (warmup, peak, rewarmup from the previous minimum) are LR goldens.


def test_levanter_cycles_n_ends():
    assert cycle_ends(100, cfg(cycles=3, max_steps=100)) == [33, 66, 100]  # int(100 / 3 * 2) = 66, not round() = 67
    assert cycle_ends(10, cfg(cycles=4)) == [2, 5, 7, 10]
    assert cycle_ends(100, cfg(cycles=1, max_steps=100)) == [100]


def test_levanter_cycle_length_ends():
    assert cycle_ends(100, cfg(cycle_length=30, max_steps=100)) == [30, 60, 100]  # last cycle 40 steps
    assert cycle_ends(100, cfg(cycle_length=0.3, max_steps=100)) == [30, 60, 100]
    assert cycle_ends(100, cfg(cycle_length=25, max_steps=100)) == [25, 50, 75, 100]
    assert cycle_ends(100, cfg(cycle_length=150, max_steps=100)) == [100]
    assert cycle_ends(100, cfg(cycle_length=[20, 30], max_steps=100)) == [20, 50, 100]
    assert cycle_ends(100, cfg(cycle_length=[40, 60], max_steps=100)) == [40, 100]
    with pytest.raises(ValueError, match="add up to 110"):
        cycle_ends(100, cfg(cycle_length=[60, 50], max_steps=100))


def test_levanter_lr_three_cycles_with_rewarmup():
    c = cfg(max_steps=100, cycles=3, warmup=0.1, rewarmup=0.2, lr_schedule="linear", min_lr_ratio=0.1)
    assert [(x.start, x.end, x.warmup, x.stable, x.decay) for x in cycles_of(100, c)] == [
        (0, 33, 3, 0, 30),
        (33, 66, 6, 0, 27),
        (66, 100, 6, 0, 28),
    ]
    golden = {0: 0.0, 1: 1 / 3, 2: 2 / 3, 3: 1.0, 33: 0.1, 36: 0.55, 39: 1.0, 66: 0.1, 67: 0.25, 69: 0.55, 72: 1.0}
    assert {s: lr_at(s, 100, c) for s in golden} == pytest.approx(golden, abs=1e-12)
    # The documented difference: Levanter's last decay step is min + (peak - min) / D = 0.13; Relay's is min.
    assert lr_at(32, 100, c) == pytest.approx(0.1, abs=1e-12)


def test_levanter_lr_cycle_length_remainder_and_cosine():
    c = cfg(max_steps=100, cycle_length=30, warmup=0, rewarmup=0.25, lr_schedule="cosine", min_lr_ratio=0.1)
    assert [(x.start, x.end, x.warmup) for x in cycles_of(100, c)] == [(0, 30, 0), (30, 60, 7), (60, 100, 10)]
    golden = {0: 1.0, 30: 0.1, 33: 0.1 + 0.9 * 3 / 7, 37: 1.0, 60: 0.1, 65: 0.55, 70: 1.0}
    assert {s: lr_at(s, 100, c) for s in golden} == pytest.approx(golden, abs=1e-12)


def test_levanter_warmup_fractions():
    # int(0.29 * 100) == 28 in floating point, in both implementations.
    c = cfg(max_steps=100, warmup=0.29, lr_schedule="linear")
    assert cycles_of(100, c)[0].warmup == 28
    assert lr_at(27, 100, c) == pytest.approx(27 / 28, abs=1e-12) and lr_at(28, 100, c) == 1.0
    assert cycles_of(100, cfg(max_steps=100, warmup=0.05))[0].warmup == 5
    # Deliberate difference: exactly 1 is one step here; Levanter reads 1 / 1.0 as 100% of the cycle.
    assert cycles_of(10, cfg(warmup=1))[0].warmup == 1
    with pytest.raises(ValueError, match="whole number"):
        cycles_of(10, cfg(warmup=2.5))  # Levanter refuses non-whole step counts too


def test_the_guide_s_number_and_list_forms():
    """Levanter's guide: `cycles` as an int is a number of cycles, as a list the steps where cycles
    end, one step or several (`[4]` is a minimum at step 4: Relay read a one-element list as 4
    cycles, so `cycles: [10000]` gave 10000 cycles); `cycle_length` as a number is every cycle's
    length, as a list the cycles' lengths. Both forms from a YAML file and the command line."""
    assert cycle_ends(6, cfg(cycles=[4])) == [4, 6] and cycle_ends(6, cfg(cycles=4)) == [1, 3, 4, 6]
    assert cycle_ends(100, cfg(cycle_length=[30])) == [30, 100] and cycle_ends(100, cfg(cycle_length=30))[-1] == 100
    from pipeline.config import load_config
    from stages.sft import SFTConfig

    for given, want in (("3", 3), ("[3]", [3]), ("[10, 20]", [10, 20])):
        assert load_config(SFTConfig, ["--train.cycles", given]).train.cycles == want
    assert load_config(SFTConfig, ["--train.cycle_length", "0.25"]).train.cycle_length == 0.25
