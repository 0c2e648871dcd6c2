"""GRPO's variants (pipeline/algorithms/grpo_losses.py, advantages.py, grpo_config.py, the stage's
dynamic sampling): every `grpo.loss_type` with GSPO ratios, delta, clip-higher, the entropy filter
and truncated-completion masking against TRL 1.16's own `GRPOTrainer._compute_loss`; the advantage
estimators against TRL 1.16 and verl; overlong shaping against TRL's own function and verl's;
the conflicting-option checks; dynamic sampling in the stage on a tiny model.

References (environment: torch 2.13.0+cpu, trl 1.16.0, fp32 tensors unless noted):
- TRL 1.16.0, trl/trainer/grpo_trainer.py: `GRPOTrainer._compute_loss`, `get_high_entropy_mask`,
  `get_gamma_weights` called on a stand-in object (only the attributes they read); the advantage
  code of `_generate_and_score_completions` and trl/trainer/rloo_trainer.py transcribed below
  with TRL's own `nanstd`; trl/rewards/other_rewards.py `get_soft_overlong_punishment` called.
- verl commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29), verl/trainer/ppo/core_algos.py
  `compute_rloo_outcome_advantage`, `compute_reinforce_plus_plus_outcome_advantage`,
  `compute_reinforce_plus_plus_baseline_outcome_advantage`, verl/utils/torch_functional.py
  `masked_whiten`, verl/workers/reward_manager/dapo.py overlong buffer: transcribed token by token
  below (verl is not installed), on token-level [B, T] tensors as verl runs them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from pipeline.algorithms import advantages as adv
from pipeline.algorithms import grpo_losses as gl
from pipeline.algorithms.grpo_config import GRPOSection

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
TOL = dict(rtol=1e-6, atol=1e-6)


def _ragged(seed=0, B=6, T=7, dtype=torch.float32):
    """Log-probs, old and reference log-probs, entropies, advantages and a ragged mask (one
    completion of a single token, one with no loss token: a masked truncated completion)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 0.35 * torch.randn(B, T, generator=g)  # ratios far enough from 1 to clip
    ref = logp + 0.2 * torch.randn(B, T, generator=g)
    entropies = torch.rand(B, T, generator=g) * 2
    advantages = torch.randn(B, generator=g)
    lengths = torch.tensor([T, 3, 1, 5, 0, T - 1])[:B]
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return [x.to(dtype) for x in (logp, old, ref, entropies, advantages)] + [mask]


def trl_loss(
    logp,
    old,
    ref,
    entropies,
    advantages,
    mask,
    o: gl.Objective,
    *,
    quantile=1.0,
    grad_accum=1,
    num_items=None,
    max_completion_length=None,
    is_ratio=None,
):
    """TRL 1.16's `_compute_loss` on these tensors: (loss, d loss / d logp, metrics); `is_ratio`
    given: with vLLM's importance-sampling correction on and that ratio (tests/test_objectives_peers.py)."""
    assert trl.__version__ == "1.16.0"
    leaf = logp.clone().requires_grad_(True)
    acc = SimpleNamespace(
        num_processes=1,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
        pad_across_processes=lambda x, dim=0, pad_index=0: x,
        sync_gradients=True,
    )
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, entropies, None),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        top_entropy_quantile=quantile,
        off_policy_mask_threshold=None,
        importance_sampling_level=o.importance_sampling_level,
        beta=o.beta,
        loss_type=o.loss_type,
        epsilon_low=o.epsilon,
        epsilon_high=o.high,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum,
        accelerator=acc,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        max_completion_length=max_completion_length or logp.shape[1],
        args=SimpleNamespace(
            use_bias_correction_kl=False,
            delta=o.delta,
            steps_per_generation=grad_accum,
            sapo_temperature_pos=o.sapo_temperature_pos,
            sapo_temperature_neg=o.sapo_temperature_neg,
            vespo_k_pos=o.vespo_k_pos,
            vespo_lambda_pos=o.vespo_lambda_pos,
            vespo_k_neg=o.vespo_k_neg,
            vespo_lambda_neg=o.vespo_lambda_neg,
        ),
    )
    stand_in.get_high_entropy_mask = lambda e, m, t: GRPOTrainer.get_high_entropy_mask(stand_in, e, m, t)
    B = logp.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, logp.shape[1], dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(mask.sum() if num_items is None else num_items)),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad, stand_in._metrics["train"]


def relay_loss(logp, old, ref, entropies, advantages, mask, o: gl.Objective, *, quantile=1.0, totals=None):
    leaf = logp.clone().requires_grad_(True)
    keep = gl.high_entropy_mask(entropies, mask, quantile) if quantile < 1 else None
    out = gl.grpo_loss(leaf, old, advantages, mask, ref_logp=ref, objective=o, totals=totals, token_filter=keep)
    out.loss.backward()
    return out, leaf.grad


CASES = {
    # name: (Objective overrides, top_entropy_quantile)
    "grpo": ({"loss_type": "grpo"}, 1.0),
    "grpo/gspo-sequence": ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, 1.0),
    "bnpo": ({"loss_type": "bnpo", "epsilon_high": 0.28}, 1.0),
    "dr_grpo": ({"loss_type": "dr_grpo", "beta": 0.04}, 1.0),
    "dapo/clip-higher": ({"loss_type": "dapo", "epsilon_high": 0.28}, 1.0),
    "dapo/delta": ({"loss_type": "dapo", "delta": 1.3}, 1.0),
    "dapo/entropy-0.2": ({"loss_type": "dapo", "beta": 0.04}, 0.2),
    "dapo/sequence+delta": (
        {"loss_type": "dapo", "importance_sampling_level": "sequence", "delta": 1.25, "epsilon_high": 0.2},
        1.0,
    ),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, 1.0),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.2, "beta": 0.04}, 1.0),
    "cispo/entropy-0.5": ({"loss_type": "cispo", "epsilon_high": 5.0}, 0.5),
    "sapo": ({"loss_type": "sapo"}, 1.0),
    "sapo/temperatures": (
        {"loss_type": "sapo", "sapo_temperature_pos": 0.7, "sapo_temperature_neg": 2.0, "beta": 0.04},
        1.0,
    ),
    "vespo": ({"loss_type": "vespo"}, 1.0),
    "vespo/params": (
        {
            "loss_type": "vespo",
            "vespo_k_pos": 1.5,
            "vespo_lambda_pos": 2.5,
            "vespo_k_neg": 2.0,
            "vespo_lambda_neg": 1.0,
        },
        1.0,
    ),
}


def test_every_trl_loss_type_has_a_case():
    assert {o["loss_type"] for o, _ in CASES.values()} == set(gl.LOSS_TYPES)


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_trl(case):
    """One micro-batch, ragged mask with an empty completion: loss, gradient and clip ratio."""
    overrides, quantile = CASES[case]
    o = gl.Objective(**overrides)
    tensors = _ragged(seed=13 if o.delta else len(case))
    if o.delta:  # the cap binds somewhere: a ratio above delta where the advantage is negative
        logp, old, _, _, a, mask = tensors
        ratio = torch.exp(gl.importance_log_weights(logp - old, mask, o.importance_sampling_level))
        assert ((ratio > o.delta) & (a.unsqueeze(1) < 0) & (mask.sum(1, keepdim=True) > 0)).any()
    want, want_grad, metrics = trl_loss(*tensors, o, quantile=quantile)
    out, grad = relay_loss(*tensors, o, quantile=quantile)
    torch.testing.assert_close(out.loss.detach(), want, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)
    assert want_grad.abs().sum() > 0
    if "clip_ratio/region_mean" in metrics:
        assert float(out.clipfrac) == pytest.approx(metrics["clip_ratio/region_mean"][0], abs=1e-6)
    if "cispo_clip_ratio" in metrics:
        assert float(out.clipfrac) == pytest.approx(metrics["cispo_clip_ratio"][0], abs=1e-6)
    if o.beta:
        assert float(out.kl) == pytest.approx(metrics["kl"][0], abs=1e-6)


@pytest.mark.parametrize("loss_type", sorted(gl.LOSS_TYPES))
def test_micro_batch_shares_equal_trl_accumulation(loss_type):
    """Two micro-batches of three: each Relay share (against the step's totals) equals TRL's
    micro-batch loss with gradient_accumulation_steps = steps_per_generation = 2, dr_grpo's
    constant 9 (not the batch's width)."""
    overrides = {"cispo": {"epsilon_high": 4.0}, "luspo": {"importance_sampling_level": "sequence"}}.get(loss_type, {})
    o = gl.Objective(loss_type=loss_type, beta=0.04, **overrides)
    tensors = _ragged(seed=7)
    mask = tensors[-1]
    totals = gl.Totals(float(mask.sum()), mask.shape[0], 9)
    shares = []
    for rows in (slice(0, 3), slice(3, 6)):
        part = [t[rows] for t in tensors]
        want, want_grad, _ = trl_loss(*part, o, grad_accum=2, num_items=mask.sum(), max_completion_length=9)
        out, grad = relay_loss(*part, o, totals=totals)
        torch.testing.assert_close(out.loss.detach(), want, **TOL)
        torch.testing.assert_close(grad, want_grad, **TOL)
        shares.append(out.loss.detach())
    if loss_type not in ("bnpo",):  # bnpo is defined per micro-batch: the one split-dependent type
        whole, _ = relay_loss(*tensors, o, totals=totals)
        torch.testing.assert_close(sum(shares), whole.loss.detach(), **TOL)


def test_high_entropy_mask_equals_trl():
    *_, entropies, _, mask = _ragged(seed=3)
    stand_in = SimpleNamespace(
        accelerator=SimpleNamespace(pad_across_processes=lambda x, dim=0, pad_index=0: x, gather=lambda x: x)
    )
    for q in (0.0, 0.2, 0.5, 1.0):
        want = GRPOTrainer.get_high_entropy_mask(stand_in, entropies, mask, 1 - q)
        assert torch.equal(gl.high_entropy_mask(entropies, mask, q), want), q
    assert int(gl.high_entropy_mask(entropies, mask, 0.0).sum()) == 1  # only the highest-entropy token


def test_masked_quantile_equals_torch_quantile_of_the_masked_values():
    """The threshold high_entropy_mask takes on one process, found without a boolean index (whose
    count a GPU would read on the host): torch.quantile of the masked values, bit for bit, on ragged
    masks of every size, the empty one included (+inf: no token reaches it)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows, cols = torch.randint(1, 6, (2,), generator=gen).tolist()
        values = torch.rand(rows, cols, generator=gen) * 5
        mask = (torch.rand(rows, cols, generator=gen) > 0.4).float()
        for q in (0.0, 0.2, 0.5, 0.8, 1.0, float(torch.rand(1, generator=gen))):
            got = gl.masked_quantile(values, mask, q)
            if not mask.any():
                assert torch.isinf(got) and not gl.high_entropy_mask(values, mask, 1 - q).any()
                continue
            assert torch.equal(got, torch.quantile(values[mask.bool()], q)), (rows, cols, q)


def test_vespo_weights_equal_trl():
    logp, old, _, _, advantages, mask = _ragged(seed=5)
    o = gl.Objective(loss_type="vespo")
    want = GRPOTrainer.get_gamma_weights(advantages.unsqueeze(1), logp - old, mask, None)
    torch.testing.assert_close(gl.gamma_weights(advantages.unsqueeze(1), logp - old, mask, o), want, **TOL)


# ------------------------------------------------------------------------------------------
# Advantages
# ------------------------------------------------------------------------------------------


def _rewards(seed=0, groups=3, G=4):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(groups * G, generator=g)
    r[G : 2 * G] = 0.5  # one group of equal rewards
    return r


def _token_layout(lengths, T):
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return mask


def test_scale_rewards_equal_trl():
    """TRL grpo_trainer.py `_generate_and_score_completions`, sum_then_normalize: group, batch, none."""
    r, G = _rewards(), 4
    mean = r.view(-1, G).mean(1).repeat_interleave(G)
    want = {
        "group": (r - mean) / (nanstd(r.view(-1, G), dim=1).repeat_interleave(G) + 1e-4),
        "batch": (r - mean) / (nanstd(r).expand_as(r) + 1e-4),
        "none": r - mean,
    }
    for scale, expected in want.items():
        torch.testing.assert_close(adv.group_advantages(r, G, scale), expected, **TOL)
    torch.testing.assert_close(adv.group_advantages(r, G, False), want["none"], **TOL)  # the old boolean spelling


def test_normalize_then_sum_equals_trl():
    """TRL's normalize_then_sum (GDPO): per reward per group, weighted sum, then over the batch."""
    g, G = torch.Generator().manual_seed(1), 4
    per = torch.randn(12, 3, generator=g)
    per[0:4, 1] = 1.0  # a reward that is constant within a group
    weights = [1.0, 0.5, 2.0]
    grouped = per.view(-1, G, 3)
    reward_k = (
        (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    ).view(-1, 3)
    rewards = (reward_k * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    want = (rewards - torch.nanmean(rewards)) / (nanstd(rewards).expand_as(rewards) + 1e-4)
    got = adv.AGGREGATIONS["normalize_then_sum"](
        per.sum(1), per, weights, torch.ones(12), G, estimator="grpo", scale="group"
    )
    torch.testing.assert_close(got, want, **TOL)


def _verl_masked_whiten(values, mask):
    """verl/utils/torch_functional.py masked_mean / masked_var(unbiased) / masked_whiten."""
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = (((values - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8)
    var = var * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_token_rewards(scores, lengths, T):
    """verl's token_level_rewards: the outcome score on each completion's last token."""
    out = torch.zeros(len(scores), T)
    for i, (s, n) in enumerate(zip(scores.tolist(), lengths.tolist())):
        out[i, n - 1] = s
    return out


def verl_rloo(token_rewards, mask, index):
    scores = token_rewards.sum(-1)
    by = defaultdict(list)
    for i, k in enumerate(index):
        by[k].append(scores[i])
    means = {k: torch.mean(torch.stack(v)) for k, v in by.items()}
    out = scores.clone()
    for i, k in enumerate(index):
        n = len(by[k])
        out[i] = scores[i] * n / (n - 1) - means[k] * n / (n - 1)
    return out.unsqueeze(-1) * mask


def verl_reinforce_pp(token_rewards, mask, gamma=1.0):
    returns = torch.zeros_like(token_rewards)
    running = 0
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return _verl_masked_whiten(returns, mask) * mask


def verl_reinforce_pp_baseline(token_rewards, mask, index):
    scores = token_rewards.sum(-1)
    by = defaultdict(list)
    for i, k in enumerate(index):
        by[k].append(scores[i])
    means = {k: torch.mean(torch.stack(v)) for k, v in by.items()}
    scores = torch.stack([scores[i] - means[k] for i, k in enumerate(index)])
    scores = scores.unsqueeze(-1).tile([1, token_rewards.shape[1]]) * mask
    return _verl_masked_whiten(scores, mask) * mask


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_estimators_equal_verl(estimator):
    """Ragged lengths (1 to T tokens); verl at commit VERL_COMMIT on token-level tensors; Relay's
    per-completion advantage broadcast over its tokens."""
    G, T = 4, 9
    r = _rewards(seed=2, groups=3, G=G)
    lengths = torch.tensor([9, 1, 4, 7, 2, 9, 3, 5, 6, 8, 1, 2])
    mask = _token_layout(lengths, T)
    token_rewards = _verl_token_rewards(r, lengths, T)
    index = [i // G for i in range(len(r))]
    want = {
        "rloo": lambda: verl_rloo(token_rewards, mask, index),
        "reinforce_plus_plus": lambda: verl_reinforce_pp(token_rewards, mask),
        "reinforce_plus_plus_baseline": lambda: verl_reinforce_pp_baseline(token_rewards, mask, index),
    }[estimator]()
    got = adv.ESTIMATORS[estimator](r, lengths.float(), G, "group")
    torch.testing.assert_close(got.unsqueeze(1) * mask, want, **TOL)


def test_whitening_without_two_loss_tokens_teaches_nothing():
    r = torch.tensor([1.0, 2.0, 0.0, 5.0])
    for lengths in ([0, 0, 0, 0], [0, 1, 0, 0]):
        assert (
            adv.ESTIMATORS["reinforce_plus_plus"](r, torch.tensor(lengths, dtype=torch.float), 2, "group").abs().max()
            == 0
        )


def test_loss_mask_drops_truncated_completions_only_when_asked():
    from pipeline.rl.grpo import loss_mask
    from pipeline.rl.rollout import assemble

    rollout = assemble([[5, 6], [7]], [[1, 2, 0, 9], [3, 4, 4, 4]], pad_id=9, eos_ids=[0])
    assert loss_mask(rollout, False).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert loss_mask(rollout, True).tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]


def test_rloo_equals_trl_rloo_trainer():
    """TRL 1.16 rloo_trainer.py: baseline = (group sum - r) / (G - 1), advantage = r - baseline."""
    r, G = _rewards(seed=4), 4
    grouped = r.view(-1, G)
    baseline = ((torch.nansum(grouped, 1, keepdim=True) - grouped) / (G - 1)).view(-1)
    torch.testing.assert_close(adv.leave_one_out(r, G), r - baseline, **TOL)
    assert adv.leave_one_out(r, G)[G : 2 * G].abs().max() == 0  # the all-equal group


def test_overlong_penalty_equals_trl_and_verl():
    from trl.rewards import get_soft_overlong_punishment

    max_len, buffer = 20, 6
    lengths = torch.tensor([1, 13, 14, 15, 17, 19, 20])
    want_trl = get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=buffer)(
        [[0] * n for n in lengths.tolist()]
    )
    torch.testing.assert_close(adv.overlong_penalty(lengths, max_len, buffer), torch.tensor(want_trl), **TOL)
    factor = 0.5  # verl/workers/reward_manager/dapo.py: min(-(len - (max - buffer)) / buffer * factor, 0)
    want_verl = [min(-(n - (max_len - buffer)) / buffer * factor, 0) for n in lengths.tolist()]
    torch.testing.assert_close(adv.overlong_penalty(lengths, max_len, buffer, factor), torch.tensor(want_verl), **TOL)


def test_informative_groups():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0 + 1e-6])
    assert adv.informative_groups(r, 3).tolist() == [False, False, True]


# ------------------------------------------------------------------------------------------
# Conflicting options: one line each, all together
# ------------------------------------------------------------------------------------------


def test_conflicting_options_each_one_line():
    bad = GRPOSection(
        loss_type="cispo",
        delta=1.5,
        scale_rewards="batch",
        advantage_estimator="reinforce_plus_plus",
        multi_objective_aggregation="normalize_then_sum",
        dynamic_sampling=True,
        top_entropy_quantile=1.5,
        max_generation_batches=0,
    )
    found = bad.problems()
    expected = [
        "grpo.epsilon_high: loss_type cispo caps the ratio",
        "grpo.delta: loss_type cispo does not read it",
        "grpo.scale_rewards: applies to advantage_estimator grpo only",
        "grpo.multi_objective_aggregation: normalize_then_sum yields",
        "grpo.scale_rewards: normalize_then_sum normalises",
        "grpo.dynamic_sampling: drops groups",
        "grpo.top_entropy_quantile: must be in [0, 1]",
        "grpo.max_generation_batches: must be >= 1",
    ]
    for start in expected:
        assert sum(p.startswith(start) for p in found) == 1, (start, found)
    assert all("\n" not in p for p in found)
    more = GRPOSection(loss_type="luspo", scale_rewards=True, epsilon_high=0.3, delta=1.2).problems()
    assert any(p.startswith("grpo.importance_sampling_level: loss_type luspo needs 'sequence'") for p in more)
    assert any("true is 'group'" in p for p in more)
    assert any(p.startswith("grpo.delta: must be > 1 + epsilon_high") for p in more)
    assert (
        GRPOSection(loss_type="vespo", importance_sampling_level="sequence")
        .problems()[0]
        .startswith("grpo.importance_sampling_level")
    )
    assert (
        GRPOSection(loss_type="sapo", epsilon_high=0.28).problems()[0].startswith("grpo.epsilon_high: loss_type sapo")
    )
    assert GRPOSection(overlong_buffer=64).generation_problems(64)[0].startswith("grpo.overlong_buffer: 64 must be <")
    for name in gl.LOSS_TYPES:  # each documented loss type, with what it needs, is accepted
        ok = GRPOSection(
            loss_type=name,
            epsilon_high=5.0 if name == "cispo" else None,
            importance_sampling_level="sequence" if name == "luspo" else "token",
        )
        assert ok.problems() == [], (name, ok.problems())


def test_objective_carries_every_loss_option():
    """Every field of the loss's Objective is a `grpo:` option with the same name and TRL's default."""
    section, objective = GRPOSection(), gl.Objective()
    for f in dataclasses.fields(gl.Objective):
        assert getattr(section, f.name) == getattr(objective, f.name), f.name
    from trl import GRPOConfig as TRLConfig

    trl_defaults = TRLConfig.__dataclass_fields__
    for name in (
        "epsilon",
        "delta",
        "beta",
        "loss_type",
        "importance_sampling_level",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
        "top_entropy_quantile",
        "mask_truncated_completions",
        "multi_objective_aggregation",
        "scale_rewards",
        "num_iterations",
    ):
        assert getattr(section, name) == trl_defaults[name].default, name


# ------------------------------------------------------------------------------------------
# The stage: dynamic sampling and the variants on a tiny model (one step each)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo_variants") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(8)))
    return path


def _stage(tmp_path, model_dir, prompts, grad_accum=1, **grpo_options):
    from stages import grpo

    cfg = grpo.GRPOConfig(output_dir=str(tmp_path))
    cfg.model.path, cfg.data.train, cfg.data.eval = str(model_dir), [str(prompts)], []
    cfg.train.eval_steps, cfg.train.batch_size, cfg.train.max_steps, cfg.train.grad_accum = 0, 2, 1, grad_accum
    cfg.train.lr_schedule, cfg.train.warmup, cfg.train.learning_rate = "constant", 0, 1e-3
    cfg.lora.r = 4
    cfg.generation.max_new_tokens, cfg.generation.missing_eos_penalty = 4, None
    cfg.grpo.reward_funcs = ["pipeline.algorithms.rewards:house_phrase"]
    cfg.checkpoint.resume, cfg.tracking.trackers = False, []
    for key, value in grpo_options.items():
        setattr(cfg.grpo, key, value)
    stage = grpo.GRPOStage(cfg)
    stage.validate()
    stage.build()
    return stage


def _prompt_rewards(odd_constant: bool):
    """A stand-in for GRPOStage.rewards: a prompt with an odd number (or every prompt, when not
    `odd_constant`) gets the same reward for all its completions, the others 0, 1, 2, 3."""

    def rewards(self, samples, rollout):
        prompts = [s["text"] for s in samples]
        values = [
            0.5 if (not odd_constant or int(re.search(r"number (\d+)", p).group(1)) % 2) else float(i % 4)
            for i, p in enumerate(prompts)
        ]
        total = torch.tensor(values)
        return total, {"fake": total}, {"fake": 1.0}

    return rewards


def test_dynamic_sampling_keeps_informative_groups_and_counts_the_rest(
    tmp_path, tiny_model_dir, prompts_file, monkeypatch
):
    from stages import grpo

    monkeypatch.setattr(grpo.GRPOStage, "rewards", _prompt_rewards(odd_constant=True))
    stage = _stage(tmp_path / "a", tiny_model_dir, prompts_file, dynamic_sampling=True, max_generation_batches=4)
    figures = stage.train_step()
    seen = stage.last_rollout
    assert seen["rewards"].view(-1, 4).tolist() == [[0.0, 1.0, 2.0, 3.0]] * 2  # only the even (informative) prompts
    assert (
        figures["grpo/dynamic/topped_up"] == 0
        and figures["grpo/dynamic/dropped_groups"] == 2 * figures["grpo/dynamic/generation_batches"] - 2
    )
    torch.testing.assert_close(seen["advantages"], adv.group_advantages(seen["rewards"], 4))
    assert seen["rollout"].input_ids.shape[0] == 8 and len(seen["rollout"].responses) == 8

    monkeypatch.setattr(grpo.GRPOStage, "rewards", _prompt_rewards(odd_constant=False))
    stage = _stage(tmp_path / "b", tiny_model_dir, prompts_file, dynamic_sampling=True, max_generation_batches=2)
    figures = stage.train_step()
    assert (
        figures["grpo/dynamic/generation_batches"],
        figures["grpo/dynamic/dropped_groups"],
        figures["grpo/dynamic/topped_up"],
    ) == (2, 4, 2)
    assert stage.last_rollout["advantages"].abs().max() == 0  # topped up with groups that teach nothing, and said so


def test_variants_run_in_the_stage(tmp_path, tiny_model_dir, prompts_file):
    """cispo + rloo + entropy filter + masked truncated completions + overlong shaping, two
    micro-batches: the step runs, the advantages are RLOO's of the logged rewards and the
    overlong part is the shaping of the completions' lengths."""
    stage = _stage(
        tmp_path,
        tiny_model_dir,
        prompts_file,
        loss_type="cispo",
        epsilon_high=5.0,
        advantage_estimator="rloo",
        top_entropy_quantile=0.5,
        mask_truncated_completions=True,
        overlong_buffer=2,
        grad_accum=2,
    )
    figures = stage.train_step()
    seen = stage.last_rollout
    lengths = seen["rollout"].response_mask.sum(1)
    torch.testing.assert_close(seen["parts"]["overlong"], adv.overlong_penalty(lengths, 4, 2))
    torch.testing.assert_close(seen["advantages"], adv.leave_one_out(seen["rewards"], 4))
    assert torch.isfinite(torch.tensor(figures["train/loss"])) and figures["grpo/reward/overlong"] <= 0


def test_first_step_loss_equals_trl_grpo_trainer(tmp_path, tiny_model_dir, monkeypatch):
    """TRL 1.16's GRPOTrainer (loss_type cispo, epsilon_high 5) runs one step on the tiny model; on
    the completions it sampled, Relay's log-probs (rollout.policy_logits, rl.logprobs_from_logits),
    its group advantages of TRL's rewards and its cispo loss give TRL's first-step loss."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig as TRLConfig

    from pipeline.algorithms import rl
    from pipeline.rl.rollout import policy_logits

    seen = []
    original = GRPOTrainer._compute_loss

    def spy(self, model, inputs):
        loss = original(self, model, inputs)
        seen.append(({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}, loss.detach().clone()))
        return loss

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", spy)
    args = TRLConfig(
        output_dir=str(tmp_path / "trl"),
        loss_type="cispo",
        epsilon_high=5.0,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=6,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        beta=0.0,
        learning_rate=1e-3,
        save_strategy="no",
        shuffle_dataset=False,
        temperature=0.9,
        seed=0,
        bf16=False,
    )
    prompts = Dataset.from_list([{"prompt": f"Question number {i}?"} for i in range(8)])
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[lambda completions, **kw: [float(len(c) % 5) for c in completions]],
        args=args,
        train_dataset=prompts,
    )
    trainer.train()
    inputs, want = seen[0]
    rewards = torch.tensor(
        list(trainer._logs["rewards"]["<lambda>"])
    )  # in generation order; TRL shuffles the rows it trains on
    advantages = adv.group_advantages(rewards, 4)
    torch.testing.assert_close(advantages, torch.tensor(list(trainer._logs["advantages"])), **TOL)
    torch.testing.assert_close(advantages.sort().values, inputs["advantages"].sort().values, **TOL)
    assert advantages.abs().sum() > 0

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logits = policy_logits(model, ids, attention, inputs["prompt_ids"].shape[1])
    logp = rl.logprobs_from_logits(logits.float() / 0.9, inputs["completion_ids"])
    mask = inputs["completion_mask"]
    out = gl.grpo_loss(
        logp,
        logp,
        inputs["advantages"],
        mask,
        objective=gl.Objective(loss_type="cispo", epsilon_high=5.0),
        totals=gl.Totals(float(mask.sum()), mask.shape[0], 6),
    )
    assert abs(float(out.loss) - float(want)) <= 1e-5, (float(out.loss), float(want))


@pytest.mark.parametrize(
    "estimator,scale", [("grpo", "batch"), ("reinforce_plus_plus", "group"), ("reinforce_plus_plus_baseline", "group")]
)
def test_advantages_use_every_ranks_completions(estimator, scale):
    """Two ranks (a stand-in accelerator whose gather puts rank 0's rows first): rank 1's
    advantages are its slice of the estimator on all rows, batch statistics included."""
    from pipeline.rl.rollout import assemble
    from stages import grpo

    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(16, generator=g)
    lengths = [1 + i % 5 for i in range(16)]
    rollouts = [
        assemble([[1]] * 8, [[2] * n for n in lengths[r * 8 : (r + 1) * 8]], pad_id=9, eos_ids=[0]) for r in (0, 1)
    ]
    section = GRPOSection(advantage_estimator=estimator, scale_rewards=scale)
    remote = torch.stack([rewards[:8].double(), torch.tensor(lengths[:8]).double(), rewards[:8].double()], 1)
    acc = SimpleNamespace(
        num_processes=2, process_index=1, device="cpu", gather=lambda local: torch.cat([remote, local])
    )
    me = SimpleNamespace(cfg=SimpleNamespace(grpo=section), accelerator=acc)
    every = grpo.GRPOStage.step_rewards(me, rewards[8:], {"r": rewards[8:]}, rollouts[1])
    got = grpo.GRPOStage.advantages(me, every, [1.0])
    want = adv.ESTIMATORS[estimator](rewards, torch.tensor(lengths).float(), 4, scale)[8:]
    torch.testing.assert_close(got, want, **TOL)
    assert not torch.allclose(
        got, adv.ESTIMATORS[estimator](rewards[8:], torch.tensor(lengths[8:]).float(), 4, scale)
    )  # rank-local differs


def test_the_loss_objectives_defaults_are_the_config_sections():
    """grpo_losses.Objective (what the loss reads) repeats the grpo: section's hyper-parameters for
    direct calls; a default changed on one side only would make them disagree."""
    import dataclasses

    from pipeline.algorithms.grpo_config import GRPOSection
    from pipeline.algorithms.grpo_losses import Objective

    section = {f.name: f.default for f in dataclasses.fields(GRPOSection)}
    shared = {f.name: f.default for f in dataclasses.fields(Objective) if f.name in section}
    assert len(shared) >= 10 and shared == {name: section[name] for name in shared}
