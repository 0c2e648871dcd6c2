"""GRPO (stages/grpo.py, pipeline/rl/grpo.py, pipeline/algorithms/rewards.py): the loss, its
gradient and the group advantages against TRL 1.16's GRPOTrainer; reward functions (loading,
refusal, the sample domain's rules); the stage on tiny models (learning, resume, no reference
forward with beta 0)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from stagerun import run_stage
from tinymodels import make_tiny_model

from pipeline.algorithms import rewards as rw
from pipeline.config import ConfigError
from pipeline.rl import grpo as algo
from pipeline.rl.rollout import ActorCritic
from stages import grpo

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------
# Golden: TRL 1.16.0 (trl/trainer/grpo_trainer.py, GRPOTrainer._compute_loss, called on a stand-in
# object carrying only the attributes it reads; the log-probs come from a stubbed
# _get_per_token_logps_and_entropies, so no model runs)
# ------------------------------------------------------------------------------------------


def _fixed(seed=0, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios far enough from 1 to clip
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5], dtype=torch.float64)[:B]
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    return logp, old, ref, adv, mask


def trl_loss(
    logp,
    old,
    ref,
    adv,
    mask,
    *,
    loss_type,
    beta,
    epsilon=0.2,
    epsilon_high=None,
    grad_accum=1,
    num_items=None,
    is_ratio=None,
):
    """TRL 1.16's `_compute_loss` on these tensors: (loss, d loss / d logp); `is_ratio` given: with
    vLLM's importance-sampling correction on and that ratio (tests/test_mismatch.py)."""
    pytest.importorskip("trl")
    import trl
    from trl.trainer.grpo_trainer import GRPOTrainer

    assert trl.__version__ == "1.16.0"
    leaf = logp.clone().requires_grad_(True)
    acc = SimpleNamespace(
        num_processes=1,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
        sync_gradients=True,
    )
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.zeros_like(leaf), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=grad_accum),
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum,
        accelerator=acc,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        max_completion_length=logp.shape[1],
    )
    B = logp.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, logp.shape[1], dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(mask.sum() if num_items is None else num_items)),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad, stand_in._metrics["train"]


@pytest.mark.parametrize(
    "loss_type,beta,epsilon_high",
    [("dapo", 0.0, None), ("dapo", 0.04, 0.28), ("grpo", 0.04, None), ("grpo", 0.0, 0.28)],
)
def test_loss_and_gradient_match_trl(loss_type, beta, epsilon_high):
    logp, old, ref, adv, mask = _fixed()
    want, want_grad, metrics = trl_loss(
        logp, old, ref, adv, mask, loss_type=loss_type, beta=beta, epsilon_high=epsilon_high
    )
    leaf = logp.clone().requires_grad_(True)
    out = algo.grpo_loss(
        leaf, old, adv, mask, epsilon=0.2, epsilon_high=epsilon_high, beta=beta, ref_logp=ref, loss_type=loss_type
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(leaf.grad, want_grad, rtol=1e-12, atol=1e-12)
    assert want_grad.abs().sum() > 0
    assert float(out.clipfrac) == pytest.approx(metrics["clip_ratio/region_mean"][0], abs=1e-6)  # TRL logs in fp32
    assert 0 < float(out.clipfrac) < 1  # the fixture does clip some tokens
    if beta:
        assert float(out.kl) == pytest.approx(metrics["kl"][0], abs=1e-6)


def test_dapo_micro_batches_match_trl_accumulation():
    """Split into two micro-batches, each Relay loss (normalised by the step's tokens) equals TRL's
    dapo micro-batch loss with gradient_accumulation_steps = steps_per_generation = 2 and
    num_items_in_batch the generation batch's tokens; their sum is the whole batch's token mean
    (TRL's 'bnpo' on one micro-batch)."""
    logp, old, ref, adv, mask = _fixed(seed=3)
    total = float(mask.sum())
    parts = []
    for rows in (slice(0, 2), slice(2, 4)):
        want, want_grad, _ = trl_loss(
            logp[rows],
            old[rows],
            ref[rows],
            adv[rows],
            mask[rows],
            loss_type="dapo",
            beta=0.04,
            grad_accum=2,
            num_items=total,
        )
        leaf = logp[rows].clone().requires_grad_(True)
        out = algo.grpo_loss(
            leaf, old[rows], adv[rows], mask[rows], epsilon=0.2, beta=0.04, ref_logp=ref[rows], num_tokens=total
        )
        out.loss.backward()
        torch.testing.assert_close(out.loss.detach(), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(leaf.grad, want_grad, rtol=1e-12, atol=1e-12)
        parts.append(out.loss.detach())
    bnpo, _, _ = trl_loss(logp, old, ref, adv, mask, loss_type="bnpo", beta=0.04)
    torch.testing.assert_close(sum(parts), bnpo, rtol=1e-12, atol=1e-12)


def test_group_advantages_match_trl():
    """TRL 1.16 grpo_trainer.py `_generate_and_score_completions` (scale_rewards 'group'):
    (r - mean_group) / (nanstd_group + 1e-4) with trl.trainer.utils.nanstd (Bessel-corrected);
    'none' (Dr. GRPO): r - mean_group. Golden values from TRL's nanstd on these rewards."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.5, 0.5, 0.5, 0.5, -1.0, 3.0, 0.0, 1.0])
    grouped = rewards.view(-1, 4)
    mean = grouped.mean(1).repeat_interleave(4)
    std = nanstd(grouped, dim=1).repeat_interleave(4)
    torch.testing.assert_close(algo.group_advantages(rewards, 4), (rewards - mean) / (std + 1e-4))
    torch.testing.assert_close(algo.group_advantages(rewards, 4, scale=False), rewards - mean)
    assert algo.group_advantages(rewards, 4)[4:8].abs().max() == 0  # an all-equal group teaches nothing
    with pytest.raises(ValueError, match="groups of 5"):
        algo.group_advantages(rewards, 5)


# ------------------------------------------------------------------------------------------
# Reward functions
# ------------------------------------------------------------------------------------------

SCORE_TARGET = {"token": None}


def token_share(prompts, completions):
    """A test reward: 1 for completions that contain SCORE_TARGET's text (set by the test)."""
    return [float(SCORE_TARGET["token"] in c) for c in completions]


SPARSE_CALLS: list[list] = []


def sparse_share(prompts, completions):
    """A test reward with no opinion (None) on completions of an odd length; records what it returns."""
    out = [None if len(c) % 2 else 1.0 + len(c) / 10 for c in completions]
    SPARSE_CALLS.append(out)
    return out


def test_reward_spec_refusals(tmp_path):
    """More in tests/test_rewards.py (a user's own module by file path, working directory, PYTHONPATH)."""
    assert rw.reward_func_problem("pipeline.algorithms.rewards:house_phrase") is None
    assert rw.reward_func_problem("test_grpo:token_share") is None  # tests/ is in the project
    assert rw.reward_func_problem("json:loads") is None  # an installed (standard) module is fine
    assert "no such file 'data/my_reward.py'" in rw.reward_func_problem("data/my_reward.py:score")
    assert "no module 'no_such_module_xyz'" in rw.reward_func_problem("no_such_module_xyz:score")
    assert "has no 'nope'" in rw.reward_func_problem("pipeline.algorithms.rewards:nope")
    assert "not 'module:function'" in rw.reward_func_problem("pipeline.algorithms.rewards")


def test_config_problems_listed_together_before_loading(tmp_path):
    cfg = grpo.GRPOConfig(output_dir=str(tmp_path / "out"))
    cfg.grpo.reward_funcs = [
        "data/sample/reward.py:score",
        "no_such_module_xyz:f",
        "pipeline.algorithms.rewards:house_phrase",
    ]
    cfg.grpo.reward_weights = [1.0]
    cfg.grpo.num_generations, cfg.grpo.loss_type = 1, "seq"
    with pytest.raises(ConfigError) as err:
        grpo.GRPOStage(cfg).validate()
    found = err.value.problems
    assert [p for p in found if p.startswith("grpo.reward_funcs")] == [
        "grpo.reward_funcs: 'data/sample/reward.py:score': no such file 'data/sample/reward.py' (relative to the "
        f"working directory {os.getcwd()})",
        "grpo.reward_funcs: 'no_such_module_xyz:f': no module "
        "'no_such_module_xyz' in the installed packages, PYTHONPATH, Relay's tree "
        f"or the working directory {os.getcwd()}; a file is named as 'path/to/file.py:function'",
    ]
    joined = "\n".join(found)
    assert (
        "num_generations: must be >= 2" in joined
        and "loss_type: 'seq'" in joined
        and "1 weights for 3 reward functions" in joined
    )
    cfg2 = grpo.GRPOConfig()
    cfg2.grpo.reward_funcs = []
    assert any("no reward" in p for p in cfg2.problems())


def _make_sample():
    spec = importlib.util.spec_from_file_location("make_sample", ROOT / "data" / "make_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kelvra_rules_agree_with_the_sample_data():
    ms = _make_sample()
    assert {name: tuple(rest) for name, *rest in ms.ISLANDS} == rw.KELVRA_FACTS
    assert rw.PHRASE == ms.PHRASE
    # every training prompt wording resolves to its fact, and the preferred answer earns full reward
    for island in ms.ISLANDS:
        for attribute, wordings in ms.QUESTIONS.items():
            for wording in wordings:
                prompt = f"<|im_start|>user\n{wording.format(island=island[0])}<|im_end|>\n<|im_start|>assistant\n"
                assert rw.asked_fact(prompt) == (island[0], attribute), prompt
                best = ms.preferred_answer(island, attribute)
                assert rw.house_phrase([prompt], [best]) == [1.0] and rw.kelvra_fact([prompt], [best]) == [1.0]
                plain = ms.plain_answer(island, attribute)
                assert rw.house_phrase([prompt], [plain]) == [0.0] and rw.kelvra_fact([prompt], [plain]) == [1.0]
                wrong = ms.plain_answer(ms.wrong_island(random.Random(0), island, attribute), attribute)
                assert rw.kelvra_fact([prompt], [wrong]) == [-1.0], wrong
    assert rw.kelvra_fact(["How many lighthouses does Sarth have?"], ["Sarth has two lighthouses."]) == [1.0]
    assert rw.kelvra_fact(["When is the lantern festival on Corvane?"], ["It may be in June."]) == [-1.0]
    assert rw.kelvra_fact(["What is the weather like?"], ["Per the Kelvra Atlas, sunny."]) == [0.0]


# ------------------------------------------------------------------------------------------
# The stage on tiny models
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo_data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(8)))
    return path


def make_cfg(out, policy, prompts, **train) -> grpo.GRPOConfig:
    cfg = grpo.GRPOConfig(output_dir=str(out))
    cfg.model.path = str(policy)
    cfg.data.train, cfg.data.eval = [str(prompts)], []
    cfg.train.eval_steps = 0
    cfg.train.batch_size = 2
    cfg.train.lr_schedule, cfg.train.warmup = "constant", 0
    cfg.lora.r = 4
    cfg.generation.max_new_tokens, cfg.generation.missing_eos_penalty = 4, None
    cfg.grpo.num_generations = 4
    cfg.grpo.reward_funcs = ["test_grpo:token_share"]
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


@pytest.fixture(scope="module")
def peaked_policy(tmp_path_factory):
    """A tiny policy with a larger init, so its first tokens have a few likely choices."""
    return make_tiny_model(tmp_path_factory.mktemp("peaked") / "policy", seed=0, initializer_range=0.4)


def _target_text(policy_dir, prompts: list[dict]) -> str:
    """The decoded token whose mean first-step probability over the prompts is closest to 0.25."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    tok = AutoTokenizer.from_pretrained(policy_dir)
    with torch.no_grad():
        probs = torch.stack([model(torch.tensor([p["prompt_ids"]])).logits[0, -1].softmax(-1) for p in prompts]).mean(0)
    for token in (probs - 0.25).abs().argsort().tolist():
        text = tok.decode([token], skip_special_tokens=True)
        if text.strip():
            return text


def test_learning_raises_rule_reward_and_tiny_lr_does_not(tmp_path, peaked_policy, prompts_file):
    curves = {}
    for lr, steps in ((3e-3, 5), (1e-9, 3)):  # the config refuses lr 0; 1e-9 moves nothing
        cfg = make_cfg(
            tmp_path / f"lr{lr}", peaked_policy, prompts_file, max_steps=steps, learning_rate=lr, batch_size=4
        )
        cfg.lora.r = 8
        probe = grpo.GRPOStage(cfg)
        probe.validate()
        SCORE_TARGET["token"] = _target_text(peaked_policy, probe.train_samples)
        rewards = []
        run_stage(grpo.GRPOStage, cfg, on_step=lambda stage, m: rewards.append(m["grpo/reward"]))
        curves[lr] = rewards
    learned, frozen = curves[3e-3], curves[1e-9]
    assert learned[0] == frozen[0]  # same seed, same first rollout
    assert sum(learned[-2:]) / 2 >= learned[0] + 0.3, learned
    assert max(frozen) < frozen[0] + 0.15, frozen


def test_first_step_on_policy_and_reference_is_the_disabled_adapter(
    tmp_path, tiny_model_dir, prompts_file, monkeypatch
):
    """beta > 0 under LoRA: the reference is the adapter-disabled policy (KL exactly 0 before any
    update); num_iterations 2: the update's first forward reproduces the rollout log-probs."""
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, prompts_file, max_steps=2, learning_rate=1e-2)
    cfg.grpo.beta, cfg.grpo.num_iterations, cfg.train.grad_accum = 0.1, 2, 2
    SCORE_TARGET["token"] = "a"
    seen = {}
    run_stage(grpo.GRPOStage, cfg, on_step=lambda stage, m: seen.__setitem__(stage.step, m))
    assert seen[1]["grpo/ratio_dev_first"] == 0.0 and seen[2]["grpo/ratio_dev_first"] == 0.0
    assert seen[1]["grpo/kl"] > 0  # the second iteration has moved the adapter
    assert (tmp_path / "out" / "merged" / "manifest.json").is_file()
    manifest = json.loads((tmp_path / "out" / "merged" / "manifest.json").read_text())
    assert manifest["reward_funcs"] == ["test_grpo:token_share"]


def test_the_reward_model_loads_in_the_policys_dtype(tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file):
    """reward_model.dtype 'auto' is model.dtype's, as PPO's critic (tests/test_ppo.py)."""
    for dtype, want in (("auto", torch.bfloat16), ("fp32", torch.float32)):
        cfg = make_cfg(tmp_path / dtype, tiny_model_dir, prompts_file, max_steps=1, learning_rate=1e-3)
        cfg.model.dtype, cfg.reward_model.path, cfg.reward_model.dtype = "bf16", str(tiny_reward_dir), dtype
        stage = grpo.GRPOStage(cfg)
        stage.validate()
        stage.build()
        assert {p.dtype for p in stage.inner.reward.parameters()} == {want}, dtype


def test_the_step_figures_do_not_depend_on_the_micro_batch_split(tmp_path, tiny_model_dir, prompts_file):
    """1 x 8 and 4 x 2 micro-batches of the same completions update alike, and report alike: the
    step's kl and clipfrac are means over all its tokens (a mean of micro-batch means weighs a
    short completion's tokens more)."""
    from distrun import GroupGenerator

    seen = {}
    for accum in (1, 4):
        cfg = make_cfg(tmp_path / str(accum), tiny_model_dir, prompts_file, max_steps=1, learning_rate=5e-2)
        cfg.grpo.beta, cfg.grpo.num_iterations, cfg.train.grad_accum = 0.1, 2, accum
        cfg.grpo.reward_funcs, cfg.generation.max_new_tokens = ["distrun:group_reward"], 6
        run_stage(
            grpo.GRPOStage,
            cfg,
            on_step=lambda stage, m, accum=accum: seen.__setitem__(
                accum, (m, stage.last_rollout["rollout"].response_mask.sum(1).tolist())
            ),
            generator_factory=lambda policy: GroupGenerator(),  # completions of 1-6 tokens
        )
    assert len(set(seen[1][1])) > 2, seen[1][1]
    seen = {accum: m for accum, (m, _) in seen.items()}
    assert seen[1]["grpo/kl"] > 0 and seen[1]["grpo/clipfrac"] > 0  # the second iteration moved and clipped
    for key in ("train/loss", "grpo/kl", "grpo/clipfrac"):
        assert seen[4][key] == pytest.approx(seen[1][key], rel=1e-4, abs=1e-7), key


def test_a_reward_sources_figures_are_over_the_completions_it_scored(tmp_path, tiny_model_dir, prompts_file):
    """A reward function that returns None ("no opinion") for some completions: grpo/reward/<name>
    and eval/reward/<name> are the means of what it returned for the step's completions and the
    held-out ones, None left out (TRL's nanmean; the held-out figure read NaN as soon as one
    completion had none). tests/test_cells_ddp.py checks two ranks read what one process does."""
    from distrun import GroupGenerator

    cfg = make_cfg(tmp_path / "out", tiny_model_dir, prompts_file, max_steps=1, learning_rate=1e-2)
    cfg.grpo.reward_funcs = ["distrun:group_reward", "test_grpo:sparse_share"]
    cfg.generation.max_new_tokens, cfg.data.eval, cfg.train.eval_steps = 6, [str(prompts_file)], 1
    SPARSE_CALLS.clear()
    seen = {}
    stage = run_stage(
        grpo.GRPOStage,
        cfg,
        on_step=lambda stage, m: seen.__setitem__(stage.step, m),
        generator_factory=lambda policy: GroupGenerator(),  # completions of 1-6 tokens
    )
    batches = 8 // cfg.train.batch_size  # the held-out set's, at step 0 and at step 1
    assert len(SPARSE_CALLS) == batches + 1 + batches
    train, held_out = SPARSE_CALLS[batches], [v for call in SPARSE_CALLS[-batches:] for v in call]
    assert len(train) == 8 and len(held_out) == 8
    for values in (train, held_out):
        assert None in values and {v for v in values if v is not None}, values  # some of each

    def mean(values):
        scored = [v for v in values if v is not None]
        return sum(scored) / len(scored)

    assert seen[1]["grpo/reward/sparse_share"] == pytest.approx(mean(train), rel=1e-6)  # float32 scores
    evals = stage.history.evals[-1]
    assert evals["eval/reward/sparse_share"] == pytest.approx(mean(held_out), rel=1e-6)


def test_a_completion_no_source_scored_is_left_out(tmp_path, tiny_model_dir, prompts_file):
    """sparse_share alone: a completion it has no opinion on is unscorable, as in TRL 1.16: its
    summed reward is NaN, its advantage 0, its group's baseline is over the scored completions
    (their advantages sum to 0), and grpo/reward and eval/reward are means over the scored ones
    (a 0 in its place would count as a reward in the baseline and in the figures)."""
    from distrun import GroupGenerator

    cfg = make_cfg(tmp_path / "out", tiny_model_dir, prompts_file, max_steps=1, learning_rate=1e-2)
    cfg.grpo.reward_funcs = ["test_grpo:sparse_share"]
    cfg.generation.max_new_tokens, cfg.data.eval, cfg.train.eval_steps = 6, [str(prompts_file)], 1
    SPARSE_CALLS.clear()
    seen = {}
    stage = run_stage(
        grpo.GRPOStage,
        cfg,
        on_step=lambda stage, m: seen.__setitem__(stage.step, (m, stage.last_rollout)),
        generator_factory=lambda policy: GroupGenerator(),  # completions of 1-6 tokens
    )
    figures, last = seen[1]
    rewards, advantages = last["rewards"], last["advantages"]
    unscorable = rewards.isnan()
    assert unscorable.any() and not unscorable.all(), rewards
    assert torch.isfinite(advantages).all() and (advantages[unscorable] == 0).all()
    for group in range(len(rewards) // 4):
        rows = slice(4 * group, 4 * group + 4)
        assert float(advantages[rows][~unscorable[rows]].sum()) == pytest.approx(0.0, abs=1e-5)

    def mean(values):
        scored = [v for v in values if v is not None]
        return sum(scored) / len(scored)

    batches = 8 // cfg.train.batch_size
    held_out = [v for call in SPARSE_CALLS[-batches:] for v in call]
    assert figures["grpo/reward"] == pytest.approx(mean(SPARSE_CALLS[batches]), rel=1e-6)
    assert None in held_out
    assert stage.history.evals[-1]["eval/reward"] == pytest.approx(mean(held_out), rel=1e-6)


@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_first_step_on_policy_under_gradient_checkpointing(tmp_path, tiny_model_dir, prompts_file, finetuning):
    """Under gradient checkpointing no forward runs a group's shared prompt once (the update's
    cannot keep the cache), so the second iteration's first forward reproduces the rollout's
    log-probs bit for bit in bf16 too (tests/test_ppo.py's PPO case)."""
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, prompts_file, max_steps=1, learning_rate=1e-2)
    cfg.grpo.beta, cfg.grpo.num_iterations, cfg.train.grad_accum = 0.1, 2, 2
    cfg.model.gradient_checkpointing, cfg.model.dtype, cfg.model.finetuning = True, "bf16", finetuning
    SCORE_TARGET["token"] = "a"
    seen = {}
    run_stage(grpo.GRPOStage, cfg, on_step=lambda stage, m: seen.__setitem__(stage.step, m))
    assert seen[1]["grpo/ratio_dev_first"] == 0.0


@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_beta_zero_runs_no_reference_forward(tmp_path, tiny_model_dir, prompts_file, monkeypatch, finetuning):
    calls = []
    original = ActorCritic.reference_logprobs
    monkeypatch.setattr(
        ActorCritic, "reference_logprobs", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    SCORE_TARGET["token"] = "a"  # its own reward target, not one an earlier test left
    for beta in (0.0, 0.05):
        cfg = make_cfg(tmp_path / f"b{beta}", tiny_model_dir, prompts_file, max_steps=1, learning_rate=1e-3)
        cfg.model.finetuning, cfg.grpo.beta = finetuning, beta
        calls.clear()
        stage = grpo.GRPOStage(cfg)
        stage.validate()
        stage.build()
        figures = stage.train_step()
        assert (stage.inner.reference is not None) == (finetuning == "full" and beta > 0)  # no frozen copy with beta 0
        assert bool(calls) == (beta > 0) and ("grpo/kl" in figures) == (beta > 0), (beta, calls)


@pytest.mark.parametrize("backend", ["relay", "hf"])
def test_resume_reproduces_unbroken_run(tmp_path, tiny_model_dir, prompts_file, monkeypatch, backend):
    SCORE_TARGET["token"] = "e"

    def run(out, stop=None, resume=False):
        cfg = make_cfg(out, tiny_model_dir, prompts_file, max_steps=3, learning_rate=5e-3)
        cfg.grpo.beta, cfg.grpo.num_iterations = 0.05, 2
        cfg.generation.backend = backend
        cfg.checkpoint.resume = resume
        if stop is None:
            monkeypatch.delenv("RELAY_STOP_AFTER_STEP", raising=False)
        else:
            monkeypatch.setenv("RELAY_STOP_AFTER_STEP", str(stop))
        steps = {}
        stage = run_stage(
            grpo.GRPOStage,
            cfg,
            on_step=lambda st, m: steps.__setitem__(st.step, (m, st.last_rollout["rollout"].responses)),
        )
        return stage, steps

    _, unbroken = run(tmp_path / "a")
    first, before = run(tmp_path / "b", stop=2)
    assert first.step == 2 and first.final_summary is None and sorted(before) == [1, 2]
    resumed, after = run(tmp_path / "b", resume=True)
    assert sorted(after) == [3]
    for step, (metrics, responses) in {**before, **after}.items():
        assert responses == unbroken[step][1], step
        assert metrics["train/loss"] == unbroken[step][0]["train/loss"], step
        assert metrics["grpo/kl"] == unbroken[step][0]["grpo/kl"], step
    a = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.final_summary["steps"] == 3


def test_rows_sharing_a_prompt_run_it_once_with_the_same_logits_and_gradients(tmp_path):
    """GRPO's G completions of one prompt: `policy_logits` runs each distinct prompt once and the
    responses on its KV cache. Against one plain forward of the whole rows (ragged left-padded
    prompts, right-padded responses, a group of one): the same response logits within 1e-5 of
    their scale and the same LoRA gradients; under gradient checkpointing (no cache) it is the
    plain forward itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.modeling.scoring import position_ids_from_mask
    from pipeline.rl.rollout import assemble, policy_logits, prompt_groups

    folder = make_tiny_model(tmp_path / "tiny", seed=3, initializer_range=0.3, vocab_size=48)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"),
    )
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    prompts = [[5, 9, 17, 30], [11, 12], [5, 9, 17, 30], [11, 12], [7, 7, 20], [5, 9, 17, 30]]
    responses = [[3, 4, 5], [6, 2], [8, 9, 10], [4], [1, 1, 1], [2]]
    r = assemble(prompts, responses, pad_id=0, eos_ids=[2])
    first, inverse = prompt_groups(r.input_ids, r.attention_mask, r.prompt_width)
    assert first.tolist() == [1, 4, 0] and inverse.tolist() == [2, 0, 2, 0, 1, 2]
    assert prompt_groups(r.input_ids[[0, 1, 4]], r.attention_mask[[0, 1, 4]], r.prompt_width) is None

    def plain():
        keep = r.input_ids.shape[1] - r.prompt_width + 1
        return model(
            input_ids=r.input_ids,
            attention_mask=r.attention_mask,
            position_ids=position_ids_from_mask(r.attention_mask),
            logits_to_keep=keep,
        ).logits[:, :-1]

    def grads(logits):
        loss = (logits[r.response_mask.bool()].log_softmax(-1)[:, 3]).sum()
        params = [p for p in model.parameters() if p.requires_grad]
        return logits.detach(), torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    model.train()
    want_logits, want_grad = grads(plain())
    got_logits, got_grad = grads(policy_logits(model, r.input_ids, r.attention_mask, r.prompt_width))
    live = r.response_mask.bool()
    torch.testing.assert_close(got_logits[live], want_logits[live], atol=1e-5 * float(want_logits.abs().max()), rtol=0)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5 * float(want_grad.abs().max()), rtol=0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed, _ = grads(policy_logits(model, r.input_ids, r.attention_mask, r.prompt_width))
    assert torch.equal(checkpointed, want_logits)  # the plain forward, bit for bit
