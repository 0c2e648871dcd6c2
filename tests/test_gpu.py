"""GPU-only checks not covered by test_distributed_gpu.py (skipped without CUDA; CI never depends on
them; run_scripts/gpu_check.sh runs them): packing on CUDA sdpa is contamination-free and equals
each sample alone (fp32 and bf16); PPO and GRPO run on CUDA (models, rollouts and updates there);
FSDP on one rank, stopped after step 1 and resumed, continues exactly as an unbroken FSDP run
(its checkpoint gathers the sharded state and scatters it back) and trains like plain one GPU.

    HF_HUB_OFFLINE=1 python -m pytest -q tests/test_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch
from stagerun import run_stage
from test_distributed_stages import figures, history, launch, merged_weights, stage_argv, write_data
from test_packing import SEQ, A, B, _forward, _model, _per_sample_loss

from data_formats.collate import Collator, pack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: CUDA sdpa, PPO/GRPO and FSDP on CUDA")
PACKED_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
"""Per-sample loss, packed vs alone: fp32 agrees to ~1e-6; bf16 rounds each row's sums differently."""


def on_device(stage) -> str:
    """Where the stage's trained model is while it trains."""
    return next(stage.model.parameters()).device.type


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir, tiny_reward_dir):
    root = tmp_path_factory.mktemp("gpu")
    return root, write_data(root / "data"), tiny_model_dir, tiny_reward_dir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_unpacked_on_cuda_sdpa(tiny_model_dir, dtype):
    model = _model(tiny_model_dir, "sdpa").to("cuda", dtype)
    collate = Collator(0, "pack", SEQ, attn_implementation="sdpa")
    to_cuda = lambda batch: {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}
    packed = to_cuda(collate(pack([A, B], SEQ)))
    perturbed = to_cuda(collate(pack([dict(A, input_ids=[1000 + x for x in A["input_ids"]]), B], SEQ)))
    logits, logits_p = _forward(model, packed).float(), _forward(model, perturbed).float()
    assert logits.device.type == "cuda"
    assert torch.equal(logits[0, 7:16], logits_p[0, 7:16])  # A's change is invisible to B
    for sample, span in ((A, slice(0, 7)), (B, slice(7, 16))):
        alone = _forward(model, {"input_ids": torch.tensor([sample["input_ids"]], device="cuda")})[0].float()
        packed_loss = _per_sample_loss(logits[0, span], packed["labels"][0, span])
        alone_loss = _per_sample_loss(alone, torch.tensor(sample["labels"], device="cuda"))
        assert abs(packed_loss.item() - alone_loss.item()) < PACKED_TOL[dtype]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ppo_runs_on_cuda(setup, precision):
    from pipeline.config import load_config
    from stages.ppo import PPOStage

    root, data, model, reward = setup
    argv = stage_argv("ppo", 1, 4, root / f"ppo-{precision}", data, model, reward)
    argv += ["--train.precision", precision, "--model.dtype", precision]
    devices = []
    stage = run_stage(
        PPOStage, load_config(PPOStage.config_class, argv), on_step=lambda st, m: devices.append(on_device(st))
    )
    assert stage.step == 2 and devices == ["cuda", "cuda"]
    for step in stage.history.steps:
        assert all(torch.isfinite(torch.tensor(step[k])) for k in ("train/grad_norm", "ppo/kl", "ppo/entropy"))
    assert (root / f"ppo-{precision}" / "merged" / "manifest.json").is_file()


def test_grpo_runs_on_cuda(tmp_path, tiny_model_dir, monkeypatch):
    import test_grpo

    from stages import grpo

    monkeypatch.setitem(test_grpo.SCORE_TARGET, "token", "e")  # test_grpo's rule reward scores this token's share

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about {i}."}) + "\n" for i in range(8)))
    cfg = test_grpo.make_cfg(tmp_path / "out", tiny_model_dir, prompts, max_steps=2)
    cfg.train.precision = cfg.model.dtype = "bf16"
    devices = []
    stage = run_stage(grpo.GRPOStage, cfg, on_step=lambda st, m: devices.append(on_device(st)))
    assert stage.step == 2 and devices == ["cuda", "cuda"]
    assert all(torch.isfinite(torch.tensor(s["train/loss"])) for s in stage.history.steps)


def test_fsdp_one_rank_resumes_exactly_and_equals_one_gpu(setup):
    """LoRA SFT and full RM under FSDP on one rank: stopped after step 1 and resumed == unbroken
    (every figure, the merged weights), and the unbroken run == the plain one-GPU run."""
    root, data, model, reward = setup
    folder = root / "fsdp1"
    specs = []
    for stage, name, mode in (("sft", "sft", "lora"), ("rm", "rm", "full")):
        plain = stage_argv(stage, 1, 4, folder / f"{name}-plain", data, model, reward) + ["--model.finetuning", mode]
        fsdp = lambda out: (
            stage_argv(stage, 1, 4, folder / out, data, model, reward)
            + ["--model.finetuning", mode, "--distributed.engine", "fsdp"]
        )
        specs += [
            {"stage": stage, "argv": plain},
            {"stage": stage, "argv": fsdp(name)},
            {"stage": stage, "argv": fsdp(f"{name}-resumed"), "stop_after": 1},
            {"stage": stage, "argv": fsdp(f"{name}-resumed")},
        ]
    launch(specs, folder, 1, torchrun=True)
    for name, stage in (("sft", "sft"), ("rm", "rm")):
        resumed, unbroken, plain = folder / f"{name}-resumed", folder / name, folder / f"{name}-plain"
        assert json.loads((resumed / "history-rank0.json").read_text())["resumed_at"] == 1
        got, want = history(resumed), history(unbroken)
        for key in ("train/loss", "train/grad_norm"):
            assert [s[key] for s in got] == pytest.approx([s[key] for s in want], rel=1e-6), key
        a, b = merged_weights(resumed), merged_weights(unbroken)
        assert a.keys() == b.keys() and a
        assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) < 1e-4
        for key, values in figures(unbroken, stage).items():
            assert values == pytest.approx(figures(plain, stage)[key], rel=1e-3), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_engine_replays_one_cuda_graph_per_call(tiny_model_dir, dtype, monkeypatch):
    """On CUDA the engine captures its decode step once per call and replays it (GraphStep): the
    greedy tokens equal the model's own forward step's (RELAY_DECODE_GRAPHS=0), the step logits
    agree (fp32 within 1e-4, bf16 within 5e-2), and the graph was captured, not fallen back from."""
    from transformers import AutoModelForCausalLM

    from pipeline.modeling import decode

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).cuda().eval()
    prompts = [[5, 9, 17, 30, 4, 8, 3], [11, 12], [7, 7, 20, 25]]
    captured = []
    real = decode.GraphStep.capture
    monkeypatch.setattr(decode.GraphStep, "capture", lambda self: (real(self), captured.append(self.graph is not None)))

    def run():
        seen = []
        out = decode.generate(
            model,
            prompts,
            max_new_tokens=12,
            eos_ids=[],
            pad_id=0,
            temperature=0.0,
            on_logits=lambda step, logits: seen.append(logits.float().cpu()),
        )
        return out.tokens, torch.stack(seen)

    graph_tokens, graph_logits = run()
    assert captured == [True]
    monkeypatch.setenv("RELAY_DECODE_GRAPHS", "0")
    plain_tokens, plain_logits = run()
    if dtype == torch.float32:
        assert graph_tokens == plain_tokens
        torch.testing.assert_close(graph_logits, plain_logits, atol=1e-4, rtol=0)
    else:  # bf16 near-ties may flip a later argmax: compare the first decode step, whose inputs are equal
        assert [t[:2] for t in graph_tokens] == [t[:2] for t in plain_tokens]
        torch.testing.assert_close(graph_logits[1], plain_logits[1], atol=5e-2, rtol=0)


def test_the_entropy_threshold_reads_nothing_on_the_host():
    """GRPO's top_entropy_quantile on one process: the threshold is found on the GPU (a boolean
    index would sync on its count every micro-batch)."""
    from types import SimpleNamespace

    from pipeline.rl.grpo import _entropy_filter

    entropies = torch.rand(4, 16, device="cuda")
    mask = (torch.rand(4, 16, device="cuda") > 0.3).float()
    torch.cuda.set_sync_debug_mode("error")
    try:
        keep = _entropy_filter(entropies, mask, 0.2, SimpleNamespace(num_processes=1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert keep.device.type == "cuda" and keep.dtype == torch.bool
