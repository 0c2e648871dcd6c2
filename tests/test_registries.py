"""Families of interchangeable rules are registries whose entries carry what the config checks and
the capability table read: a made-up entry registered here is accepted and checked, and reaches the
code that runs it, with no other file touched (GRPO's loss types and estimators:
tests/test_loss_registry.py; generation and serving backends: tests/test_backends.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.algorithms import mismatch, rl
from pipeline.config import capabilities as caps
from pipeline.config import policy
from pipeline.config.policy import GenerationConfig


def test_a_new_kl_estimator_is_one_entry(monkeypatch):
    """PPO's ppo.kl_estimator is checked against rl.KL_ESTIMATORS and kl_per_token reads it: a made-up
    k2 (half the squared log-ratio, verl's 'mse') is accepted and used."""
    from stages.ppo import PPOSection

    monkeypatch.setitem(rl.KL_ESTIMATORS, "k2", rl.KLEstimator(lambda r: 0.5 * r**2, "half the squared log-ratio"))
    logp, ref = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.5, -1.0, -0.5]])
    assert torch.equal(rl.kl_per_token(logp, ref, "k2"), 0.5 * (logp - ref) ** 2)

    def kl_problems(name):
        return [p for p in dataclasses.replace(PPOSection(), kl_estimator=name).problems("ppo") if "kl_estimator" in p]

    assert kl_problems("k2") == []
    assert kl_problems("k9") == ["ppo.kl_estimator: 'k9' is not one of ('k1', 'k3', 'k2')"]
    with pytest.raises(ValueError, match="not one of k1, k3, k2"):
        rl.kl_per_token(logp, ref, "k9")


def test_the_shipped_kl_estimators_are_schulmans():
    r = torch.tensor([-0.7, 0.0, 0.3])
    assert torch.equal(rl.kl_per_token(r, torch.zeros(3), "k1"), r)
    assert torch.allclose(rl.kl_per_token(r, torch.zeros(3), "k3"), torch.exp(-r) - 1 + r)


def test_a_new_correction_is_one_entry_on_each_side(monkeypatch):
    """A correction's facts (config/policy.py CORRECTIONS: whether it weighs tokens, its options) and
    its weights (algorithms/mismatch.py CORRECTIONS) under one name: the config check, `auto`'s
    resolution, the capability table's cells and its refusal rule read the facts, not the name."""
    monkeypatch.setitem(policy.CORRECTIONS, "half", policy.Correction(True, ("correction_cap",), "half TIS"))
    monkeypatch.setitem(mismatch.CORRECTIONS, "half", lambda r, cap, floor: 0.5 * r.exp().clamp(max=cap))
    gen = GenerationConfig(correction="half")
    assert gen.problems() == [] and gen.correction_name == "half"
    assert GenerationConfig(correction="halve").problems() == [
        "generation.correction: 'halve' is not one of ('auto', 'none', 'tis', 'mis', 'half')"
    ]
    assert any(c.correction == "half" for c in caps.cells())
    relay = caps.Cell("grpo", "relay", "off", "lora", "single", "half")
    assert caps.refusal(relay).startswith("generation.correction: half weighs each token by p_trainer / p_engine")
    vllm = caps.Cell("grpo", "vllm", "off", "lora", "single", "half")
    assert "not run by Relay's test suite yet" in caps.refusal(vllm)  # allowed by the rules, not yet tested

    trainer, engine = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    weights = mismatch.correction_weights("half", trainer, engine, torch.ones(1, 2), 1.5)
    assert torch.allclose(weights, 0.5 * (trainer - engine).exp().clamp(max=1.5))
    # a correction that weighs nothing passes the table's rule on any backend
    monkeypatch.setitem(policy.CORRECTIONS, "half", policy.Correction(False))
    assert not caps.refusal(relay).startswith("generation.correction")


def test_correction_facts_and_weights_name_the_same_entries():
    assert list(policy.CORRECTIONS) == list(mismatch.CORRECTIONS) == ["none", "tis", "mis"]
    assert [n for n, c in policy.CORRECTIONS.items() if c.weighs] == ["tis", "mis"]


def test_a_new_sft_loss_mode_is_one_entry(monkeypatch):
    """SFT's loss modes are pipeline/algorithms/multitask.py's MODES: the engine gets task weights, never
    a mode's name. A made-up mode is accepted by the section's check, weighs as its entry says, and an
    adaptive one needs held-out data by the stage's check of the entry's fact."""
    from pipeline.algorithms import multitask as mt
    from stages.sft import SFTConfig, SFTStage

    monkeypatch.setitem(mt.MODES, "tasks", mt.LossMode(True, doc="per-task means"))
    monkeypatch.setitem(mt.MODES, "trend", mt.LossMode(True, adaptive=True, doc="weights from loss trends"))
    cfg = SFTConfig()
    cfg.data.eval, cfg.data.eval_fraction = [], 0.0
    cfg.multitask.weighted_loss_mode, cfg.multitask.task_weights = "tasks", {"b": 3.0}
    assert cfg.multitask.problems() == [] and SFTStage(cfg).problems() == []
    stage = SFTStage(cfg)
    stage.tasks = ["a", "b"]
    assert stage.task_weights() == [1.0, 3.0]
    assert mt.token_weights(torch.tensor([2.0, 1.0, 0.0]), "tasks").tolist() == [0.25, 0.5, 0.0]

    cfg.multitask.weighted_loss_mode = "trend"
    assert cfg.multitask.problems() == []
    assert SFTStage(cfg).problems() == [
        "multitask.weighted_loss_mode: trend needs held-out data (data.eval or data.eval_fraction)"
    ]
    cfg.multitask.weighted_loss_mode = "none"
    assert SFTStage(cfg).task_weights() is None  # the token mean
    cfg.multitask.weighted_loss_mode = "tasks9"
    assert cfg.multitask.problems() == [
        "multitask.weighted_loss_mode: 'tasks9' is not one of none, case3, coba, self-paced, tasks, trend"
    ]


def test_a_new_distributed_engine_is_one_entry(monkeypatch, tmp_path):
    """The capability table's engines (config/capabilities.py ENGINES) carry their distributed.engine
    value, ranks, ZeRO stage and whether they hold QLoRA's weights: a config's cell and the refusal
    rules read those facts. A made-up ZeRO-1 entry takes the DeepSpeed configs of stage 1, which
    were refused by name before."""
    from types import SimpleNamespace as NS

    ds = tmp_path / "zero1.json"
    ds.write_text('{"zero_optimization": {"stage": 1}}')
    cfg = NS(distributed=NS(engine="deepspeed", deepspeed_config=str(ds)), model=NS(finetuning="lora"))
    assert caps.config_cell("sft", cfg, ranks=2) == (
        None,
        "distributed.deepspeed_config: ZeRO stage 1 is not run by Relay's test suite (stages 2, 3 are)",
    )
    monkeypatch.setitem(caps.ENGINES, "zero1", caps.Engine("ZeRO-1", "deepspeed", "any", False, 1, qlora=False))
    assert caps.config_cell("sft", cfg, ranks=2) == (caps.Cell("sft", adapter="lora", engine="zero1"), None)
    assert any(c.engine == "zero1" for c in caps.cells())
    assert caps.refusal(caps.Cell("sft", adapter="qlora", engine="zero1")).startswith(
        "distributed.engine: deepspeed cannot shard QLoRA's 4-bit weights"
    )
    ddp = NS(distributed=NS(engine="ddp", deepspeed_config=None), model=NS(finetuning="lora"))
    assert [caps.config_cell("sft", ddp, ranks=n)[0].engine for n in (1, 2)] == ["single", "ddp"]
    assert caps.config_cell("sft", NS(distributed=NS(engine="horovod"), model=ddp.model), ranks=2) == (None, None)


def test_a_dpo_loss_carries_its_own_checks(monkeypatch):
    """DPO's LossSpec carries its own checks of the `dpo:` section beside the options it reads (exo_pair's
    label smoothing is one): a made-up loss is checked by its own rule, no name compared in the stage."""
    from pipeline.algorithms import preference as pref
    from stages.dpo import DPOSection

    def problems(section, key):
        return [f"{key}.beta: loss_type strict needs beta <= 0.5"] if section.beta > 0.5 else []

    monkeypatch.setitem(pref.LOSSES, "strict", pref.LossSpec(pref.sigmoid_loss, problems=problems))
    assert dataclasses.replace(DPOSection(), loss_type="strict", beta=0.6).problems("dpo") == [
        "dpo.beta: loss_type strict needs beta <= 0.5"
    ]
    assert dataclasses.replace(DPOSection(), loss_type="strict", beta=0.1).problems("dpo") == []
