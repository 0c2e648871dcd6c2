"""PPO's update does not depend on how a mini-batch is split: 1 x 8, 2 x 4 and 8 x 1 micro-batches
of the same 8 responses (lengths 1-6 tokens) give the same gradient, because the loss is
token-normalised over the whole mini-batch (pipeline/rl/ppo.py `ppo_update`).
Over ranks the same holds with whitening and reward normalisation global: the DDP runs of
tests/test_distributed_stages.py equal one process."""

from __future__ import annotations

import json

import pytest
import torch
from distrun import ScriptedGenerator, scripted_reward
from stagerun import fresh_accelerate
from test_pt_sft import fresh_accelerate_state  # noqa: F401 (fixture)

from pipeline.rl.ppo import POOLED_FIGURES, make_experience, ppo_update
from stages import ppo


def build(tmp_path, policy, reward, prompts, accum: int) -> ppo.PPOStage:
    cfg = ppo.PPOConfig(output_dir=str(tmp_path / f"accum{accum}"))
    cfg.model.path, cfg.reward_model.path = str(policy), str(reward)
    cfg.data.train, cfg.data.eval = [str(prompts)], []
    cfg.train.eval_steps, cfg.train.batch_size, cfg.train.grad_accum = 0, 8, accum
    cfg.train.max_grad_norm = 0.0  # measure, do not clip: the gradients themselves are compared
    cfg.ppo.mini_batch_size, cfg.ppo.epochs = 8, 1
    cfg.lora.r, cfg.lora.dropout = 4, 0.0
    cfg.generation.max_new_tokens = 6
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    stage = ppo.PPOStage(cfg, generator_factory=lambda policy: ScriptedGenerator(), reward_fn=scripted_reward)
    stage.validate()
    stage.build()
    return stage


def gradients_of_one_update(stage: ppo.PPOStage, exp) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradients the optimizer steps on in one mini-batch update of `exp`, and the figures
    the update reports."""
    seen: dict[str, torch.Tensor] = {}
    inner = stage.optimizer.step

    def step(*args, **kwargs):
        seen.update({n: p.grad.detach().clone() for n, p in stage.model.named_parameters() if p.grad is not None})
        return inner(*args, **kwargs)

    stage.optimizer.step = step
    figures = ppo_update(stage.model, stage.optimizer, exp, stage.accelerator, stage.cfg, step=1)
    return seen, figures


def test_ppo_update_is_the_same_for_every_split_of_a_mini_batch(tmp_path, tiny_model_dir, tiny_reward_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Question number {i}" + "?" * (i % 3 + 1)}) + "\n" for i in range(8))
    )
    grads, figures = {}, {}
    exp = None
    for accum in (1, 2, 8):
        fresh_accelerate()
        stage = build(tmp_path, tiny_model_dir, tiny_reward_dir, prompts, accum)
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
            lengths = exp.rollout.response_mask.sum(1).tolist()
            assert len(set(lengths)) > 2  # responses differ in length, so a mean of micro-batch means would differ
        grads[accum], figures[accum] = gradients_of_one_update(stage, exp)
    assert grads[1] and grads[1].keys() == grads[2].keys() == grads[8].keys()
    # The figures are the step's too: token means over the whole mini-batch, not means of
    # micro-batch means, which weigh a short response's tokens more and read differently for the
    # same update (bench/RESULTS.md).
    for accum in (2, 8):
        for key in POOLED_FIGURES:
            assert figures[accum][key] == pytest.approx(figures[1][key], rel=1e-6, abs=1e-7), (accum, key)
    # before any update the ratio is 1, so the policy loss is minus the advantages' token mean: 0 once
    # whitened over the mini-batch's tokens (a mean of micro-batch means is not)
    assert abs(figures[1]["policy_loss"]) < 1e-7 and figures[1]["value_loss"] > 0
    for accum in (2, 8):
        worst = max(
            float((grads[accum][n] - grads[1][n]).abs().max() / grads[1][n].abs().max().clamp(min=1e-12))
            for n in grads[1]
        )
        assert worst < 1e-5, (accum, worst)


def test_global_whitening_on_one_rank_equals_the_local_one():
    """With a one-rank reduction the two-pass global whitening is the plain masked whitening."""
    from pipeline.algorithms import rl

    torch.manual_seed(0)
    x, mask = torch.randn(4, 6), (torch.rand(4, 6) > 0.3).long()
    assert torch.allclose(rl.masked_whiten(x, mask, all_reduce=lambda t: t), rl.masked_whiten(x, mask), atol=1e-6)


def test_the_rollout_entropy_is_a_token_mean_over_every_rank():
    """ppo/entropy over two ranks whose responses differ in length is the mean over all their tokens:
    2 tokens of entropy 1 on one rank and 8 of entropy 3 on the other read 2.6 (a mean of the ranks'
    token means, 2.0, weighs the short responses' tokens four times). The two ranks' all-reduce is
    played by hand: rank 1's figures are recorded, then rank 0's reduction adds them."""
    from types import SimpleNamespace

    from pipeline.rl.ppo import step_metrics

    def experience(length: int, entropy: float):
        mask = torch.zeros(2, 4, dtype=torch.long)
        mask[:, :length] = 1
        return SimpleNamespace(
            rollout=SimpleNamespace(response_mask=mask),
            kl=torch.zeros(2, 4),
            raw_scores=torch.zeros(2),
            scores=torch.zeros(2),
            entropy=torch.full((2, 4), entropy) * mask,
        )

    seen = []
    rank1 = SimpleNamespace(
        num_processes=2, device=torch.device("cpu"), reduce=lambda t, reduction: seen.append(t) or t
    )
    step_metrics(experience(4, 3.0), {}, rank1, kl_coef=0.05, gen_frac=0.0)
    rank0 = SimpleNamespace(num_processes=2, device=torch.device("cpu"), reduce=lambda t, reduction: t + seen[0])
    figures = step_metrics(experience(1, 1.0), {}, rank0, kl_coef=0.05, gen_frac=0.0)
    assert figures["ppo/entropy"] == pytest.approx(2.6, rel=1e-12)
    assert figures["ppo/response_length"] == pytest.approx(2.5, rel=1e-12)  # per sequence: (1 + 4) / 2
