"""The shape of a learning-rate schedule as in Levanter's guide: {[(re)warmup] -> [stable] -> [decay]} x cycles.

Pure functions of the train section (no torch): its cycles and their phases, a decay's value,
and `schedule_problems`, which the config's own check runs so that a schedule that cannot be built
is refused before anything loads. pipeline/engine/schedule.py turns them into the LR of a step.

Definitions follow Levanter's `OptimizerConfig.lr_scheduler` and `_get_cycle_minima`
(stanford-crfm/levanter commit 9263f81e8b45, src/levanter/optim/config.py; tests/test_schedule.py
pins cycle ends and LR values derived from it). All lengths are "a fraction of the cycle when
< 1, else a whole number of steps" (`_convert_frac_or_steps`: int(fraction * length)).
- cycles, as Levanter's guide has them, a number or a list: `cycles=n` splits the run of T steps
  into n cycles ending at int(T / n * (i + 1)) (Levanter's float arithmetic: n=3, T=100 gives
  [33, 66, 100]); `cycles=[a, b, ...]` (one step or several) lists the steps where cycles end (ends
  at or past T are dropped; T ends the last cycle); `cycle_length=L` (steps, or a fraction of the
  run when < 1) ends cycles at i * L for i < T // L, so a remainder joins the last cycle (L=30,
  T=100: [30, 60, 100]); `cycle_length=[L1, L2, ...]` (one length or several) lists the cycle
  lengths: their sums end cycles, a remainder becomes one more cycle, and lengths adding up to
  more than T are refused.
- within a cycle of length C: warmup W (the first cycle uses `warmup`, later ones `rewarmup`),
  decay D (`decay`, or everything after the warmup), stable = C - W - D at the peak LR.
- warmup goes linearly from the previous cycle's final LR (0 for the first cycle) to the peak:
  start + (peak - start) * t / W at t = 0..W-1; with W == 0 the LR jumps straight to the peak
  (Levanter's default for rewarmup).
- decay shapes go from the peak to `min_lr_ratio * peak` at the end of the cycle, with p the
  progress through the decay (0 at its first step, 1 at the cycle's last step):
  constant: peak; linear: peak + (min - peak) p; cosine: min + (peak - min)(1 + cos(pi p)) / 2;
  inv: peak / (1 + (1/r - 1) p); inv_sqrt: peak / sqrt(1 + (1/r^2 - 1) p), r = min_lr_ratio
  (both reach exactly min at p = 1, which is why they need r > 0).

Deliberate differences from Levanter:
- the decay ends one step earlier: p = t / (D - 1), so min_lr is reached at the cycle's last
  step; Levanter's optax schedules use t / D and reach min only at the next cycle's first step
  (its last decay step of a linear cycle is min + (peak - min) / D). Warmup, stable and the
  rewarmup start (the previous cycle's min) agree.
- a value of exactly 1 (warmup: 1, rewarmup: 1, decay: 1, cycle_length: 1) is one step here;
  Levanter's `_convert_frac_or_steps` treats 1 and 1.0 as the fraction 100%: warm-up over the
  whole cycle, leaving no decay steps (optax's cosine_decay_schedule then refuses
  decay_steps=0; the linear schedule holds the peak).
- inv_sqrt and inv are the shapes above; Levanter's inv_sqrt is lr * min(1, sqrt(10000 /
  (t + W))) floored at min, independent of D, and its inv uses max(t, 1) / D.
- `cycle_length=[L1, ...]` entries may be fractions here (Levanter takes raw steps), and
  `cycles` ends past the run are dropped rather than producing negative cycles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config.sections import TrainConfig


@dataclass(frozen=True)
class Cycle:
    """One cycle: [start, end) in steps, its warmup/stable/decay lengths."""

    start: int
    end: int
    warmup: int
    stable: int
    decay: int


def steps_of(value: float, length: int, name: str) -> int:
    """A fraction of `length` (value < 1) or a whole number of steps (value >= 1).

    Like Levanter's `_convert_frac_or_steps` (int(value * length) for fractions, non-whole step
    counts refused) except at exactly 1, which is one step here and the whole length there.

    Raises:
        ValueError: the value is negative, or over 1 and not a whole number.
    """
    if value < 0:
        raise ValueError(f"train.{name}: must be >= 0, got {value!r}")
    if value > 1 and value % 1 != 0:
        raise ValueError(f"train.{name}: {value!r} is neither a fraction (< 1) nor a whole number of steps")
    return int(value * length) if value < 1 else int(value)


def cycle_ends(total_steps: int, cfg: TrainConfig) -> list[int]:
    """The (exclusive) end step of every cycle; the last one is `total_steps`.

    Raises:
        ValueError: cycles and cycle_length both set, cycle lengths adding up to more than the
            run, or ends that are not increasing inside the run.
    """
    if cfg.cycles is not None and cfg.cycle_length is not None:
        raise ValueError("train: set cycles or cycle_length, not both (Levanter's rule)")
    if isinstance(cfg.cycles, int):
        n = cfg.cycles
        if n < 1:
            raise ValueError(f"train.cycles: need at least one cycle, got {n}")
        # Levanter's float arithmetic exactly: int(T / n * (i + 1)), e.g. [33, 66, 100] for n=3, T=100.
        ends = [int(total_steps / n * (i + 1)) for i in range(n - 1)] + [total_steps]
    elif cfg.cycles is not None:
        ends = [int(c) for c in cfg.cycles if int(c) < total_steps] + [total_steps]
    elif cfg.cycle_length is not None:
        given = cfg.cycle_length if isinstance(cfg.cycle_length, list) else [cfg.cycle_length]
        lengths = [steps_of(x, total_steps, "cycle_length") for x in given]
        if not isinstance(cfg.cycle_length, list):
            if lengths[0] < 1:
                raise ValueError(f"train.cycle_length: {cfg.cycle_length!r} gives cycles shorter than a step")
            # Levanter: ends at i * L for i < T // L; the remainder joins the last cycle.
            ends = [i * lengths[0] for i in range(1, total_steps // lengths[0])] + [total_steps]
        else:
            ends, acc = [], 0
            for length in lengths:
                acc += length
                ends.append(acc)
            if acc > total_steps:
                raise ValueError(
                    "train.cycle_length: the cycle lengths "
                    f"add up to {acc}, more than the {total_steps} steps of the run"
                )
            if acc < total_steps:
                ends.append(total_steps)
    else:
        ends = [total_steps]
    for prev, cur in zip([0] + ends[:-1], ends):
        if cur <= prev:
            raise ValueError(f"train.cycles: cycle ends must increase inside (0, {total_steps}], got {ends}")
    return ends


def cycles_of(total_steps: int, cfg: TrainConfig) -> list[Cycle]:
    """Every cycle of a `total_steps` run with its phase lengths.

    Raises:
        ValueError: bad cycle settings, or warmup + decay longer than a cycle.
    """
    out = []
    start = 0
    for index, end in enumerate(cycle_ends(total_steps, cfg)):
        length = end - start
        warmup = steps_of(cfg.warmup if index == 0 else cfg.rewarmup, length, "warmup" if index == 0 else "rewarmup")
        decay = length - warmup if cfg.decay is None else steps_of(cfg.decay, length, "decay")
        stable = length - warmup - decay
        if stable < 0:
            raise ValueError(f"train: cycle {index} has {length} steps, fewer than warmup ({warmup}) + decay ({decay})")
        out.append(Cycle(start, end, warmup, stable, decay))
        start = end
    return out


def decay_value(shape: str, peak: float, min_ratio: float, progress: float) -> float:
    """The LR `progress` (0..1) of the way through a decay of `shape`.

    Raises:
        ValueError: unknown shape, or inv/inv_sqrt with min_ratio == 0 (they never reach 0).
    """
    p = min(max(progress, 0.0), 1.0)
    low = peak * min_ratio
    if shape == "constant":
        return peak
    if shape == "linear":
        return peak + (low - peak) * p
    if shape == "cosine":
        return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * p))
    if shape in ("inv", "inv_sqrt"):
        if min_ratio <= 0:
            raise ValueError(f"train.lr_schedule: {shape} needs min_lr_ratio > 0")
        if shape == "inv":
            return peak / (1.0 + (1.0 / min_ratio - 1.0) * p)
        return peak / math.sqrt(1.0 + (1.0 / min_ratio**2 - 1.0) * p)
    raise ValueError(f"train.lr_schedule: unknown shape {shape!r}")


def schedule_problems(cfg: "TrainConfig") -> list[str]:
    """Why the schedule of `cfg` (its cycles over train.max_steps, each cycle's phases, the decay
    shape at its end) cannot be built, as one line; [] when it can."""
    try:
        cycles = cycles_of(cfg.max_steps, cfg)
        if any(c.decay > 0 for c in cycles):
            decay_value(cfg.lr_schedule, 1.0, cfg.min_lr_ratio, 1.0)
    except ValueError as err:
        return [str(err)]
    return []
