"""GRPO's objectives where they meet their peers at the edges: reward functions that return None
(unscorable completions) through every aggregation and estimator, the mismatch correction under
every loss type (vespo takes it inside its sequence weight), and the loss-specific options a loss
type does not read.

References (environment: torch 2.13.0+cpu, trl 1.16.0):
- TRL 1.16.0 trl/trainer/grpo_trainer.py `GRPOTrainer._generate_and_score_completions`, the block
  from `unscorable_mask = ...` through `advantages = torch.nan_to_num(...)`, and
  trl/trainer/rloo_trainer.py `RLOOTrainer._generate_and_score_completions`, the same span: their
  source is read from the installed TRL and run as written on our tensors (with TRL's `nanstd`).
- TRL 1.16.0 `GRPOTrainer._compute_loss` and `get_gamma_weights` with `importance_sampling_ratio`
  (tests/test_grpo_variants.py `trl_loss` calls it on a stand-in object).
- verl `masked_whiten` (tests/test_grpo_variants.py's transcription): an unscorable completion is
  one with no loss token there.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch
from test_grpo_variants import CASES, TOL, _ragged, _verl_masked_whiten, trl_loss

from pipeline.algorithms import advantages as adv
from pipeline.algorithms import grpo_losses as gl
from pipeline.algorithms import rewards as rw
from pipeline.algorithms.grpo_config import GRPOSection
from pipeline.algorithms.mismatch import correction_weights

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.rloo_trainer import RLOOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

NAN = math.nan
G = 4


def trl_block(method, first: str, last: str) -> str:
    """The lines of a TRL 1.16 method from the one starting with `first` through the one starting
    with `last` (dedented), to run on our tensors."""
    assert trl.__version__ == "1.16.0"
    lines = inspect.getsource(method).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first))
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith(last))
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def trl_advantages(trainer, per_source: torch.Tensor, weights, **options) -> torch.Tensor:
    """The advantages TRL's `_generate_and_score_completions` gives these rewards ([N, K], NaN: None)."""
    code = trl_block(
        trainer._generate_and_score_completions, "unscorable_mask = torch.isnan", "advantages = torch.nan_to_num"
    )
    me = SimpleNamespace(
        reward_weights=torch.tensor(weights, dtype=per_source.dtype),
        reward_funcs=[None] * per_source.shape[1],
        reward_clip_range=None,
        beta=0.0,
        normalize_advantages=False,
        **options,
    )
    scope = {"torch": torch, "nanstd": nanstd, "self": me, "rewards_per_func": per_source.clone()}
    scope.update(device="cpu", num_generations=G)
    exec(compile(code, "trl-block", "exec"), scope)
    return scope["advantages"]


def sparse_sources() -> tuple[dict[str, torch.Tensor], list[float]]:
    """Three sources over four groups of four, float64, None as NaN: group 0 has one unscorable
    completion (no source scored it); in group 1 source b scored one completion only; group 2 has a
    lone scored completion; group 3 is unscorable throughout; source c is None on all of group 1."""
    a = [1.0, NAN, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5, NAN, NAN, 0.3, NAN, NAN, NAN, NAN, NAN]
    b = [0.5, NAN, NAN, 0.2, 0.3, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN]
    c = [2.0, NAN, -1.0, 0.0, NAN, NAN, NAN, NAN, NAN, NAN, 1.0, NAN, NAN, NAN, NAN, NAN]
    parts = {k: torch.tensor(v, dtype=torch.float64) for k, v in zip("abc", (a, b, c))}
    return parts, [1.0, 0.5, 2.0]


@pytest.mark.parametrize(
    "aggregation,scale",
    [
        ("sum_then_normalize", "group"),
        ("sum_then_normalize", "batch"),
        ("sum_then_normalize", "none"),
        ("normalize_then_sum", "group"),
    ],
)
def test_unscorable_completions_advantages_equal_trl(aggregation, scale):
    """A None is left out of each source's group statistics (normalize_then_sum) and of the sum; a
    completion no source scored (the summed reward NaN, as TRL marks it) is left out of its group's
    mean and std and gets advantage 0, as does a lone scored one."""
    parts, weights = sparse_sources()
    per_source = torch.stack(list(parts.values()), 1)
    total = rw.weighted_sum(parts, dict(zip(parts, weights)), len(per_source)).double()
    unscorable = per_source.isnan().all(1)
    assert torch.equal(total.isnan(), unscorable) and unscorable.sum() == 8
    lengths = torch.full((len(total),), 3.0, dtype=torch.float64)
    got = adv.AGGREGATIONS[aggregation](total, per_source, weights, lengths, G, estimator="grpo", scale=scale)
    want = trl_advantages(
        GRPOTrainer, per_source, weights, multi_objective_aggregation=aggregation, scale_rewards=scale
    )
    torch.testing.assert_close(got, want, **TOL)  # the summed reward is float32, as the stage's
    assert torch.isfinite(got).all() and (got[unscorable] == 0).all()
    assert got[:8][~unscorable[:8]].abs().min() > 0  # groups 0 and 1 teach


def test_unscorable_completions_leave_one_out_equals_trl_rloo():
    """RLOO's baseline is over the group's other scored completions (TRL's RLOOTrainer)."""
    parts, weights = sparse_sources()
    per_source = torch.stack(list(parts.values()), 1)
    total = rw.weighted_sum(parts, dict(zip(parts, weights)), len(per_source)).double()
    got = adv.ESTIMATORS["rloo"](total, torch.ones_like(total), G, "group")
    torch.testing.assert_close(got, trl_advantages(RLOOTrainer, per_source, weights), **TOL)
    assert torch.isfinite(got).all() and (got[total.isnan()] == 0).all()


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_unscorable_completions_take_no_part_in_whitening(estimator):
    """verl's whitening with the unscorable completions given no loss token (verl has no None):
    the scored ones' advantages; the unscorable ones' are 0."""
    parts, weights = sparse_sources()
    total = rw.weighted_sum(parts, dict(zip(parts, weights)), 16).double()
    lengths = torch.tensor([3, 1, 4, 2, 5, 2, 3, 1, 2, 2, 4, 1, 3, 3, 3, 3], dtype=torch.float64)
    scored = ~total.isnan()
    values = total.clone()
    if estimator == "reinforce_plus_plus_baseline":  # minus the mean of the group's scored rewards
        values = values - torch.nanmean(values.view(-1, G), 1).repeat_interleave(G)
    T = int(lengths.max())
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).double() * scored.unsqueeze(1)
    want = _verl_masked_whiten(values.nan_to_num(0.0).unsqueeze(1).expand(-1, T), mask)[:, 0]
    got = adv.ESTIMATORS[estimator](total, lengths, G, "group")
    torch.testing.assert_close(got[scored], want[scored], **TOL)
    assert (got[~scored] == 0).all()


def test_weighted_sum_marks_only_the_unscorable():
    parts = {"f": torch.tensor([1.0, NAN, NAN, 2.0]), "g": torch.tensor([NAN, 0.5, NAN, 1.0])}
    total = rw.weighted_sum(parts, {"f": 2.0, "g": -1.0}, 4)
    assert total[:2].tolist() == [2.0, -0.5] and total[3] == 3.0 and total[2].isnan()


def test_dynamic_sampling_reads_the_scored_rewards():
    rewards = torch.tensor([1.0, NAN, 1.0, 1.0, 0.0, NAN, 1.0, NAN, NAN, NAN, NAN, 2.0, NAN, NAN, NAN, NAN])
    assert adv.informative_groups(rewards, G).tolist() == [False, True, False, False]
    assert adv.group_std(rewards, G)[[0, 2, 3]].tolist() == [0.0, 0.0, 0.0]


def test_an_infinite_reward_is_not_zeroed():
    """Only a NaN reward is unscorable: an infinite one still makes NaN advantages (the step's
    finite check stops there)."""
    rewards = torch.tensor([1.0, math.inf, 0.0, 2.0, 1.0, 0.0, NAN, 3.0])
    got = adv.group_advantages(rewards, G)
    assert got[:4].isnan().any() and torch.isfinite(got[4:]).all() and got[6] == 0


# ------------------------------------------------------------------------------------------
# The mismatch correction under every loss type
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("correction,cap,floor", [("tis", 1.6, None), ("mis", 1.8, 0.4)])
@pytest.mark.parametrize("case", list(CASES))
def test_corrected_loss_equals_trl_for_every_loss_type(case, correction, cap, floor):
    """TRL multiplies each token's loss by its vLLM importance-sampling ratio, except vespo, which
    adds the ratio's log to the sequence log-weight inside `get_gamma_weights`."""
    overrides, quantile = CASES[case]
    o = gl.Objective(**overrides)
    logp, old, ref, ent, a, mask = _ragged(seed=3, dtype=torch.float64)
    engine = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7), dtype=old.dtype)
    weight = correction_weights(correction, old, engine, mask, cap, floor)
    want, want_grad, _ = trl_loss(logp, old, ref, ent, a, mask, o, quantile=quantile, is_ratio=weight)
    leaf = logp.clone().requires_grad_(True)
    keep = gl.high_entropy_mask(ent, mask, quantile) if quantile < 1 else None
    out = gl.grpo_loss(leaf, old, a, mask, ref_logp=ref, objective=o, token_filter=keep, is_weight=weight)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(leaf.grad, want_grad, rtol=1e-10, atol=1e-10)


def test_vespo_weights_with_the_correction_equal_trl():
    logp, old, _, _, a, mask = _ragged(seed=5)
    engine = old + 0.4 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    weight = correction_weights("mis", old, engine, mask, 1.5, 0.8)
    assert (weight[mask.bool()] == 0).any()  # a token outside the band: its log is clamped at log 1e-8
    want = GRPOTrainer.get_gamma_weights(a.unsqueeze(1), logp - old, mask, weight)
    got = gl.gamma_weights(a.unsqueeze(1), logp - old, mask, gl.Objective(loss_type="vespo"), weight)
    torch.testing.assert_close(got, want, **TOL)
    plain = gl.gamma_weights(a.unsqueeze(1), logp - old, mask, gl.Objective(loss_type="vespo"))
    assert (got - plain).abs().max() > 1e-3


def test_how_a_loss_takes_the_correction_is_its_entry():
    assert [n for n, e in gl.LOSS_TYPES.items() if e.corrects_inside] == ["vespo"]


# ------------------------------------------------------------------------------------------
# Loss-specific options a loss type does not read
# ------------------------------------------------------------------------------------------

NON_DEFAULT = {
    "epsilon": 0.05,
    "epsilon_high": 5.0,
    "delta": 9.0,
    "sapo_temperature_pos": 0.5,
    "sapo_temperature_neg": 2.0,
    "vespo_k_pos": 9.0,
    "vespo_lambda_pos": 1.5,
    "vespo_k_neg": 1.0,
    "vespo_lambda_neg": 0.5,
}
NEEDS = {"cispo": {"epsilon_high": 5.0}, "luspo": {"importance_sampling_level": "sequence"}}


def test_every_loss_option_is_read_by_some_loss_type():
    assert set(gl.loss_options()) == set(NON_DEFAULT)
    assert all(name in dir(GRPOSection) for name in NON_DEFAULT)


def test_options_a_loss_ignores_are_refused_all_together():
    found = GRPOSection(loss_type="sapo", epsilon=0.05, epsilon_high=0.3, delta=2.0, vespo_k_pos=9.0).problems()
    assert [p.split(":")[0] for p in found] == ["grpo.epsilon", "grpo.epsilon_high", "grpo.delta", "grpo.vespo_k_pos"]
    for section in (
        GRPOSection(loss_type="dapo", sapo_temperature_pos=0.5),
        GRPOSection(loss_type="dapo", vespo_k_pos=9.0),
        GRPOSection(loss_type="vespo", epsilon=0.05),
        GRPOSection(loss_type="cispo", epsilon_high=5.0, epsilon=0.05),
    ):
        assert len(section.problems()) == 1, section
    assert GRPOSection(loss_type="sapo", epsilon=0.2, sapo_temperature_pos=0.5).problems() == []  # a default


@pytest.mark.parametrize("loss_type", sorted(gl.LOSS_TYPES))
def test_an_option_the_loss_does_not_read_is_refused(loss_type):
    """Every loss-specific option set away from its default under a loss type whose entry does not
    read it is one line, all of them together; at its default it is no conflict; one the entry
    reads is accepted."""
    base = NEEDS.get(loss_type, {})
    reads = gl.LOSS_TYPES[loss_type].options
    unread = {k: v for k, v in NON_DEFAULT.items() if k not in reads}
    found = GRPOSection(loss_type=loss_type, **{**base, **unread}).problems()
    assert [p.split(":")[0] for p in found] == [f"grpo.{name}" for name in unread], found
    assert all(f": loss_type {loss_type} does not read it (only " in p and "; leave it " in p for p in found)
    defaults = {k: getattr(GRPOSection, k) for k in NON_DEFAULT}
    assert GRPOSection(loss_type=loss_type, **{**defaults, **base}).problems() == []
    chosen = {k: v for k, v in NON_DEFAULT.items() if k in reads}
    assert GRPOSection(loss_type=loss_type, **{**chosen, **base}).problems() == []
