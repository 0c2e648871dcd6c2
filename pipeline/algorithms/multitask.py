"""Task-weighted SFT losses (MFTCoder): none, case3, and CoBa (self-paced convergence balancing).

Definitions, for per-token losses l_i of task t(i), N_t supervised tokens of task t in the
(accumulated, all-rank) batch, N = sum N_t, and P the tasks present (N_t > 0):
- none:  L = sum_i l_i / N                                  (token mean, tasks ignored)
- case3: L = sum_{t in P} w_t * mean_t / sum_{t in P} w_t     (mean_t = sum_{t(i)=t} l_i / N_t)
         with w_t the configured task weights (default 1: MFTCoder's plain average over tasks)
- coba:  as case3, with w_t = the CoBa weights (updated from validation-loss trends).
Both reduce to a weight per token, w_{t(i)} / (N_t * sum_P w), which is what makes gradient
accumulation exact: counts are taken over every micro-batch and rank before any backward.

CoBa (Gong et al. 2024, "CoBa: Convergence Balancer for Multitask Finetuning of LLMs"): our own
implementation of what MFTCoder's code computes (codefuse-ai/MFTCoder commit 8ba13f44e203,
mftcoder_accelerate/src/utils/loss_utils.py `CoBaStatus.compute_per_task_weight` and
`fit_window_slope`, called from src/pefts/mft_trainer.py); tests/test_multitask.py pins weights
derived from that code. With u the number of measurements so far (u = 1 is the reference;
MFTCoder's `completed_steps`), K tasks, H = history_length, W = warmup_steps:
- measurement 1 is the reference r_t (MFTCoder: the full evaluation before training); it is not
  a history point. Measurement u >= 2 adds the relative loss l_t / r_t to the history.
- weights stay uniform while u < W; from u = W on every measurement recomputes them.
- window: the last H history points, all u - 1 while there are fewer (MFTCoder's
  `start_step = max(0, u - H)`).
- slope_t: least-squares slope of task t's relative losses in the window against 0, 1, 2, ...;
  a point where the task was absent (NaN; MFTCoder's 0) is dropped and the remaining points are
  refitted as consecutive (MFTCoder's `y = y[y != 0]; x = x[:len(y)]`); 0 with < 2 points.
  slope_total: the same fit of the per-point max over the tasks present.
  Both are appended to slope lists s_t,j and S_j that start at u = W.
- RCS (relative convergence): softmax_t(K * slope_t / sum_t |slope_t|).
- ACS (absolute convergence): over the slope list from index start = max(0, u - H) on (MFTCoder
  indexes its list, which begins at u = W, with that same start_step), M entries:
  a_t = -M * s_t,last / sum_j |s_t,j|; ACS = softmax_t(a_t).
- DF (divergence factor), over the whole list S_1..S_N (not windowed):
  DF = N * softmax_j(tau * (-N * S_j / sum_j |S_j|))[last]. Not clamped: it can exceed 1 (then
  (1 - DF) < 0 pushes the weights away from ACS); `clamp_divergence` caps it at 1.
- weights = softmax_t(K * (DF * RCS_t + (1 - DF) * ACS_t)); if any weight is under the floor
  f (default 1 / (10K), MFTCoder's `minimum_weight`), all become w * (1 - K f) + f.
Deliberate differences: a normalisation over all-zero slopes (0 / 0) gives 0 here, NaN weights
in MFTCoder (e.g. u = W = 2, a one-point window); u counts measurements, so with
coba_update_interval > 1 the window is H measurements (MFTCoder mixes steps and measurements
in `start_step` and needs W to be a multiple of the interval).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

import torch

from pipeline.engine import steps


@dataclass(frozen=True)
class LossMode:
    """One way SFT weighs the tokens of its tasks (`multitask.weighted_loss_mode`)."""

    per_task: bool
    """The loss is a weighted mean of the tasks' token means (else the token mean over all tasks)."""
    adaptive: bool = False
    """Its task weights follow each task's held-out loss (CoBa): it needs held-out data, which it
    measures as it trains, and its weights ride in the checkpoint."""
    reads_task_weights: bool = False
    """`multitask.task_weights` sets its weights (elsewhere they would be ignored, so they are refused)."""
    doc: str = ""


MODES: dict[str, LossMode] = {
    "none": LossMode(False, doc="the token mean, tasks ignored"),
    "case3": LossMode(
        True, reads_task_weights=True, doc="the mean of the tasks' token means, weighted by multitask.task_weights"
    ),
    "coba": LossMode(True, adaptive=True, doc="case3 with CoBa's weights from the held-out loss trends"),
    "self-paced": LossMode(True, adaptive=True, doc="MFTCoder's name for coba"),
}
"""`multitask.weighted_loss_mode`'s entries: the config check and the SFT stage read their facts, and
the engine gets only the task weights of each step (`step_weights`)."""


def mode_entry(mode: str) -> LossMode:
    """MODES[mode].

    Raises:
        ValueError: unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"weighted_loss_mode {mode!r} is not one of {', '.join(MODES)}")
    return MODES[mode]


def step_weights(mode: str, task_weights: Optional[Sequence[float]], num_tasks: int) -> Optional[list[float]]:
    """The task weights a step of `mode` hands the engine (`lm_train_step`): None for the token
    mean, else one per task (`task_weights`, default 1 each).

    Raises:
        ValueError: unknown mode.
    """
    if not mode_entry(mode).per_task:
        return None
    return [float(w) for w in task_weights] if task_weights is not None else [1.0] * num_tasks


def token_weights(counts: torch.Tensor, mode: str, task_weights: Optional[Sequence[float]] = None) -> torch.Tensor:
    """[num_tasks] weight of one supervised token of each task under `mode`, from per-task token
    counts (pipeline.engine.steps.token_weights of `step_weights`).

    Raises:
        ValueError: unknown mode, or task_weights of the wrong length / summing to 0 over present tasks.
    """
    return steps.token_weights(counts, step_weights(mode, task_weights, counts.numel()))


@dataclass
class MultitaskConfig:
    weighted_loss_mode: str = "none"
    """none (token mean), case3 (mean of per-task token means, MFTCoder) or coba / self-paced
    (case3 with weights adapted from each task's validation-loss trend)."""
    task_weights: dict[str, float] = field(default_factory=dict)
    """case3: optional weight per task name (missing tasks weigh 1)."""
    coba_warmup_steps: int = 10
    """CoBa: weights adapt from the coba_warmup_steps-th validation measurement on (the first is
    the reference; uniform until then). MFTCoder's default is 100 (steps)."""
    coba_history_length: int = 20
    """CoBa: measurements in the slope-fitting window (MFTCoder's default: 200)."""
    coba_tau: float = 5.0
    """CoBa: temperature of the divergence factor."""
    coba_min_weight: Optional[float] = None
    """CoBa: floor weight per task (None: MFTCoder's 1 / (10 * number of tasks))."""
    coba_clamp_divergence: bool = False
    """CoBa: cap the divergence factor at 1 (Relay's earlier rule; MFTCoder leaves it unclamped,
    so a long plateau followed by a drop can push the weights past the RCS/ACS mix). Off: MFTCoder's weights."""
    coba_update_interval: int = 1
    """CoBa: measure the validation loss per task every this many steps."""
    coba_valid_batches: int = 1
    """CoBa: validation batches per measurement."""

    def problems(self, key: str = "multitask") -> list[str]:
        out = []
        if self.weighted_loss_mode not in MODES:
            out.append(f"{key}.weighted_loss_mode: {self.weighted_loss_mode!r} is not one of {', '.join(MODES)}")
        for name, value in self.task_weights.items():
            if not value >= 0:
                out.append(f"{key}.task_weights[{name!r}]: must be >= 0, got {value!r}")
        entry = MODES.get(self.weighted_loss_mode)
        if self.task_weights and entry is not None and not entry.reads_task_weights:
            readers = ", ".join(name for name, mode in MODES.items() if mode.reads_task_weights)
            out.append(
                f"{key}.task_weights: read only by weighted_loss_mode {readers}; "
                f"{self.weighted_loss_mode} would ignore them"
            )
        if entry is not None and not entry.adaptive:  # the coba_* options are read by the adaptive entries only
            readers = ", ".join(name for name, mode in MODES.items() if mode.adaptive)
            for option in fields(self):
                if option.name.startswith("coba_") and getattr(self, option.name) != option.default:
                    out.append(
                        f"{key}.{option.name}: read only by weighted_loss_mode {readers}; "
                        f"{self.weighted_loss_mode} would ignore it"
                    )
        for name in ("coba_warmup_steps", "coba_history_length", "coba_update_interval", "coba_valid_batches"):
            if getattr(self, name) < 1:
                out.append(f"{key}.{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.coba_history_length < 2:
            out.append(f"{key}.coba_history_length: needs >= 2 points to fit a slope")
        return out


def task_weighted_loss(
    token_losses: torch.Tensor,
    task_ids: torch.Tensor,
    mode: str,
    task_weights: Optional[Sequence[float]] = None,
    num_tasks: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted loss of one batch and each task's token-mean loss (nan for absent tasks).

    `token_losses` and `task_ids` have the same shape; tokens with task_id < 0 are not supervised.

    Raises:
        ValueError: shape mismatch, unknown mode, bad task weights.
    """
    if token_losses.shape != task_ids.shape:
        raise ValueError(
            f"token_losses {tuple(token_losses.shape)} and task_ids {tuple(task_ids.shape)} differ in shape"
        )
    valid = task_ids >= 0
    k = num_tasks or (len(task_weights) if task_weights is not None else int(task_ids.max().clamp(min=0)) + 1)
    ids = task_ids[valid]
    losses = token_losses[valid]
    counts = torch.bincount(ids, minlength=k).double()
    sums = torch.zeros(k, dtype=losses.dtype, device=losses.device).index_add_(0, ids, losses)
    weights = token_weights(counts, mode, task_weights).to(losses.device, losses.dtype)
    loss = (losses * weights[ids]).sum()
    means = torch.where(
        counts.to(sums.device) > 0, sums / counts.to(sums.device).clamp(min=1), torch.full_like(sums, float("nan"))
    )
    return loss, means


def fit_slope(values: Sequence[float]) -> float:
    """Least-squares slope of values against 0, 1, 2, ... (0 with fewer than two points)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def _softmax(xs: Sequence[float]) -> list[float]:
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def _normalised(xs: Sequence[float], scale: float) -> list[float]:
    """scale * x / sum|x| (zeros stay zeros when every x is 0, where MFTCoder would give NaN)."""
    total = sum(abs(x) for x in xs)
    return [0.0 for _ in xs] if total == 0 else [scale * x / total for x in xs]


def _present(xs: Sequence[float]) -> list[float]:
    """The values that are not NaN, in order (MFTCoder's `y[y != 0]` in fit_window_slope)."""
    return [x for x in xs if not math.isnan(x)]


def _row_max(row: Sequence[float]) -> float:
    """Max over the tasks present in one measurement (NaN when none is)."""
    present = _present(row)
    return max(present) if present else math.nan


class CoBa:
    """CoBa task weights from per-task validation losses (formulas in the module docstring).

    Measurement u = 1 is the reference; from measurement u >= warmup_steps on, every update
    recomputes the weights (MFTCoder's `compute_per_task_weight(completed_steps=u)`).
    """

    STATE_VERSION = 2

    def __init__(
        self,
        num_tasks: int,
        *,
        warmup_steps: int = 10,
        history_length: int = 20,
        tau: float = 5.0,
        min_weight: Optional[float] = None,
        clamp_divergence: bool = False,
    ):
        """Raises: ValueError: num_tasks < 1 or a floor that K tasks cannot all have."""
        if num_tasks < 1:
            raise ValueError("CoBa needs at least one task")
        self.k = num_tasks
        self.warmup_steps = warmup_steps
        self.history_length = history_length
        self.tau = tau
        self.min_weight = 1.0 / (10 * num_tasks) if min_weight is None else min_weight
        self.clamp_divergence = clamp_divergence
        if self.min_weight * num_tasks > 1:
            raise ValueError(f"CoBa floor {self.min_weight} x {num_tasks} tasks exceeds 1")
        self.first: Optional[list[float]] = None
        """The reference losses (measurement 1), which later measurements are divided by."""
        self.history: list[list[float]] = []
        """Relative losses of measurements 2, 3, ... (NaN: the task was absent)."""
        self.task_slopes: list[list[float]] = []
        self.total_slopes: list[float] = []
        self.divergence = 1.0
        """The last divergence factor (for logging)."""
        self._weights = [1.0 / num_tasks] * num_tasks

    def update(self, valid_losses_per_task: Sequence[float]) -> None:
        """Record one validation measurement (one loss per task) and recompute the weights.

        The first call is the reference (MFTCoder: the full evaluation before training); it is
        not a point of the history. A NaN marks a task absent from a later measurement (no
        validation tokens in the sampled batches): that point is left out of the task's slope
        fit, as MFTCoder drops its zero entries.

        Raises:
            ValueError: wrong number of losses; inf or a loss <= 0; NaN in the first measurement.
        """
        losses = [float(x) for x in valid_losses_per_task]
        if len(losses) != self.k:
            raise ValueError(f"CoBa.update: {len(losses)} losses for {self.k} tasks")
        if any(math.isinf(x) or x <= 0 for x in losses) or (self.first is None and any(math.isnan(x) for x in losses)):
            raise ValueError(
                f"CoBa.update: validation losses must be finite and > 0 (the first for every task), got {losses}"
            )
        if self.first is None:
            self.first = losses
        else:
            self.history.append([x / self.first[t] for t, x in enumerate(losses)])  # NaN stays NaN
        u = len(self.history) + 1  # measurements so far, the reference included: MFTCoder's completed_steps
        if u < self.warmup_steps:
            return
        start = max(0, u - self.history_length)
        window = self.history[-(u - start) :]
        slopes = [fit_slope(_present([row[t] for row in window])) for t in range(self.k)]
        self.task_slopes.append(slopes)
        self.total_slopes.append(fit_slope(_present([_row_max(row) for row in window])))
        self._weights = self._compute(slopes, start)

    def _compute(self, slopes: list[float], start: int) -> list[float]:
        k = self.k
        rcs = _softmax(_normalised(slopes, k))
        recent = self.task_slopes[start:]  # MFTCoder slices its slope list from start_step
        m = len(recent)
        latest = [_normalised([row[t] for row in recent], -m)[-1] if m else 0.0 for t in range(k)]
        acs = _softmax(latest)
        n = len(self.total_slopes)
        df = n * _softmax([self.tau * x for x in _normalised(self.total_slopes, -n)])[-1]
        if self.clamp_divergence:
            df = min(1.0, df)
        self.divergence = df
        weights = _softmax([k * (df * r + (1 - df) * a) for r, a in zip(rcs, acs)])
        if min(weights) < self.min_weight:
            weights = [w * (1 - k * self.min_weight) + self.min_weight for w in weights]
        return weights

    def weights(self) -> list[float]:
        """Current weight per task (they sum to 1)."""
        return list(self._weights)

    def state_dict(self) -> dict:
        return {
            "version": self.STATE_VERSION,
            "first": self.first,
            "history": [[None if math.isnan(x) else x for x in row] for row in self.history],
            "task_slopes": self.task_slopes,
            "total_slopes": self.total_slopes,
            "weights": self._weights,
            "divergence": self.divergence,
        }

    def load_state_dict(self, state: dict) -> None:
        """Also loads the state of Relay before version 2 (whose history began with the reference
        row of 1s: it is dropped).

        Raises: KeyError: a field is missing.
        """
        self.first = state["first"]
        history = [[math.nan if x is None else float(x) for x in row] for row in state["history"]]
        self.history = history if state.get("version", 1) >= 2 else history[1:]
        self.task_slopes = [list(r) for r in state["task_slopes"]]
        self.total_slopes = list(state["total_slopes"])
        self._weights = list(state["weights"])
        self.divergence = float(state.get("divergence", 1.0))
