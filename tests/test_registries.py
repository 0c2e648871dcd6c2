"""Families of interchangeable rules are registries whose entries carry what the config checks and
the capability table read: a made-up entry registered here is accepted and checked, and reaches the
code that runs it, with no other file touched (GRPO's loss types and estimators:
tests/test_loss_registry.py; generation and serving backends: tests/test_backends.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pipeline.algorithms import mismatch, rl
from pipeline.config import capabilities as caps
from pipeline.config import policy
from pipeline.config.policy import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]


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

    monkeypatch.setitem(mt.MODES, "tasks", mt.LossMode(True, reads_task_weights=True, doc="per-task means"))
    monkeypatch.setitem(mt.MODES, "trend", mt.LossMode(True, adaptive=True, doc="weights from loss trends"))
    cfg = SFTConfig()
    cfg.data.eval, cfg.data.eval_fraction = [], 0.0
    cfg.multitask.weighted_loss_mode, cfg.multitask.task_weights = "tasks", {"b": 3.0}
    assert cfg.multitask.problems() == [] and SFTStage(cfg).problems() == []
    stage = SFTStage(cfg)
    stage.tasks = ["a", "b"]
    assert stage.task_weights() == [1.0, 3.0]
    assert mt.token_weights(torch.tensor([2.0, 1.0, 0.0]), "tasks").tolist() == [0.25, 0.5, 0.0]

    cfg.multitask.weighted_loss_mode = "trend"  # its weights are its own: task_weights are refused
    assert cfg.multitask.problems() == [
        "multitask.task_weights: read only by weighted_loss_mode case3, tasks; trend would ignore them"
    ]
    cfg.multitask.task_weights = {}
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
    monkeypatch.setitem(caps.ENGINES, "zero1", caps.Engine("ZeRO-1", "deepspeed", "any", False, 1))
    assert caps.config_cell("sft", cfg, ranks=2) == (caps.Cell("sft", adapter="lora", engine="zero1"), None)
    assert any(c.engine == "zero1" for c in caps.cells())
    # QLoRA is the DeepSpeed entry's fact, by ZeRO stage: stage 1 keeps whole weights (refused only as untested)
    assert caps.refusal(caps.Cell("sft", adapter="qlora", engine="zero1")).startswith("combination ")
    assert caps.refusal(caps.Cell("sft", adapter="qlora", engine="zero3")).startswith(
        "model.finetuning: qlora cannot load under DeepSpeed ZeRO-3"
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


# ------------------------------------------------------------------------------------------
# Distributed engines: facts (pipeline/config/engines.py) and runtime (pipeline/engine/engines.py)
# ------------------------------------------------------------------------------------------

GOSSIP_PACKAGE = "relay_made_up_gossip"


def _sft_config(tmp_path, engine: str):
    from stages.sft import SFTConfig

    cfg = SFTConfig()
    cfg.output_dir, cfg.distributed.engine = str(tmp_path / "out"), engine
    return cfg


def _checkpoint(tmp_path) -> None:
    import json

    step = tmp_path / "out" / "checkpoints" / "step-0000001"
    step.mkdir(parents=True)
    (step / ".complete").write_text(json.dumps({"step": 1, "lifetime": "temporary", "world_size": 2}))


def test_a_new_distributed_engine_is_one_entry_on_each_side(monkeypatch, tmp_path):
    """A made-up engine registered in both halves under one name: the config check accepts it, the
    combination check reports its package, its own problems and its resume refusal; PPO's tool
    check, the packages a stage keeps unloaded, the Accelerator's options, the fill-in after it
    exists and the model's preparation all come from its entries, with no name compared elsewhere."""
    import sys

    import accelerate

    from pipeline.config import DistributedConfig
    from pipeline.config import engines as facts
    from pipeline.engine import accelerator as acc
    from pipeline.engine import engines as runtimes
    from pipeline.engine.stage import hide_unrequested_backends
    from stages.ppo import PPOConfig

    calls = []

    def prepare(accelerator, model, cfg, optimizer_for, mixed):
        calls.append(("prepare", mixed))
        return model, optimizer_for(model)

    monkeypatch.setitem(
        facts.ENGINES,
        "gossip",
        facts.EngineFacts(
            "made-up gossip averaging",
            package=GOSSIP_PACKAGE,
            no_resume="gossip keeps no optimizer state",
            lockstep=lambda zero_stage, gathers: "every gossip round samples in lockstep",
        ),
    )
    monkeypatch.setitem(
        runtimes.RUNTIMES,
        "gossip",
        runtimes.EngineRuntime(
            problems=lambda cfg, f: [f"distributed.engine: gossip ({f.summary}) needs 3 ranks"],
            accelerator_kwargs=lambda cfg, cuda: {"cpu": True, "gossip_rounds": cfg.train.grad_accum},
            after_creation=lambda accelerator, cfg, cuda: calls.append(("after", accelerator.kwargs["gossip_rounds"])),
            prepare=prepare,
        ),
    )
    assert DistributedConfig(engine="gossip").problems() == []
    assert DistributedConfig(engine="gossip2").problems() == [
        "distributed.engine: 'gossip2' is not one of 'ddp', 'deepspeed', 'fsdp', 'gossip'"
    ]

    cfg = _sft_config(tmp_path, "gossip")
    _checkpoint(tmp_path)
    assert acc.combination_problems(cfg) == [
        f"distributed.engine: gossip needs the {GOSSIP_PACKAGE} package (pip install {GOSSIP_PACKAGE}); "
        "or use ddp or fsdp",
        "distributed.engine: gossip (made-up gossip averaging) needs 3 ranks",
        "checkpoint.resume: this folder's checkpoint was written by a distributed.engine gossip run, which does "
        "not resume (gossip keeps no optimizer state); set checkpoint.resume false to start again (its checkpoints "
        "are moved aside, not deleted). Runs under distributed.engine ddp or fsdp resume exactly",
    ]

    ppo = PPOConfig()
    ppo.distributed.engine, ppo.tools.funcs = "gossip", ["tools.py:lookup"]
    assert [p for p in ppo.problems() if p.startswith("tools.funcs: tool rollouts")] == [
        "tools.funcs: tool rollouts need ranks that sample on their own, taking different numbers of turns: every "
        "gossip round samples in lockstep"
    ]

    seen = {name: name in sys.modules for name in (GOSSIP_PACKAGE, "deepspeed", "bitsandbytes")}
    try:
        cfg.model.finetuning = "qlora"  # bitsandbytes wanted: left as it is
        hide_unrequested_backends(_sft_config(tmp_path, "ddp"))
        assert GOSSIP_PACKAGE in sys.modules and sys.modules[GOSSIP_PACKAGE] is None
        del sys.modules[GOSSIP_PACKAGE]
        hide_unrequested_backends(cfg)
        assert GOSSIP_PACKAGE not in sys.modules  # the chosen engine's package may load
    finally:
        for name, present in seen.items():
            if not present:
                sys.modules.pop(name, None)

    class Accelerator:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setattr(accelerate, "Accelerator", Accelerator)
    cfg.train.grad_accum, cfg.train.precision = 3, "fp32"
    accelerator = acc.setup_accelerator(cfg)
    assert accelerator.kwargs == {
        "mixed_precision": "no",
        "step_scheduler_with_optimizer": False,
        "cpu": True,
        "gossip_rounds": 3,
    }
    model = torch.nn.Linear(2, 2)
    prepared, optimizer = acc.prepare_training(accelerator, model, cfg)
    assert prepared is model and isinstance(optimizer, torch.optim.AdamW)
    assert calls == [("after", 3), ("prepare", "no")]


def test_engine_facts_and_runtimes_name_the_same_engines():
    from pipeline.config import engines as facts
    from pipeline.engine import engines as runtimes

    assert list(facts.ENGINES) == list(runtimes.RUNTIMES) == ["ddp", "deepspeed", "fsdp"]


def test_the_capability_tables_engines_agree_with_the_engine_facts(monkeypatch):
    """Each column of the capability table is a distributed.engine entry; where the table states a
    fact of its own it agrees with the entry's (QLoRA, a ZeRO stage read from the entry's file), and
    the tool-rollout refusal is read from the entry: a made-up lockstep under fsdp moves it."""
    from pipeline.config import engines as facts

    for name, column in caps.ENGINES.items():
        entry = facts.ENGINES[column.config]
        assert not column.zero or entry.config_file == "deepspeed_config", name
        if entry.no_qlora(column.zero_stage):  # the table refuses with the config check's own line
            for stage in ("pt", "sft", "rm"):
                assert caps.refusal(caps.Cell(stage, adapter="qlora", engine=name)) == entry.no_qlora(
                    column.zero_stage
                ), (name, stage)
        tools = caps.refusal(caps.Cell("grpo", "relay", "on", "lora", name, "none"))
        why = facts.tools_refusal(column.config, column.zero_stage)
        assert (why is None and not (tools or "").startswith("tools.funcs: tool rollouts run under")) or (
            tools == f"tools.funcs: {why}"
        ), name

    fsdp_tools = caps.Cell("grpo", "relay", "on", "lora", "fsdp", "none")
    assert not (caps.refusal(fsdp_tools) or "").startswith("tools.funcs")
    monkeypatch.setitem(
        facts.ENGINES,
        "fsdp",
        dataclasses.replace(facts.ENGINES["fsdp"], lockstep=lambda zero_stage, gathers: "made-up fsdp lockstep"),
    )
    assert caps.refusal(fsdp_tools) == (
        "tools.funcs: tool rollouts need ranks that sample on their own, taking different numbers of turns: made-up "
        "fsdp lockstep"
    )


def test_the_engine_refusals_keep_their_words(monkeypatch, tmp_path):
    """Every refusal an engine's entries make, word for word as before they were entries (the docs and
    other tests quote them)."""
    import importlib.util
    from pathlib import Path

    from pipeline.config import DistributedConfig
    from pipeline.engine import accelerator as acc
    from stages.ppo import PPOConfig

    zero3 = str(Path(__file__).resolve().parents[1] / "deepspeed_configs" / "zero3.json")
    assert DistributedConfig(engine="horovod", fsdp_sharding="HALF").problems() == [
        "distributed.engine: 'horovod' is not one of 'ddp', 'deepspeed', 'fsdp'",
        "distributed.fsdp_sharding: 'HALF' is not one of 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD'",
    ]
    assert DistributedConfig(engine="deepspeed").problems() == [
        "distributed.deepspeed_config: required when distributed.engine is deepspeed"
    ]
    assert DistributedConfig(engine="deepspeed", deepspeed_config="none.json").problems() == [
        "distributed.deepspeed_config: no such file 'none.json'"
    ]
    assert DistributedConfig(engine="deepspeed", deepspeed_config=zero3).problems() == []

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    cfg = _sft_config(tmp_path, "deepspeed")
    cfg.distributed.deepspeed_config, cfg.model.finetuning = zero3, "qlora"
    _checkpoint(tmp_path)
    assert acc.combination_problems(cfg) == [
        "distributed.engine: deepspeed needs the deepspeed package (pip install deepspeed); or use ddp or fsdp",
        "model.finetuning: qlora cannot load under DeepSpeed ZeRO-3 (its 4-bit weights are placed through a "
        "device_map, which ZeRO-3's partitioned loading refuses); use a ZeRO-2 config "
        "(deepspeed_configs/zero2.json), distributed.engine ddp, or model.finetuning lora",
        "checkpoint.resume: this folder's checkpoint was written by a distributed.engine deepspeed run, which does "
        "not resume (ZeRO shards the optimizer state over ranks; the checkpoint holds rank 0's share); set "
        "checkpoint.resume false to start again (its checkpoints are moved aside, not deleted). Runs under "
        "distributed.engine ddp or fsdp resume exactly",
    ]
    cfg.distributed.engine, cfg.distributed.fsdp_sharding = "fsdp", "NO_SHARD"
    assert acc.combination_problems(cfg) == [
        "distributed.fsdp_sharding: NO_SHARD has no FSDP2 counterpart (FSDP2 always shards); use FULL_SHARD or "
        "SHARD_GRAD_OP, or distributed.engine ddp for unsharded data parallelism",
        "distributed.engine: fsdp cannot shard QLoRA's 4-bit weights; use distributed.engine ddp, "
        "or model.finetuning lora or full",
    ]
    cfg.distributed.engine = "ddp"
    assert acc.combination_problems(cfg) == []

    ppo = PPOConfig()
    ppo.distributed.engine, ppo.tools.funcs = "deepspeed", ["tools.py:lookup"]
    ppo.distributed.deepspeed_config = str(ROOT / "deepspeed_configs" / "zero3.json")
    assert [p for p in ppo.problems() if p.startswith("tools.funcs: tool rollouts")] == []  # gathered for sampling
    ppo.generation.zero3_gather = False
    assert [p for p in ppo.problems() if p.startswith("tools.funcs: tool rollouts")] == [
        "tools.funcs: tool rollouts need ranks that sample on their own, taking different numbers of turns: under "
        "DeepSpeed ZeRO-3 with generation.zero3_gather false every rank samples in lockstep; set it true"
    ]

    with pytest.raises(ValueError, match=r"^distributed.engine: 'horovod' is not one of ddp, deepspeed, fsdp$"):
        acc.setup_accelerator(_sft_config(tmp_path, "horovod"))
    with pytest.raises(
        ValueError, match=r"^distributed.deepspeed_config: required when distributed.engine is deepspeed$"
    ):
        acc.setup_accelerator(_sft_config(tmp_path, "deepspeed"))


@pytest.mark.parametrize("stage", ["ppo", "grpo", "distill"])
def test_zero3_gather_is_read_under_zero3_alone_and_false_refuses_tool_rollouts(stage):
    """generation.zero3_gather false keeps a ZeRO-3 policy partitioned while it samples (every rank in
    lockstep): refused where no ZeRO-3 reads it, and beside tools (ranks take different numbers of
    turns); the default gathers, and tools run under ZeRO-2 and ZeRO-3 alike."""
    from stages import stage_class

    def lines(engine: str, zero: str = "", gather: bool = True, tools: bool = False) -> list[str]:
        cfg = stage_class(stage).config_class()
        cfg.distributed.engine, cfg.generation.zero3_gather = engine, gather
        if zero:
            cfg.distributed.deepspeed_config = str(ROOT / "deepspeed_configs" / f"{zero}.json")
        if tools:
            cfg.tools.funcs = ["tools.py:lookup"]
        return [p for p in cfg.problems() if "zero3_gather" in p or p.startswith("tools.funcs: tool rollouts")]

    assert lines("ddp") == lines("deepspeed", "zero2") == lines("deepspeed", "zero3", gather=False) == []
    assert lines("ddp", gather=False) == [
        "generation.zero3_gather: only DeepSpeed ZeRO-3 reads it (distributed.engine is 'ddp')"
    ]
    assert lines("deepspeed", "zero2", gather=False) == [
        "generation.zero3_gather: only DeepSpeed ZeRO-3 reads it (distributed.engine is 'deepspeed', ZeRO stage 2)"
    ]
    assert lines("deepspeed", "missing", gather=False) == []  # the missing file is the one problem named
    if stage == "distill":  # no tools
        return
    assert lines("deepspeed", "zero2", tools=True) == lines("deepspeed", "zero3", tools=True) == []
    assert lines("deepspeed", "zero3", gather=False, tools=True) == [
        "tools.funcs: tool rollouts need ranks that sample on their own, taking different numbers of turns: under "
        "DeepSpeed ZeRO-3 with generation.zero3_gather false every rank samples in lockstep; set it true"
    ]
