"""Train-inference mismatch (pipeline/algorithms/mismatch.py): the TIS/MIS weights and the
|engine - trainer| log-prob diff against TRL 1.16's own code on the same tensors (the
`vllm_importance_sampling_correction` block of GRPOTrainer._generate_and_score_completions, run
as TRL wrote it), the corrected GRPO loss against TRL's `_compute_loss`, and a synthetic mismatch:
the correction changes the loss only where the diff is large."""

from __future__ import annotations

import dataclasses
import inspect
import math
import textwrap
from types import SimpleNamespace

import pytest
import torch
from test_grpo import _fixed, trl_loss

from pipeline.algorithms.mismatch import CORRECTIONS, correction_weights, engine_logprob_matrix, logprob_diff
from pipeline.rl import grpo as algo

MODES = {"tis": "token_truncate", "mis": "token_mask"}


def trl_block(first: str, last: str) -> str:
    """The lines of TRL 1.16's `_generate_and_score_completions` from the one starting with
    `first` through the one starting with `last` (dedented), to run on our tensors."""
    trl = pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    assert trl.__version__ == "1.16.0"
    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(first))
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith(last))
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def trl_ratio(trainer, engine, mask, mode, cap, floor):
    """TRL's importance-sampling ratio for these log-probs (old = trainer, sampling = engine)."""
    code = trl_block("per_token_logps_diff = (old_per_token_logps", 'f"Unknown vLLM importance sampling level')
    scope = {
        "torch": torch,
        "math": math,
        "old_per_token_logps": trainer,
        "sampling_per_token_logps": engine,
        "mask": mask,
        "self": SimpleNamespace(
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_max=cap,
            vllm_importance_sampling_clip_min=floor,
        ),
    }
    exec(compile(code + "\n)", "trl-block", "exec"), scope)  # the block ends inside raise ValueError( ... )
    return scope["vllm_importance_sampling_ratio"]


def trl_diff(trainer, engine, mask):
    code = trl_block("delta = torch.abs(old_per_token_logps", "max_delta =")
    scope = {
        "torch": torch,
        "old_per_token_logps": trainer,
        "sampling_per_token_logps": engine,
        "completion_mask": mask,
        "tool_mask": None,
        "device": "cpu",
    }
    exec(compile(code, "trl-block", "exec"), scope)
    return float(scope["mean_delta"]), float(scope["max_delta"])


def mismatched(seed=0, B=4, T=6):
    """(trainer log-probs, engine log-probs, mask): the engine off by up to ~1.5 nats, one NaN."""
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    engine = trainer + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    engine[2, 1] = float("nan")
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 4:] = 0
    return trainer, engine, mask


@pytest.mark.parametrize(
    "name,cap,floor", [("tis", 2.0, None), ("tis", 1.5, 0.5), ("mis", 2.0, 0.5), ("mis", 1.2, None)]
)
def test_weights_match_trl(name, cap, floor):
    trainer, engine, mask = mismatched()
    ours = correction_weights(name, trainer, engine, mask, cap, floor)
    want = trl_ratio(trainer, engine, mask, MODES[name], cap, floor)
    torch.testing.assert_close(ours, want, rtol=0, atol=0)
    assert 0 < int((ours == (cap if name == "tis" else 0.0)).sum()) < mask.sum()  # the cap / band does act
    assert correction_weights("none", trainer, engine, mask, cap, floor) is None
    assert set(CORRECTIONS) == {"none", "tis", "mis"}


def test_logprob_diff_matches_trl():
    trainer, engine, mask = mismatched(seed=1)
    want = trl_diff(trainer, engine, mask)
    assert logprob_diff(trainer, engine, mask) == pytest.approx(want, rel=1e-12)
    assert logprob_diff(trainer, trainer.clone(), mask) == (0.0, 0.0)


@pytest.mark.parametrize("name,loss_type,beta", [("tis", "dapo", 0.04), ("mis", "grpo", 0.0), ("tis", "grpo", 0.04)])
def test_corrected_loss_matches_trl(name, loss_type, beta):
    logp, old, ref, adv, mask = _fixed(seed=5)
    engine = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7), dtype=old.dtype)
    weight = correction_weights(name, old, engine, mask, 1.5, 0.5)
    want, want_grad, _ = trl_loss(logp, old, ref, adv, mask, loss_type=loss_type, beta=beta, is_ratio=weight)
    leaf = logp.clone().requires_grad_(True)
    out = algo.grpo_loss(
        leaf, old, adv, mask, epsilon=0.2, beta=beta, ref_logp=ref, loss_type=loss_type, is_weight=weight
    )
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(leaf.grad, want_grad, rtol=1e-12, atol=1e-12)
    plain = algo.grpo_loss(logp, old, adv, mask, epsilon=0.2, beta=beta, ref_logp=ref, loss_type=loss_type).loss
    assert abs(float(plain) - float(out.loss.detach())) > 1e-3  # the correction is not a no-op on these tensors


@pytest.mark.parametrize("name", ["tis", "mis"])
def test_a_synthetic_mismatch_changes_the_loss_only_where_the_diff_is_large(name):
    """The engine agrees with the trainer to 1e-6 except on three tokens (2 nats off): the
    corrected gradient equals the uncorrected one on every other token, and differs on those."""
    logp, _, ref, adv, mask = _fixed(seed=2)
    old = logp.clone()  # on-policy (one iteration): no token is clipped, every one has a gradient
    engine = old + 1e-6 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3), dtype=old.dtype)
    far = torch.zeros_like(mask, dtype=torch.bool)
    far[0, 1] = far[2, 3] = far[3, 0] = True
    engine[far] = old[far] - 2.0  # the trainer's prob is e^2 = 7.4x the engine's: above the cap 2
    weight = correction_weights(name, old, engine, mask, 2.0, 0.5)
    grads = []
    for w in (None, weight):
        leaf = logp.clone().requires_grad_(True)
        algo.grpo_loss(leaf, old, adv, mask, epsilon=0.2, loss_type="dapo", is_weight=w).loss.backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1][~far], grads[0][~far], rtol=1e-5, atol=1e-9)
    assert (grads[1][far] - grads[0][far]).abs().min() > 1e-3


# ------------------------------------------------------------------------------------------
# The GRPO stage with an engine that reports its own log-probs (no vLLM needed)
# ------------------------------------------------------------------------------------------


class ReportingEngine:
    """Relay's engine, reporting a log-prob of `offset` nats below the trainer's for every sampled
    token: a synthetic, known mismatch."""

    def __init__(self, policy, offset: float, pad_id: int, eos_ids: list, max_new_tokens: int = 4):
        from pipeline.rl.generators import RelayGenerator

        self.policy, self.offset, self.pad_id, self.eos_ids = policy, offset, pad_id, eos_ids
        self.inner = RelayGenerator(policy, pad_id, eos_ids, max_new_tokens)
        self.last_logprobs: list = []

    def generate(self, prompts):
        from pipeline.algorithms.rl import logprobs_from_logits
        from pipeline.rl.rollout import assemble, policy_logits

        out = self.inner.generate(prompts)
        rollout = assemble(prompts, out, self.pad_id, self.eos_ids)
        with torch.no_grad():
            logits = policy_logits(self.policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width)
        trainer = logprobs_from_logits(logits.float(), rollout.response_ids)
        self.last_logprobs = [(trainer[i, : len(r)] - self.offset).tolist() for i, r in enumerate(rollout.responses)]
        return out


@pytest.fixture
def relay_reports_engine_logprobs(monkeypatch):
    """These stages sample with `ReportingEngine`, a stand-in engine that reports log-probs of its
    own under the `relay` backend's name: the capability table refuses a correction on the real
    relay backend (it reports none), so the stand-in's cells are declared here."""
    from pipeline.config import capabilities as caps

    monkeypatch.setitem(caps.BACKENDS, "relay", dataclasses.replace(caps.BACKENDS["relay"], engine_logprobs=True))
    for stage in ("grpo", "ppo"):
        for correction in ("tis", "mis"):
            for adapter in caps.ADAPTERS:
                cell = caps.Cell(stage, "relay", "off", adapter, "single", correction)
                monkeypatch.setitem(caps.TESTS, cell, ("tests/test_mismatch.py",))


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_grpo_stage_logs_the_mismatch_and_corrects_it(
    tmp_path, tiny_model_dir, correction, relay_reports_engine_logprobs
):
    from stagerun import run_stage
    from test_grpo import make_cfg

    from stages import grpo

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Question number {i}?"}}\n' for i in range(8)))
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, prompts, max_steps=1, learning_rate=1e-3)
    cfg.grpo.reward_funcs = ["test_mismatch:completion_chars"]
    cfg.generation.correction, cfg.generation.correction_cap, cfg.generation.correction_floor = correction, 2.0, 0.5

    seen = {}

    def on_step(stage, m):
        seen.update(m)

    class Stage(grpo.GRPOStage):
        def __init__(self, cfg):
            super().__init__(cfg, generator_factory=self.make)

        def make(self, policy):  # w = e^0.1 = 1.105 on every token: inside tis's cap and mis's band
            return ReportingEngine(policy, 0.1, self.tokenizer.pad_token_id, [self.tokenizer.eos_token_id])

    run_stage(Stage, cfg, on_step=on_step)
    assert seen["rollout/logprob_diff_mean"] == pytest.approx(0.1, abs=1e-5)
    assert seen["rollout/logprob_diff_max"] == pytest.approx(0.1, abs=1e-5)
    SEEN_NORM[correction] = seen["train/grad_norm"]
    assert seen["train/grad_norm"] > 0
    if len(SEEN_NORM) == 3:  # the gradient is linear in a uniform weight (on-policy, nothing clipped): 1.105x
        assert SEEN_NORM["tis"] == pytest.approx(SEEN_NORM["none"] * math.exp(0.1), rel=1e-4)
        assert SEEN_NORM["mis"] == pytest.approx(SEEN_NORM["tis"], rel=1e-6)


SEEN_NORM: dict = {}


def completion_chars(prompts, completions):
    """A test reward that differs within a group: the completion's length in characters."""
    return [float(len(c)) for c in completions]


def test_ppo_stage_logs_the_mismatch(tmp_path, tiny_model_dir, tiny_reward_dir):
    from stagerun import run_stage
    from test_ppo import make_cfg

    from stages import ppo

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Question number {i}?"}}\n' for i in range(8)))
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, tiny_reward_dir, prompts, max_steps=1, learning_rate=1e-3)

    class Stage(ppo.PPOStage):
        def __init__(self, cfg):
            super().__init__(
                cfg,
                generator_factory=lambda policy: ReportingEngine(
                    policy,
                    0.25,
                    self.tokenizer.pad_token_id,
                    [self.tokenizer.eos_token_id],
                    cfg.generation.max_new_tokens,
                ),
            )

    seen = {}
    run_stage(Stage, cfg, on_step=lambda stage, m: seen.update(m))
    assert seen["rollout/logprob_diff_mean"] == pytest.approx(0.25, abs=1e-5)
    assert seen["rollout/logprob_diff_max"] == pytest.approx(0.25, abs=1e-5)


# verl's PPO policy loss with rollout importance sampling (verl main b178a3cd, 2026-01-29):
# compute_rollout_correction_weights(old - rollout, mask, "token", cap) then
# compute_policy_loss_vanilla(old, new, A, mask, "token-mean", clip_ratio 0.2, rollout_is_weights=w),
# run in float64 on the tensors below (a harness extracted the two functions from
# verl/trainer/ppo/core_algos.py and rollout_corr_helper.py). verl's dual clip (clip_ratio_c 3, for
# A < 0) is inert here: every ratio is below 3.
VERL_OLD = [[-1.20, -0.70, -2.10, -0.30, -1.60], [-0.90, -2.40, -0.50, -1.10, -3.00]]
VERL_NEW = [[-1.05, -0.95, -2.00, -0.31, -1.20], [-0.60, -2.45, -0.20, -1.50, -2.95]]
VERL_ENGINE = [[-1.21, -1.90, -2.10, -0.25, -0.40], [-0.88, -2.40, -1.60, -1.05, -0.10]]
VERL_ADV = [[0.50, -1.00, 0.30, 1.20, -0.40], [-0.70, 0.90, 1.10, -0.20, 0.60]]
VERL_MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
VERL_WEIGHTS = {
    2.0: [
        [1.0100501670841682, 2.0, 1.0, 0.951229424500714, 0.301194211912202],
        [0.9801986733067553, 1.0, 2.0, 0.9512294245007139, 0.0],
    ]
}
VERL_LOSS = {None: -0.19722262610852992, 2.0: -0.2984901634519035, 3.0: -0.3562679412296812}


@pytest.mark.parametrize("cap", [None, 2.0, 3.0])
def test_ppo_policy_loss_with_tis_matches_verl(cap):
    from pipeline.algorithms.rl import policy_loss

    old, new, engine, adv, mask = (
        torch.tensor(t, dtype=torch.float64) for t in (VERL_OLD, VERL_NEW, VERL_ENGINE, VERL_ADV, VERL_MASK)
    )
    weight = None if cap is None else correction_weights("tis", old, engine, mask, cap)
    if cap in VERL_WEIGHTS:  # verl zeroes the weight of padding; Relay leaves it 1 there (the loss masks it either way)
        assert torch.allclose(weight * mask, torch.tensor(VERL_WEIGHTS[cap], dtype=torch.float64), rtol=0, atol=1e-12)
    out = policy_loss(new, old, adv, mask, 0.2, weight=weight)
    assert abs(float(out.loss) - VERL_LOSS[cap]) < 1e-6, (float(out.loss), VERL_LOSS[cap])


def test_ppo_stage_corrects_the_policy_loss(tmp_path, tiny_model_dir, tiny_reward_dir, relay_reports_engine_logprobs):
    """An engine 0.25 nats below the trainer on every token: TIS weighs each token's surrogate by
    e^0.25 (under the cap 3), MIS with the band [0, 1.2] drops them all; the value loss is untouched.
    One PPO step (built, not run: no export), one epoch of one micro-batch, so the policy loss is
    that of the rollout's own forward."""
    from test_ppo import make_cfg

    from stages import ppo

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Question number {i}?"}}\n' for i in range(8)))
    seen = {}
    for name, cap in (("none", 3.0), ("tis", 3.0), ("mis", 1.2)):
        cfg = make_cfg(tmp_path / name, tiny_model_dir, tiny_reward_dir, prompts, max_steps=1, learning_rate=1e-3)
        cfg.ppo.epochs, cfg.generation.correction, cfg.generation.correction_cap = 1, name, cap
        cfg.ppo.whiten_advantages = (
            False  # whitened advantages average to ~0: the loss at ratio 1 would be rounding noise
        )

        class Stage(ppo.PPOStage):
            def __init__(self, cfg):
                super().__init__(
                    cfg,
                    generator_factory=lambda policy: ReportingEngine(
                        policy,
                        0.25,
                        self.tokenizer.pad_token_id,
                        [self.tokenizer.eos_token_id],
                        cfg.generation.max_new_tokens,
                    ),
                )

        stage = Stage(cfg)
        stage.validate()
        stage.build()
        seen[name] = (stage.train_step(), stage.last_experience)
    assert seen["none"][1].is_weight is None and abs(seen["none"][0]["ppo/policy_loss"]) > 1e-3
    for name, factor in (("tis", math.exp(0.25)), ("mis", 0.0)):
        figures, exp = seen[name]
        mask = exp.rollout.response_mask.bool()
        assert torch.allclose(exp.is_weight[mask], torch.full_like(exp.is_weight[mask], factor), atol=1e-5), name
        assert figures["ppo/policy_loss"] == pytest.approx(
            factor * seen["none"][0]["ppo/policy_loss"], rel=1e-5, abs=1e-7
        ), name
        assert figures["ppo/value_loss"] == pytest.approx(seen["none"][0]["ppo/value_loss"], rel=1e-6), name


def test_relay_engine_log_probs_equal_the_trainers(tiny_model_dir):
    """The `relay` backend needs no correction: its own log-probs of what it sampled (decode.py's
    `logprobs`) are the trainer's within fp32 rounding (the issue's goal: mean <= 1e-5)."""
    from transformers import AutoModelForCausalLM

    from pipeline.algorithms.rl import logprobs_from_logits
    from pipeline.modeling.decode import generate
    from pipeline.rl.rollout import assemble, policy_logits

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[1, 5, 9, 13], [2, 7], [3, 4, 5, 6, 7, 8]] * 2
    torch.manual_seed(0)
    out = generate(
        model, prompts, max_new_tokens=12, eos_ids=[2], pad_id=0, temperature=0.7, logprobs=True, keep_packed=False
    )
    rollout = assemble(prompts, out.tokens, 0, [2])
    engine = engine_logprob_matrix(rollout.responses, out.logprobs, rollout.response_mask.shape[1])
    with torch.no_grad():
        logits = policy_logits(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_width)
    trainer = logprobs_from_logits(logits.float() / 0.7, rollout.response_ids)
    mean, worst = logprob_diff(trainer, engine, rollout.response_mask)
    print(f"relay engine vs trainer over {int(rollout.response_mask.sum())} tokens: mean {mean:.2e}, max {worst:.2e}")
    assert mean <= 1e-5 and worst <= 1e-4
    assert (
        correction_weights("tis", trainer, engine, rollout.response_mask, 3.0)[rollout.response_mask.bool()]
        .sub(1)
        .abs()
        .max()
        < 1e-4
    )


def test_vllm_backend_config_problems(tmp_path, tiny_model_dir, monkeypatch):
    """Refused before any model loads, one line each: a sharded engine (no weight sync from shards
    yet), full fine-tuning of a model with tied embeddings, vLLM's environment absent, a correction not in the registry,
    a band upside down."""
    from test_grpo import make_cfg

    from pipeline.config import ConfigError
    from pipeline.modeling import vllm_server
    from stages import grpo

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Question number {i}?"}}\n' for i in range(8)))
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, prompts, max_steps=1)
    cfg.generation.backend, cfg.distributed.engine, cfg.model.finetuning = "vllm", "fsdp", "full"
    cfg.generation.correction, cfg.generation.correction_floor, cfg.generation.correction_cap = "seq_tis", 2.0, 1.0
    monkeypatch.setattr(vllm_server, "vllm_python", lambda: None)
    with pytest.raises(ConfigError) as err:
        grpo.GRPOStage(cfg).validate()
    joined = "\n".join(err.value.problems)
    assert "generation.correction: 'seq_tis' is not one of ('auto', 'none', 'tis', 'mis')" in joined
    assert "need 0 <= floor < cap" in joined
    assert (
        "a model with tied input/output embeddings cannot be synced into vLLM yet" in joined
    )  # the tiny model ties them
    assert "generation.backend: vllm syncs weights from one whole policy; distributed.engine 'fsdp'" in joined
    assert "generation.backend: vllm is not installed (bash run_scripts/install_vllm.sh" in joined
    assert cfg.generation.correction_name == "seq_tis" and grpo.GRPOConfig().generation.correction_name == "none"


def test_vllm_gpu_options_pass_through_and_are_refused_where_they_cannot_run(tmp_path, tiny_model_dir, monkeypatch):
    """Tensor-parallel size, sleep mode and the memory share reach vLLM's command line and
    environment; on a machine without enough CUDA GPUs they are config problems (one line each)."""
    from test_grpo import make_cfg

    from pipeline.config import ConfigError
    from pipeline.config.policy import GenerationConfig
    from pipeline.modeling import vllm_server
    from pipeline.rl import vllm_generator
    from pipeline.rl.policy_stage import vllm_gpu_problems
    from pipeline.rl.vllm_generator import engine_options
    from stages import grpo

    opts = engine_options(8, tensor_parallel_size=2, sleep=True, gpu_memory_utilization=0.35)
    monkeypatch.setattr(vllm_server, "on_gpu", lambda: True)
    cmd = vllm_server.server_command("python", "/m", "127.0.0.1", 8000, opts)
    monkeypatch.undo()
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and "--enable-sleep-mode" in cmd
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.35" and "--enable-lora" in cmd
    assert vllm_server.server_env(opts)["VLLM_SERVER_DEV_MODE"] == "1"
    plain = vllm_server.server_command("python", "/m", "127.0.0.1", 8000, engine_options(8))
    assert "--enable-sleep-mode" not in plain and "--gpu-memory-utilization" not in plain
    gen = GenerationConfig(backend="vllm", vllm_sleep=True, vllm_tensor_parallel_size=2)
    assert vllm_gpu_problems(gen, cuda_devices=2) == []
    # the engine runs on the trainer's GPU: by default TRL's colocated share (vLLM's own 0.9 would leave the
    # trainer nothing); vLLM's CPU build reads the option as a share of host memory, so it is not passed there
    stage_cfg = SimpleNamespace(generation=GenerationConfig(backend="vllm"), output_dir=str(tmp_path), train=None)
    stage_cfg.train = SimpleNamespace(seq_length=64)
    for gpu, share in ((True, "0.3"), (False, None)):
        monkeypatch.setattr(vllm_server, "on_gpu", lambda: gpu)
        engine = vllm_generator.stage_engine(stage_cfg, str(tmp_path))
        opts = engine_options(8, gpu_memory_utilization=engine["gpu_memory_utilization"])
        cmd = vllm_server.server_command("python", "/m", "127.0.0.1", 8000, opts)
        assert (cmd[cmd.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in cmd else None) == share
    monkeypatch.undo()
    # another backend's options are refused rather than ignored
    relay = GenerationConfig(backend="relay", vllm_sleep=True, vllm_gpu_memory_utilization=0.5)
    unread = [p for p in relay.problems() if "reads it" in p]
    assert unread == [
        "generation.vllm_sleep: only generation.backend vllm reads it (generation.backend is 'relay')",
        "generation.vllm_gpu_memory_utilization: only generation.backend vllm reads it (generation.backend is 'relay')",
    ]
    assert not [p for p in GenerationConfig(backend="vllm", vllm_sleep=True).problems() if "reads it" in p]
    assert len(vllm_gpu_problems(gen, cuda_devices=1)) == 1 and len(vllm_gpu_problems(gen, cuda_devices=0)) == 2
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Question number {i}?"}}\n' for i in range(8)))
    cfg = make_cfg(tmp_path / "out", tiny_model_dir, prompts, max_steps=1)
    cfg.generation.backend, cfg.generation.vllm_sleep, cfg.generation.vllm_tensor_parallel_size = "vllm", True, 0
    cfg.generation.vllm_gpu_memory_utilization = 1.5
    monkeypatch.setattr(vllm_server, "vllm_python", lambda: "python")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        grpo.GRPOStage(cfg).validate()
    joined = "\n".join(err.value.problems)
    assert "generation.vllm_sleep: vLLM's sleep mode needs a CUDA GPU" in joined
    assert "generation.vllm_tensor_parallel_size: must be >= 1, got 0" in joined
    assert "generation.vllm_gpu_memory_utilization: must be in (0, 1], got 1.5" in joined
