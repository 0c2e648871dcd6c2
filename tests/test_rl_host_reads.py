"""The RL updates read the host as the LM step does: once per optimizer step, at its end, whatever
the accumulation (pipeline/rl/grpo.py `grpo_update`, pipeline/rl/ppo.py
`ppo_update`). Every micro-batch's figures stay on the device until then (each float() or .cpu()
of a device tensor is a sync on a GPU), and the figures the updates return are exactly those of
reading every micro-batch as it ran."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from stagerun import fresh_accelerate
from test_distributed_ppo import build as build_ppo
from test_grpo import SCORE_TARGET
from test_grpo import make_cfg as grpo_cfg
from test_pt_sft import fresh_accelerate_state  # noqa: F401 (fixture)

from pipeline.rl import grpo as algo
from pipeline.rl import ppo as ppo_algo
from pipeline.rl.ppo import make_experience
from stages import grpo

ROOT = Path(__file__).resolve().parents[1]
BOOKKEEPING = tuple(str(ROOT / part) for part in ("pipeline/algorithms", "pipeline/rl", "pipeline/engine", "stages"))
"""Where the updates keep their figures. The model's forward (pipeline/modeling) is left out: its
shared-opening search reads the prompt block once per forward, which is not figure bookkeeping."""


@pytest.fixture
def relay_reads():
    """Counts the calls that move a tensor's value to the host (test_engine_steps.host_reads' list)
    made from the updates' own code."""
    calls = {"n": 0}
    names = ("cpu", "item", "tolist", "__float__", "__int__", "__bool__")
    originals = {n: getattr(torch.Tensor, n) for n in names}

    def counting(name):
        def wrapper(self, *a, **k):
            calls["n"] += sys._getframe(1).f_code.co_filename.startswith(BOOKKEEPING)
            return originals[name](self, *a, **k)

        return wrapper

    for n in names:
        setattr(torch.Tensor, n, counting(n))
    try:
        yield calls
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)


def _grpo_update_reads(tmp_path, policy, prompts, accum: int, relay_reads, monkeypatch):
    """One GRPO step (2 iterations, beta > 0) with `accum` micro-batches: (Relay's host reads in
    grpo_update, its figures, each micro-batch's loss outputs)."""
    SCORE_TARGET["token"] = "a"
    cfg = grpo_cfg(tmp_path / f"grpo{accum}", policy, prompts, max_steps=1, learning_rate=1e-2, grad_accum=accum)
    cfg.grpo.beta, cfg.grpo.num_iterations = 0.1, 2
    stage = grpo.GRPOStage(cfg)
    stage.validate()
    stage.build()
    seen, real_update, real_loss = {}, algo.grpo_update, algo.grpo_loss
    outs = []

    def loss(*a, **k):
        out = real_loss(*a, **k)
        outs.append(out)
        return out

    def update(*a, **k):
        start = relay_reads["n"]
        seen["figures"] = real_update(*a, **k)
        seen["reads"] = relay_reads["n"] - start
        return seen["figures"]

    monkeypatch.setattr(algo, "grpo_loss", loss)
    monkeypatch.setattr(algo, "grpo_update", update)
    stage.train_step()
    monkeypatch.undo()
    return seen["reads"], seen["figures"], outs


def test_grpo_update_reads_the_host_once_a_step_and_its_figures_are_the_micro_batches(
    tmp_path, tiny_model_dir, relay_reads, monkeypatch
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(8)))
    one_reads, one, _ = _grpo_update_reads(tmp_path, tiny_model_dir, prompts, 1, relay_reads, monkeypatch)
    four_reads, four, outs = _grpo_update_reads(tmp_path, tiny_model_dir, prompts, 4, relay_reads, monkeypatch)
    assert four_reads == one_reads, (
        f"host reads grow with accumulation: {one_reads} for 1 micro-batch, {four_reads} for 4"
    )
    # per optimizer step: optimizer_step's one read of the device (figures and norm in one .cpu())
    # and 2 of that host copy (the norm, the checked loss), the update's .tolist() of it; per
    # update: the rollout's counts, read where the rollout lives (the host)
    assert one_reads <= 2 * 4 + 2, one_reads
    # the figures, as reading every micro-batch as it ran gives them (8 micro-batches: 2 iterations x 4)
    assert len(outs) == 8
    per_step = [outs[:4], outs[4:]]
    assert four["loss"] == sum(sum(float(o.loss) for o in step) for step in per_step) / 2
    for key in ("clipfrac", "kl"):  # each step's token mean over its micro-batches, then the steps' mean
        pooled = [
            sum(float(getattr(o, key)) * float(o.clip_items) for o in step) / sum(float(o.clip_items) for o in step)
            for step in per_step
        ]
        assert four[key] == pytest.approx(sum(pooled) / 2, rel=1e-12, abs=1e-15), key
    assert four["ratio_dev_first"] == 0.0 and four["kl"] > 0
    assert set(four) == set(one) == {"ratio_dev_first", "clipfrac", "kl", "loss", "grad_norm"}


def _ppo_update_reads(stage, exp, relay_reads, monkeypatch):
    """One PPO update of `exp`: (Relay's host reads in it, its figures, each micro-batch's figures)."""
    real, micro = ppo_algo.actor_critic_backward, []

    def backward(model, exp, idx, *args, **kwargs):
        micro.append({**real(model, exp, idx, *args, **kwargs), "tokens": float(exp.rollout.response_mask[idx].sum())})
        return micro[-1]

    monkeypatch.setattr(ppo_algo, "actor_critic_backward", backward)
    start = relay_reads["n"]
    figures = ppo_algo.ppo_update(stage.model, stage.optimizer, exp, stage.accelerator, stage.cfg, step=1)
    reads = relay_reads["n"] - start
    monkeypatch.undo()
    return reads, figures, micro


def test_ppo_update_reads_the_host_once_a_step_and_its_figures_are_the_micro_batches(
    tmp_path, tiny_model_dir, tiny_reward_dir, relay_reads, monkeypatch
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Question number {i}" + "?" * (i % 3 + 1)}) + "\n" for i in range(8))
    )
    results, exp = {}, None
    for accum in (1, 4):
        fresh_accelerate()
        stage = build_ppo(tmp_path, tiny_model_dir, tiny_reward_dir, prompts, accum)
        stage.cfg.ppo.epochs = 2  # two optimizer steps, the second over a shuffled order
        if exp is None:
            batch = [stage.train_samples[i] for i in stage.next_sample_indices(grad_accum=1)[0]]
            exp = make_experience(
                stage.inner,
                stage.rollout(batch),
                [p["text"] for p in batch],
                cfg=stage.cfg,
                kl_coef=0.05,
                normaliser=stage.normaliser,
                reward_fn=stage.reward_fn,
                accelerator=stage.accelerator,
            )
        results[accum] = _ppo_update_reads(stage, exp, relay_reads, monkeypatch)
    (one_reads, one, _), (four_reads, four, micro) = results[1], results[4]
    assert four_reads == one_reads, (
        f"host reads grow with accumulation: {one_reads} for 1 micro-batch, {four_reads} for 4"
    )
    # per optimizer step: optimizer_step's one read of the device and 2 of its host copy, the
    # update's .tolist() of it, and the micro-batches' token counts, read where the rollout lives
    assert one_reads <= 2 * 5, one_reads
    assert len(micro) == 8 and all(isinstance(v, torch.Tensor) for k, v in micro[0].items() if k != "tokens")
    steps = [micro[:4], micro[4:]]
    for key in ppo_algo.POOLED_FIGURES:
        # each optimizer step's token mean over its micro-batches (weighed by their tokens), then
        # the mean of the two steps; the same as the one micro-batch of 8 rows reads
        pooled = [sum(float(m[key]) * m["tokens"] for m in step) / sum(m["tokens"] for m in step) for step in steps]
        assert four[key] == pytest.approx(sum(pooled) / 2, rel=1e-12, abs=1e-15), key
        assert four[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert four["ratio_dev_first"] == float(micro[0]["ratio_dev"]) == 0.0
    assert set(four) == set(one)
