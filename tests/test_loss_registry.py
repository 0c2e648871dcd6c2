"""A GRPO loss type is one registry entry (pipeline/algorithms/grpo_losses.py LOSS_TYPES) that carries
its own checks of the `grpo:` section and the options it reads: the config checks read the entry,
never the name. A made-up loss type registered here is accepted, checked by its own rule, and told
apart from the ones that read `delta`, with no other file touched."""

from __future__ import annotations

import dataclasses

from pipeline.algorithms import grpo_losses
from pipeline.algorithms.grpo_config import GRPOSection


def test_a_new_loss_type_is_one_entry(monkeypatch):
    def problems(section, key):
        return [f"{key}.epsilon: loss_type capped needs epsilon < 0.1"] if section.epsilon >= 0.1 else []

    entry = grpo_losses.LossType(grpo_losses.cispo, grpo_losses.step_token_mean, problems, options=("epsilon",))
    monkeypatch.setitem(grpo_losses.LOSS_TYPES, "capped", entry)
    assert not entry.clips and grpo_losses.LOSS_TYPES["dapo"].clips

    section = dataclasses.replace(GRPOSection(), loss_type="capped", epsilon=0.2)
    assert section.problems("grpo") == ["grpo.epsilon: loss_type capped needs epsilon < 0.1"]
    assert dataclasses.replace(section, epsilon=0.05).problems("grpo") == []
    delta = dataclasses.replace(section, epsilon=0.05, delta=3.0).problems("grpo")
    assert len(delta) == 1 and delta[0].startswith("grpo.delta: loss_type capped does not read it (only grpo, ")
    assert "capped" not in delta[0].split("(only")[1]  # not listed among the loss types that read it


def test_the_shipped_entries_keep_their_checks():
    cispo = dataclasses.replace(GRPOSection(), loss_type="cispo", epsilon_high=None)
    assert any("loss_type cispo caps the ratio" in p for p in cispo.problems("grpo"))
    luspo = dataclasses.replace(GRPOSection(), loss_type="luspo", importance_sampling_level="token")
    assert any("loss_type luspo needs 'sequence'" in p for p in luspo.problems("grpo"))
    clipping = tuple(name for name, e in grpo_losses.LOSS_TYPES.items() if e.clips)
    assert clipping == ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def test_estimators_carry_what_the_checks_read():
    """scale_rewards and normalize_then_sum go with the group-normalising estimator, dynamic sampling
    with those that have a group baseline: read from the entries, not their names."""
    from pipeline.algorithms import advantages as adv

    assert [n for n, e in adv.ESTIMATORS.items() if e.scales_rewards] == ["grpo"]
    assert [n for n, e in adv.ESTIMATORS.items() if not e.group_baseline] == ["reinforce_plus_plus"]
    rloo = dataclasses.replace(GRPOSection(), advantage_estimator="rloo", scale_rewards="batch")
    assert any("applies to advantage_estimator grpo only (rloo scales its own way)" in p for p in rloo.problems("grpo"))
    free = dataclasses.replace(GRPOSection(), advantage_estimator="reinforce_plus_plus", dynamic_sampling=True)
    assert any("grpo.dynamic_sampling: drops groups of equal rewards" in p for p in free.problems("grpo"))


def test_ppos_clipped_surrogate_is_an_entry_of_the_same_table():
    """PPO's policy loss is the table's PPO_LOSS_TYPE entry (the clipped ratio, a token mean over the
    step) with a symmetric clip: on one micro-batch that is the whole step, GRPO's loss of that entry
    gives PPO's loss and clip fraction."""
    import torch

    from pipeline.algorithms import rl

    entry = grpo_losses.LOSS_TYPES[rl.PPO_LOSS_TYPE]
    assert entry.clips and entry.aggregate is grpo_losses.step_token_mean
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(3, 5, generator=g) * 2, -torch.rand(3, 5, generator=g) * 2
    adv, mask = torch.randn(3, 1, generator=g), (torch.rand(3, 5, generator=g) > 0.3).float()
    ppo = rl.policy_loss(logp, old, adv, mask, clip=0.2)
    grpo = grpo_losses.grpo_loss(logp, old, adv, mask, epsilon=0.2, loss_type=rl.PPO_LOSS_TYPE)
    assert 0 < float(ppo.clipfrac) < 1  # some tokens clipped, some not
    assert torch.equal(ppo.loss, grpo.loss) and torch.equal(ppo.clipfrac, grpo.clipfrac)
