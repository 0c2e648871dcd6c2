"""PPO stage (stages/ppo.py, pipeline/rl/rollout.py) on tiny models: the first step is exactly
on-policy, frozen weights stay frozen, learning works (and does not with LR 0), resume reproduces
an unbroken run."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from stagerun import run_stage
from tinymodels import make_tiny_model

from pipeline.config import ConfigError
from pipeline.modeling.handoff import reward_pairing_problems
from pipeline.rl.ppo import actor_critic_backward, make_experience
from pipeline.rl.rollout import assemble, cut_at_eos
from stages import ppo

EOS = 2
PAD = 0


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppo_data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(8)))
    return path


def make_cfg(out, policy, reward, prompts, **train) -> ppo.PPOConfig:
    cfg = ppo.PPOConfig(output_dir=str(out))
    cfg.model.path, cfg.reward_model.path = str(policy), str(reward)
    cfg.data.train, cfg.data.eval = [str(prompts)], []
    cfg.train.eval_steps = 0
    cfg.train.batch_size = 4
    cfg.train.lr_schedule, cfg.train.warmup = "constant", 0
    cfg.lora.r = 4
    cfg.generation.max_new_tokens = 6
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def built(cfg) -> ppo.PPOStage:
    """A PPO stage validated and built (models, optimizer), ready for train_step."""
    stage = ppo.PPOStage(cfg)
    stage.validate()
    stage.build()
    return stage


def test_cut_at_eos_and_assemble_layout():
    assert cut_at_eos([5, 6, EOS, PAD, PAD], [EOS]) == ([5, 6, EOS], True)
    assert cut_at_eos([5, 6, 7], [EOS]) == ([5, 6, 7], False)
    # a pad id sampled as content before EOS stays content; everything after EOS is dropped
    rollout = assemble([[10, 11, 12], [13]], [[PAD, 7, EOS, 9], [8, 8, 8, 8]], PAD, [EOS])
    assert rollout.prompt_width == 3
    assert rollout.input_ids.tolist() == [[10, 11, 12, PAD, 7, EOS, PAD], [PAD, PAD, 13, 8, 8, 8, 8]]
    assert rollout.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert rollout.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert rollout.finished.tolist() == [True, False]


def test_tokenizer_mismatch_is_refused(tmp_path, tiny_model_dir, tiny_reward_dir):
    other = tmp_path / "rm"
    shutil.copytree(tiny_reward_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    assert reward_pairing_problems(str(tiny_model_dir), str(tiny_reward_dir)) == []  # same tokenizer: fine
    (problem,) = reward_pairing_problems(str(tiny_model_dir), str(other))
    n = config["vocab_size"]
    assert re.search(f"vocab size: policy .* has {n}, reward model .* has {n + 8}", problem)
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, other, tmp_path / "none.jsonl")
    with pytest.raises(ConfigError, match="do not share a tokenizer"):  # refused before anything loads
        ppo.PPOStage(cfg).validate()
    cfg.reward_model.path = str(tmp_path / "missing")
    with pytest.raises(ConfigError) as err:  # one line naming the path, not a tokenizer mismatch
        ppo.PPOStage(cfg).validate()
    rm_lines = [p for p in err.value.problems if p.startswith("reward_model.path")]
    assert rm_lines == [
        f"reward_model.path: {cfg.reward_model.path!r} is not a model folder (give the RM stage's merged/)"
    ]


def test_config_problems_reported_together():
    cfg = ppo.PPOConfig()
    cfg.train.batch_size, cfg.ppo.mini_batch_size = 4, 3
    cfg.ppo.kl_estimator, cfg.ppo.reward_norm = "k9", "median"
    found = "\n".join(cfg.problems())
    assert "mini_batch_size: 3 does not divide train.batch_size 4" in found
    assert "kl_estimator" in found and "reward_norm" in found


@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_the_critic_and_reward_model_load_in_the_policys_dtype(
    tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file, finetuning
):
    """reward_model.dtype 'auto' is model.dtype's: a policy set to one dtype trains beside a critic
    (and scores with a reward model) of the same dtype. On a GPU 'auto' alone is bf16, so a policy
    set to fp32 got a bf16 critic, whose rounding parted FSDP PPO from one process (bench/RESULTS.md);
    here bf16 stands for the dtype that 'auto' would not give. An explicit reward_model.dtype holds."""
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=1)
    cfg.model.finetuning, cfg.model.dtype = finetuning, "bf16"
    stage = built(cfg)
    models = [stage.inner.policy, stage.inner.critic] + ([stage.inner.reward] if finetuning == "full" else [])
    assert [base_dtypes(m) for m in models] == [{torch.bfloat16}] * len(models)
    cfg = make_cfg(tmp_path / "out2", tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=1)
    cfg.model.finetuning, cfg.model.dtype, cfg.reward_model.dtype = finetuning, "bf16", "fp32"
    assert base_dtypes(built(cfg).inner.critic) == {torch.float32}


def base_dtypes(model: torch.nn.Module) -> set:
    """The dtypes of a model's own weights (not its LoRA adapter's, which peft keeps in fp32)."""
    return {p.dtype for n, p in model.named_parameters() if "lora_" not in n}


def test_first_step_is_exactly_on_policy(tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file):
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=2, learning_rate=1e-2)
    cfg.ppo.mini_batch_size, cfg.train.grad_accum = 2, 2
    seen = {}
    run_stage(
        ppo.PPOStage, cfg, on_step=lambda stage, metrics: seen.__setitem__(stage.step, (metrics, stage.last_experience))
    )
    metrics, exp = seen[1]
    # before any update the adapter is zero: policy == reference bit for bit, so KL is exactly 0
    assert torch.equal(exp.old_logprobs, exp.ref_logprobs)
    assert torch.equal(exp.kl, torch.zeros_like(exp.kl)) and metrics["ppo/kl"] == 0.0
    # and the update's first forward reproduces the rollout log-probs: ratio exactly 1
    assert metrics["ppo/ratio_dev_first"] == 0.0
    metrics2, exp2 = seen[2]
    assert metrics2["ppo/ratio_dev_first"] == 0.0
    assert exp2.kl.abs().sum() > 0  # negative control: after updates the policy has moved
    assert (tmp_path / "out" / "merged" / "manifest.json").is_file()


@pytest.mark.parametrize("finetuning", ["lora", "full"])
@pytest.mark.parametrize("micro", [4, 2], ids=["held", "rerun"])
def test_first_step_is_exactly_on_policy_under_gradient_checkpointing(
    tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file, finetuning, micro
):
    """Under gradient checkpointing the update's forward cannot keep a KV cache, so no forward
    runs the rows' shared opening once: the scoring pass computes what the update will (ratio 1
    when the first micro-batch is re-run: 'rerun', as under DDP) and the reference what the policy
    did (KL 0 when the policy's scoring forward is held for the update: 'held'). In bf16, where
    the opening's other summation order shows most: before, 'rerun' read a first ratio and 'held'
    a first KL that were bf16's rounding off (bench/RESULTS.md)."""
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=1, learning_rate=1e-2)
    cfg.ppo.mini_batch_size, cfg.train.grad_accum = 4, 4 // micro
    cfg.model.gradient_checkpointing, cfg.model.dtype, cfg.model.finetuning = True, "bf16", finetuning
    seen = {}
    run_stage(ppo.PPOStage, cfg, on_step=lambda stage, m: seen.__setitem__(stage.step, (m, stage.last_experience)))
    metrics, exp = seen[1]
    assert metrics["ppo/ratio_dev_first"] == 0.0
    assert torch.equal(exp.old_logprobs, exp.ref_logprobs) and metrics["ppo/kl"] == 0.0


def test_the_update_reuses_the_scoring_forward_and_trains_as_without(
    tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file, monkeypatch
):
    """One micro-batch per update (mini-batch = batch, grad_accum 1): the scoring pass's policy
    forward is held for the update's first micro-batch (one forward fewer a step), both on oneDNN's
    linear kernel. The run is still exactly on-policy at its first step and trains the very same
    weights, bit for bit, as with every forward run afresh; the held graph is released once used."""
    from pipeline.modeling import onednn
    from pipeline.rl import ppo as algo

    # the kernel is asserted below, whether or not this CPU's measured choices (pipeline/modeling/cpu_kernels.py)
    # would take it: oneDNN linears for training, prepacked ones (the counted calls) for sampling
    monkeypatch.setenv("RELAY_CPU_ONEDNN", "1")
    monkeypatch.setenv("RELAY_DECODE_PACKED", "1")
    kernel_calls = []
    real_linear = onednn.onednn_linear
    monkeypatch.setattr(onednn, "onednn_linear", lambda *a: kernel_calls.append(1) or real_linear(*a))

    def train(out, hold: bool):
        cfg = make_cfg(out, tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=2, learning_rate=1e-2)
        cfg.ppo.epochs = 2
        held = []
        real = algo.holds_first_forward
        monkeypatch.setattr(algo, "holds_first_forward", lambda *a: held.append(real(*a)) or (hold and real(*a)))
        seen = {}
        stage = run_stage(ppo.PPOStage, cfg, on_step=lambda st, m: seen.__setitem__(st.step, (m, st.last_experience)))
        assert held == [True, True]  # the configuration qualifies at both steps
        return stage, seen

    _, seen = train(tmp_path / "held", hold=True)
    assert kernel_calls  # scoring and the update ran on oneDNN's kernel (a CPU in fp32)
    train(tmp_path / "fresh", hold=False)
    metrics, exp = seen[1]
    assert exp.held_logits is None  # used, released
    assert metrics["ppo/ratio_dev_first"] == 0.0 and metrics["ppo/kl"] == 0.0
    from safetensors.torch import load_file

    got, want = (load_file(out / "merged" / "model.safetensors") for out in (tmp_path / "held", tmp_path / "fresh"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_reference_and_reward_weights_unchanged(tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file, finetuning):
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=2, learning_rate=1e-2)
    cfg.model.finetuning = finetuning
    s = built(cfg)
    if finetuning == "full":
        frozen = {f"ref.{n}": p for n, p in s.inner.reference.named_parameters()}
        frozen.update({f"rm.{n}": p for n, p in s.inner.reward.named_parameters()})
    else:
        frozen = {n: p for n, p in s.inner.named_parameters() if not p.requires_grad}
        assert any("score.original_module" in n for n in frozen)  # the RM head is among them
    before = {n: p.detach().clone() for n, p in frozen.items()}
    trained_before = {n: p.detach().clone() for n, p in s.inner.named_parameters() if p.requires_grad}
    probe = assemble([s.train_samples[0]["prompt_ids"]], [[11, 12, 13, EOS]], PAD, [EOS])
    ref_before = s.inner.reference_logprobs(probe.input_ids, probe.attention_mask, probe.prompt_width, 1.0)
    rm_before = s.inner.reward_scores(probe.input_ids, probe.attention_mask, probe.prompt_width)
    for _ in range(2):
        s.train_step()
    assert all(torch.equal(before[n], p) for n, p in frozen.items())
    changed = [n for n, p in s.inner.named_parameters() if p.requires_grad and not torch.equal(trained_before[n], p)]
    assert changed  # negative control: the trainable weights did move
    assert torch.equal(
        s.inner.reference_logprobs(probe.input_ids, probe.attention_mask, probe.prompt_width, 1.0), ref_before
    )
    assert torch.equal(s.inner.reward_scores(probe.input_ids, probe.attention_mask, probe.prompt_width), rm_before)


def test_separate_passes_give_the_joint_gradients(tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file):
    """One process runs the policy and the critic one after the other (half the activation
    memory); the gradients must be exactly those of the joint pass that DDP/DeepSpeed use."""
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=1, learning_rate=1e-2)
    s = built(cfg)
    s.train_step()  # move the adapters off zero, so both losses have non-trivial gradients
    batch = s.train_samples[:4]
    exp = make_experience(
        s.inner,
        s.rollout(batch),
        [p["text"] for p in batch],
        cfg=cfg,
        kl_coef=0.05,
        normaliser=s.normaliser,
        reward_fn=None,
        accelerator=s.accelerator,
    )
    grads, stats = {}, {}
    for separate in (True, False):
        s.optimizer.zero_grad(set_to_none=True)
        stats[separate] = actor_critic_backward(
            s.model,
            exp,
            torch.arange(4),
            s.accelerator,
            separate=separate,
            temperature=cfg.generation.temperature,
            cliprange=cfg.ppo.cliprange,
            cliprange_value=cfg.ppo.cliprange_value,
            vf_coef=cfg.ppo.vf_coef,
        )
        grads[separate] = {n: p.grad.clone() for n, p in s.inner.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys()
    assert any(n.startswith("policy.") for n in grads[True]) and any(n.startswith("critic.") for n in grads[True])
    assert all(torch.equal(grads[True][n], grads[False][n]) for n in grads[True])
    assert any(g.abs().sum() > 0 for g in grads[True].values())  # negative control: real gradients
    assert stats[True] == stats[False]


@pytest.fixture(scope="module")
def peaked_policy(tmp_path_factory):
    """A tiny policy with a larger init, so its first response token has a few likely choices
    (a random d=64 model is otherwise near-uniform over its vocabulary and nothing is learnable)."""
    return make_tiny_model(tmp_path_factory.mktemp("peaked") / "policy", seed=0, initializer_range=0.6)


def _target_token(policy_dir, prompts: list[dict]) -> int:
    """The token whose mean first-step probability over the prompts is closest to 0.2."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    with torch.no_grad():
        probs = torch.stack([model(torch.tensor([p["prompt_ids"]])).logits[0, -1].softmax(-1) for p in prompts]).mean(0)
    return int((probs - 0.2).abs().argmin())


def test_learning_raises_reward_and_lr0_does_not(tmp_path, peaked_policy, tiny_reward_dir, prompts_file):
    curves = {}
    for lr in (3e-3, 1e-12):  # 1e-12: a run that barely moves (train.learning_rate 0 is refused: it trains nothing)
        cfg = make_cfg(
            tmp_path / f"lr{lr}",
            peaked_policy,
            tiny_reward_dir,
            prompts_file,
            max_steps=6,
            learning_rate=lr,
            batch_size=8,
        )
        cfg.generation.max_new_tokens, cfg.generation.missing_eos_penalty = 4, None
        cfg.ppo.mini_batch_size, cfg.lora.r = 4, 8
        target = None

        def reward_fn(texts, responses):
            return torch.tensor([sum(t == target for t in r) / len(r) for r in responses])

        probe = ppo.PPOStage(cfg)
        probe.validate()
        target = _target_token(peaked_policy, probe.train_samples)
        rewards = []
        run_stage(ppo.PPOStage, cfg, reward_fn=reward_fn, on_step=lambda stage, m: rewards.append(m["ppo/reward_raw"]))
        curves[lr] = rewards
    learned, frozen = curves[3e-3], curves[1e-12]
    assert learned[0] == frozen[0]  # same seed, same first rollout
    assert sum(learned[-3:]) / 3 >= learned[0] + 0.1, learned  # 32 tokens a step: 3 more of the target, kept
    assert max(frozen) < 0.15 and sum(frozen[-3:]) / 3 < frozen[0] + 0.1, frozen


def test_a_resume_after_the_reward_models_weights_changed_is_refused(
    tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file, monkeypatch
):
    """The policy learns the RM's scores: new weights at the same reward_model.path between a stop
    and its resume are a change of the run (they went unnoticed), as a changed setting is."""
    from pipeline.modeling.manifest import weights_hash

    reward = shutil.copytree(tiny_reward_dir, tmp_path / "rm")
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, reward, prompts_file, max_steps=2)
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "1")
    run_stage(ppo.PPOStage, cfg)
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    before = weights_hash(reward)
    other = make_tiny_model(tmp_path / "other", seed=9, num_labels=1)
    shutil.copy(other / "model.safetensors", reward / "model.safetensors")
    cfg.checkpoint.resume = True
    with pytest.raises(ConfigError) as err:
        ppo.PPOStage(cfg).validate()
    assert f"the model at reward_model.path changed: weights {before} -> weights {weights_hash(reward)}" in str(
        err.value
    )


def test_resume_reproduces_unbroken_run(tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file, monkeypatch):
    """On the default backend (relay); the hf backend's resume is tests/test_grpo.py's (the same
    generators and RNG contract, in the cheaper stage)."""

    def run(out, stop=None, resume=False):
        cfg = make_cfg(out, tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=3, learning_rate=5e-3)
        cfg.ppo.kl_target, cfg.ppo.kl_horizon = 0.5, 100  # adaptive controller: its state must resume too
        cfg.checkpoint.resume = resume
        if stop is None:
            monkeypatch.delenv("RELAY_STOP_AFTER_STEP", raising=False)
        else:
            monkeypatch.setenv("RELAY_STOP_AFTER_STEP", str(stop))
        steps = {}
        stage = run_stage(
            ppo.PPOStage,
            cfg,
            on_step=lambda st, m: steps.__setitem__(st.step, (m, st.last_experience.rollout.responses)),
        )
        return stage, steps

    _, unbroken = run(tmp_path / "a")
    first, before = run(tmp_path / "b", stop=2)
    assert first.step == 2 and first.final_summary is None and sorted(before) == [1, 2]
    assert not (tmp_path / "b" / "merged").exists()
    resumed, after = run(tmp_path / "b", resume=True)
    summary = resumed.final_summary
    assert sorted(after) == [3]
    for step, (metrics, responses) in {**before, **after}.items():
        assert responses == unbroken[step][1], step
        assert metrics["ppo/kl_coef"] == unbroken[step][0]["ppo/kl_coef"]
        assert metrics["ppo/reward_norm"] == unbroken[step][0]["ppo/reward_norm"]
    for name in ("adapter", "critic_adapter"):
        a = load_file(str(tmp_path / "a" / name / "adapter_model.safetensors"))
        b = load_file(str(tmp_path / "b" / name / "adapter_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert summary["steps"] == 3 and summary["reward_first"] == unbroken[1][0]["ppo/reward_raw"]


class BatchForwards(list):
    """The forwards of a model's first decoder layer over a batch's rows (not the one-row forward of
    a shared prompt opening, pipeline.modeling.opening), one entry each."""

    def __call__(self, module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[0] > 1:
            self.append(hidden.shape)


def batch_forwards(model) -> BatchForwards:
    calls = BatchForwards()
    first_block = next(m for name, m in model.named_modules() if name.endswith("layers.0"))
    first_block.register_forward_hook(calls, with_kwargs=True)
    return calls


def test_evaluation_scores_reward_and_kl_without_the_critic(tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file):
    """eval/reward and eval/kl need the policy, the reference and the reward model; the critic's
    values are for the update only, so an evaluation skips its forward (issue 33). The reward
    model shares the critic's backbone (LoRA modes): one backbone forward per eval batch, not two."""
    from pipeline.rl.ppo import score_rollout

    cfg = make_cfg(tmp_path / "out", tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=1)
    cfg.data.eval, cfg.train.eval_steps = [str(prompts_file)], 1
    stage = built(cfg)
    calls = batch_forwards(stage.inner.critic)
    figures = stage.evaluate()
    assert len(calls) == 2 and set(figures) == {"eval/reward", "eval/kl"}  # 8 prompts, batches of 4
    rollout = stage.rollout([stage.eval_samples[i] for i in range(4)])
    full = score_rollout(stage.inner, rollout, micro=4, temperature=1.0, autocast=stage.accelerator.autocast)
    calls.clear()
    lean = score_rollout(
        stage.inner, rollout, micro=4, temperature=1.0, autocast=stage.accelerator.autocast, values=False
    )
    assert len(calls) == 1 and "values" in full and "values" not in lean
    assert all(torch.equal(lean[k], full[k]) for k in ("old", "ref", "rm", "entropy"))


def test_a_held_step_runs_the_critic_backbone_three_times_not_four(
    tmp_path, tiny_model_dir, tiny_reward_dir, prompts_file
):
    """With the whole rollout as the update's first micro-batch, the scoring pass's critic forward is
    held for it like the policy's (issue 33): per step, 2 epochs, the critic/reward backbone runs for
    the held values, the reward scores and the second epoch only."""
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, tiny_reward_dir, prompts_file, max_steps=1)
    cfg.ppo.epochs = 2
    stage = built(cfg)
    calls = batch_forwards(stage.inner.critic)
    figures = stage.train_step()
    assert len(calls) == 3 and figures["ppo/ratio_dev_first"] == 0.0
    assert stage.last_experience.held_values is None and stage.last_experience.held_logits is None  # used, released
