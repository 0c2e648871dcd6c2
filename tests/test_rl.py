"""PPO math (pipeline/algorithms/rl.py) against values computed by hand (shown in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.algorithms import rl


def test_logprobs_and_entropy_match_direct_formulas():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    tokens = torch.tensor([[0, 4, 2], [1, 1, 3]])
    probs = logits.softmax(-1)
    expected = torch.log(probs.gather(2, tokens.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(rl.logprobs_from_logits(logits, tokens), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(rl.entropy_from_logits(logits), -(probs * probs.log()).sum(-1), rtol=0, atol=1e-6)
    uniform = torch.zeros(1, 1, 8)
    assert rl.entropy_from_logits(uniform).item() == pytest.approx(math.log(8), abs=1e-6)


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # k1 = log(0.5 / 0.25) = ln 2; k3 = (0.25/0.5 - 1) - log(0.25/0.5) = -0.5 + ln 2
    assert rl.kl_per_token(logp, ref, "k1").item() == pytest.approx(math.log(2), abs=1e-7)
    assert rl.kl_per_token(logp, ref, "k3").item() == pytest.approx(-0.5 + math.log(2), abs=1e-7)
    same = torch.tensor([-1.3, -0.2])
    assert torch.equal(rl.kl_per_token(same, same, "k1"), torch.zeros(2))
    assert torch.equal(rl.kl_per_token(same, same, "k3"), torch.zeros(2))
    with pytest.raises(ValueError, match="k2"):
        rl.kl_per_token(same, same, "k2")


def test_kl_estimators_are_unbiased_in_exact_expectation():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.4, 0.1], dtype=torch.float64)
    true_kl = (p * (p / q).log()).sum()
    for estimator in rl.KL_ESTIMATORS:
        expectation = (p * rl.kl_per_token(p.log(), q.log(), estimator)).sum()
        assert expectation.item() == pytest.approx(true_kl.item(), abs=1e-12)
    assert (rl.kl_per_token(p.log(), q.log(), "k3") >= 0).all()


def test_adaptive_kl_controller_updates():
    ctl = rl.AdaptiveKLController(0.2, target=6.0, horizon=10000)
    # error clipped to +0.2: 0.2 * (1 + 0.2 * 256 / 10000)
    assert ctl.update(9.0, 256) == pytest.approx(0.2 * 1.00512, abs=1e-12)
    ctl = rl.AdaptiveKLController(0.2, target=6.0, horizon=10000)
    assert ctl.update(3.0, 256) == pytest.approx(0.2 * 0.99488, abs=1e-12)  # clipped to -0.2
    ctl = rl.AdaptiveKLController(0.2, target=6.0, horizon=10000)
    assert ctl.update(6.6, 256) == pytest.approx(0.2 * 1.00256, abs=1e-12)  # error 0.1
    restored = rl.AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.update(6.6, 256) == ctl.update(6.6, 256)
    fixed = rl.make_kl_controller(0.05, None, 10000)
    assert fixed.update(100.0, 256) == 0.05
    with pytest.raises(ValueError, match="target"):
        rl.AdaptiveKLController(0.1, target=0.0, horizon=1)


def test_gae_hand_example_with_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    values = torch.tensor([[0.5, 0.4, 0.3], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = rl.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: A2 = 1 - 0.3 = 0.7; A1 = (0.9*0.3 - 0.4) + 0.72*0.7 = 0.374; A0 = (0.36 - 0.5) + 0.72*0.374
    # row 1 ends at t=1 (the 5.0 and 9.0 are padding): A1 = 2 - 1 = 1; A0 = (0.9 - 1) + 0.72 = 0.62
    expected_adv = torch.tensor([[0.12928, 0.374, 0.7], [0.62, 1.0, 0.0]])
    torch.testing.assert_close(adv, expected_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[0.62928, 0.774, 1.0], [1.62, 2.0, 0.0]]), rtol=0, atol=1e-6)


def test_token_rewards_put_score_on_last_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = rl.token_rewards(torch.tensor([2.0, -1.0]), kl, mask, kl_coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, 1.85], [-1.25, 0.0, 0.0]]), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="empty"):
        rl.token_rewards(torch.zeros(1), kl[:1], torch.zeros(1, 3), 0.1)


def test_last_index_finds_the_last_trained_token_of_a_gapped_mask():
    """A tool rollout's mask has gaps (inserted tool results are 0): the last trained token is the
    last 1, not the count of ones minus one."""
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0], [0, 1, 0, 1, 0, 0, 0]])
    assert rl.last_index(mask).tolist() == [6, 2, 3]
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        rl.last_index(torch.tensor([[1, 0], [0, 0]]))


def test_ppo_with_tools_advantages_carry_the_reward_model_score():
    """With KL 0 the only signal is the sequence score: it must land on the last sampled token and
    reach every sampled token's advantage through GAE over turns (gamma = lam = 1: each sampled
    token's advantage is score - V_t), never an inserted one."""
    from pipeline.algorithms.rl import gae_over_turns

    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1]])
    rewards = rl.token_rewards(torch.tensor([3.0]), torch.zeros(1, 7), mask, kl_coef=0.1)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]]
    values = torch.tensor([[0.5, 0.25, 9.0, 9.0, 9.0, 1.0, 2.0]])
    adv, ret = gae_over_turns(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[2.5, 2.75, 0.0, 0.0, 0.0, 2.0, 1.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[3.0, 3.0, 0.0, 0.0, 0.0, 3.0, 3.0]]), rtol=0, atol=1e-6)


def test_policy_loss_hand_values():
    # ratios 1, 1.5, 0.5 (and a masked token whose huge value must not count)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5, 100.0]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = rl.policy_loss(logp, old, adv, mask, clip=0.2)
    # per token max(-A r, -A clip(r)): -1, max(-1.5, -1.2) = -1.2, max(0.5, 0.8) = 0.8
    assert out.loss.item() == pytest.approx((-1.0 - 1.2 + 0.8) / 3, abs=1e-6)
    assert out.clipfrac.item() == pytest.approx(2 / 3, abs=1e-6)
    # k3 of KL(old || new): (r - 1) - log r
    approx = (0.0 + (0.5 - math.log(1.5)) + (-0.5 + math.log(2))) / 3
    assert out.approx_kl.item() == pytest.approx(approx, abs=1e-6)


def test_policy_loss_gradient_only_through_unclipped_tokens():
    logp = torch.log(torch.tensor([[1.0, 1.5]])).requires_grad_(True)
    out = rl.policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), clip=0.2)
    out.loss.backward()
    # d/dlogp of -A r / n = -r / 2 for the unclipped token; 0 for the clipped one
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.0]]), rtol=0, atol=1e-7)


def test_value_loss_hand_values():
    values = torch.tensor([[0.2, 2.0, 3.0]])
    old = torch.zeros(1, 3)
    returns = torch.tensor([[0.3, 1.5, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, clipfrac = rl.value_loss(values, old, returns, mask, clip=0.5)
    # token 0: both (0.1)^2; token 1: V clipped to 0.5 -> max(0.25, 1.0) = 1.0
    assert loss.item() == pytest.approx(0.5 * (0.01 + 1.0) / 2, abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.5, abs=1e-7)


def test_masked_whiten_and_mean():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert rl.masked_mean(x, mask).item() == pytest.approx(2.0)
    assert rl.masked_var(x, mask).item() == pytest.approx(1.0)
    w = rl.masked_whiten(x, mask)
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="no element"):
        rl.masked_mean(x, torch.zeros_like(mask))


def test_running_moments_equal_whole_data_statistics_and_resume():
    torch.manual_seed(0)
    a, b = torch.randn(7) * 3 + 1, torch.randn(5) - 2
    rm = rl.RunningMoments()
    rm.update(a)
    copy = rl.RunningMoments()
    copy.load_state_dict(rm.state_dict())
    rm.update(b)
    copy.update(b)
    both = torch.cat([a, b]).double()
    assert rm.mean == pytest.approx(both.mean().item(), abs=1e-12)
    assert rm.std == pytest.approx(both.std(unbiased=False).item(), abs=1e-12)
    assert rm.count == 12 and copy.state_dict() == rm.state_dict()
    out = rm.normalise(torch.tensor([rm.mean + 10 * rm.std]), clip=3.0)
    assert out.item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="empty"):
        rm.update(torch.tensor([]))


def test_running_moments_use_the_population_variance():
    """[1, 2, 3, 4] then [10]: mean 4, squared deviations 9+4+1+0+36 = 50 over N = 5, so var = 10
    and std = sqrt(10) = 3.16228 (Bessel's 50 / 4 = 12.5 would give 3.53553)."""
    rm = rl.RunningMoments()
    rm.update(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert (rm.mean, rm.var) == pytest.approx((2.5, 1.25), abs=1e-12)  # 5 / 4, not 5 / 3
    rm.update(torch.tensor([10.0]))
    assert (rm.mean, rm.var, rm.count) == pytest.approx((4.0, 10.0, 5.0), abs=1e-12)
    assert rm.std == pytest.approx(math.sqrt(10.0), abs=1e-12)
    assert rm.normalise(torch.tensor([10.0])).item() == pytest.approx(6 / math.sqrt(10.0), abs=1e-6)
    # The RM stage stores std(unbiased=False) of its n scores; starting from it continues exactly.
    stored = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)  # reward_stats works in float64
    resumed = rl.RunningMoments(stored.mean().item(), stored.std(unbiased=False).item(), stored.numel())
    resumed.update(torch.tensor([10.0]))
    assert (resumed.mean, resumed.var) == pytest.approx((4.0, 10.0), abs=1e-12)


def _trl_running_moments():
    import importlib

    for module in ("trl.trainer.utils", "trl.experimental.bco.bco_trainer"):
        try:
            return importlib.import_module(module).RunningMoments
        except (ImportError, AttributeError):
            continue
    return None


def test_running_moments_against_trl_when_installed():
    """TRL's RunningMoments (trl <= 0.11 trl/trainer/utils.py; later trl/experimental/bco) keeps the same
    population `var` but its `std` is Bessel-corrected: sqrt(var * N / (N - 1)) = sqrt(12.5) here. Read from
    huggingface/trl v0.11.4 (1f8ba929fbb6962249386f7dce20155da8a26cda) trl/trainer/utils.py RunningMoments.update;
    on this data it gives mean 4.0, var 10.0, std 3.5355339. trl 1.x no longer ships it, hence the skip."""
    trl_cls = _trl_running_moments()
    if trl_cls is None:
        pytest.skip("the installed trl has no RunningMoments (removed from trl 1.x's stable API)")
    from types import SimpleNamespace

    theirs = trl_cls(SimpleNamespace(use_distributed=False))
    ours = rl.RunningMoments()
    for batch in ([1.0, 2.0, 3.0, 4.0], [10.0]):
        theirs.update(torch.tensor(batch)), ours.update(torch.tensor(batch))
    assert theirs.mean == pytest.approx(ours.mean, abs=1e-5) and theirs.var == pytest.approx(ours.var, abs=1e-5)
    assert theirs.std == pytest.approx(math.sqrt(12.5), abs=1e-5) and ours.std == pytest.approx(math.sqrt(10.0))


def test_reference_logprobs_divide_by_the_temperature_in_fp32():
    """A bf16 reference that is the policy itself gives exactly the policy's fp32 log-probs at any
    temperature (the division done in bf16 put a KL of up to ~0.06 between identical models)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.rl.rollout import ActorCritic, policy_logits

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logits of a few units, where bf16's rounding of x / 0.7 shows
    ids = torch.randint(0, 96, (2, 12))
    mask = torch.ones_like(ids)
    pair = ActorCritic(model, model, reference=model)
    with torch.no_grad():
        own = rl.logprobs_from_logits(policy_logits(model, ids, mask, 4).float() / 0.7, ids[:, 4:])
    assert torch.equal(pair.reference_logprobs(ids, mask, 4, 0.7), own)
