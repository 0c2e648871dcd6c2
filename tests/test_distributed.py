"""Two processes on CPU (torchrun, gloo): PPO with its real sampler under DDP (the joint
policy/critic pass) is on-policy and moves; DeepSpeed ZeRO runs on CPU ranks too
(tests/test_zero_cpu.py); FSDP runs on CPU (FSDP2, tests/test_fsdp.py). Every stage x engine x grad_accum
against one process: test_distributed_stages.py; GPU-only checks: test_distributed_gpu.py."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from forkserver import python_for_tests
from test_pt_sft import fresh_accelerate_state  # noqa: F401 (fixture)

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def torchrun(argv, tmp_path, stage="sft.py"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        python_for_tests(),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "stages" / stage),
        *argv,
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_resuming_a_deepspeed_run_is_refused_up_front(tiny_model_dir, tmp_path, monkeypatch):
    """ZeRO shards the optimizer state and the checkpoint holds rank 0's share: a DeepSpeed run
    that would resume is refused with the config problems; a fresh one (resume false, or no
    checkpoint yet) is not. (CUDA and deepspeed pretended present: the check is pure.)"""
    from pipeline.engine import accelerator
    from stages.sft import SFTConfig

    monkeypatch.setattr(accelerator.torch.cuda, "is_available", lambda: True)
    argv = [
        "--model.path",
        str(tiny_model_dir),
        "--output_dir",
        str(tmp_path / "out"),
        "--distributed.engine",
        "deepspeed",
        "--distributed.deepspeed_config",
        str(ROOT / "deepspeed_configs" / "zero3.json"),
    ]
    resume_lines = lambda cfg: [p for p in accelerator.combination_problems(cfg) if p.startswith("checkpoint.resume:")]  # noqa: E731
    assert resume_lines(load_config(SFTConfig, argv)) == []
    step = tmp_path / "out" / "checkpoints" / "step-0000001"
    step.mkdir(parents=True)
    (step / ".complete").write_text(json.dumps({"step": 1, "lifetime": "temporary", "world_size": 2}))
    lines = resume_lines(load_config(SFTConfig, argv))
    assert (
        len(lines) == 1
        and "distributed.engine deepspeed" in lines[0]
        and lines[0].endswith("Runs under distributed.engine ddp or fsdp resume exactly")
    )
    assert resume_lines(load_config(SFTConfig, argv + ["--checkpoint.resume", "false"])) == []
    # Its checkpoint under another engine (the refusal once advised ddp): DDP read rank 0's share of
    # the optimizer as corrupt, moved the checkpoint aside and trained again from step 0.
    identity = {"stage": "sft", "may_change": {"distributed.engine": "deepspeed"}}
    marker = {"step": 1, "lifetime": "temporary", "world_size": 2, "identity": identity}
    (step / ".complete").write_text(json.dumps(marker))
    under_ddp = load_config(SFTConfig, [*argv[:-4], "--distributed.engine", "ddp"])
    assert resume_lines(under_ddp) == lines
    from pipeline.config.engines import resumes, stop_advice  # what a stopped or diverged run says to do next

    assert (resumes("ddp"), resumes("fsdp"), resumes("deepspeed")) == (True, True, False)

    assert stop_advice("ddp") == "rerun the same command to continue"
    assert stop_advice("deepspeed").startswith("a distributed.engine deepspeed run does not resume (ZeRO shards")


def test_deepspeed_configs_are_valid_json_with_auto_values():
    for name in ("zero2.json", "zero3.json", "zero3_offload.json"):
        data = json.loads((ROOT / "deepspeed_configs" / name).read_text())
        assert data["train_micro_batch_size_per_gpu"] == "auto" and data["gradient_accumulation_steps"] == "auto"
        assert data["zero_optimization"]["stage"] == (2 if name == "zero2.json" else 3)
    offload = json.loads((ROOT / "deepspeed_configs" / "zero3_offload.json").read_text())["zero_optimization"]
    assert offload["offload_optimizer"]["device"] == offload["offload_param"]["device"] == "cpu"


def test_ppo_under_ddp_is_on_policy_then_moves(tiny_model_dir, tiny_reward_dir, tmp_path):
    """Two ranks, two prompts each: the joint forward DDP needs, reward statistics gathered over
    ranks, every rank's RNG in the checkpoint; the first update is exactly on-policy."""
    from pipeline.tools.report import read_scalars

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(8)))
    out = tmp_path / "ppo"
    torchrun(
        [
            "--model.path",
            str(tiny_model_dir),
            "--reward_model.path",
            str(tiny_reward_dir),
            "--data.train",
            f"[{prompts}]",
            "--data.eval",
            "[]",
            "--output_dir",
            str(out),
            "--train.eval_steps",
            "0",
            "--train.batch_size",
            "2",
            "--train.max_steps",
            "2",
            "--train.learning_rate",
            "1e-2",
            "--train.lr_schedule",
            "constant",
            "--train.warmup",
            "0",
            "--train.log_steps",
            "1",
            "--lora.r",
            "4",
            "--generation.max_new_tokens",
            "6",
            "--ppo.mini_batch_size",
            "2",
            "--checkpoint.keep",
            "[{every: 2}]",
        ],
        tmp_path,
        stage="ppo.py",
    )
    scalars = read_scalars(out)
    assert dict(scalars["ppo/ratio_dev_first"])[1] == 0.0 and dict(scalars["ppo/kl"])[1] == 0.0
    assert dict(scalars["ppo/kl"])[2] != 0.0  # negative control: the update moved the policy
    assert (out / "merged" / "manifest.json").is_file() and (out / "summary.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints" / "step-0000002").glob("rng-rank*.json")) == [
        "rng-rank0.json",
        "rng-rank1.json",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal only applies without a GPU")
def test_flash_attention_without_a_gpu_is_a_config_problem(tiny_model_dir):
    from pipeline.engine.accelerator import combination_problems
    from stages.sft import SFTConfig

    cfg = load_config(
        SFTConfig, ["--model.path", str(tiny_model_dir), "--model.attn_implementation", "flash_attention_2"]
    )
    assert combination_problems(cfg) == [
        "model.attn_implementation: attn_implementation 'flash_attention_2' needs a CUDA GPU; "
        "none is visible. Use 'sdpa'."
    ]
