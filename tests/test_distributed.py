"""Two processes on CPU (torchrun, gloo): the loss curve equals the one-process curve with the same
global batch, for DDP and FSDP; PPO's joint policy/critic pass runs under DDP. DeepSpeed needs a
GPU through accelerate (see setup_accelerator)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import load_config
from test_pt_sft import fresh_accelerate_state, sft_args, write_sft  # noqa: F401 (fixture)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def curve(out: Path) -> list[float]:
    """Per-step losses recorded in the final checkpoint."""
    trainer = json.loads((out / "checkpoints" / f"step-{STEPS:07d}" / "trainer.json").read_text())
    return [r["train/loss"] for r in trainer["history"]["steps"]]


def args(model, train, valid, out, batch_size):
    return sft_args(model, train, valid, out, "--train.max_steps", str(STEPS), "--train.eval_steps", "0",
                    "--train.batch_size", str(batch_size), "--lora.dropout", "0",
                    "--multitask.weighted_loss_mode", "case3")


def torchrun(argv, tmp_path, stage="sft.py"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(ROOT / "stages" / stage), *argv]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process_curve(tiny_model_dir, tmp_path_factory):
    """One process, batch 4 x accumulation 2: the reference for 2 ranks x batch 2 x accumulation 2."""
    from accelerate.state import AcceleratorState

    from stages.sft import SFTStage
    from stagerun import run_stage

    tmp = tmp_path_factory.mktemp("dist")
    train, valid = write_sft(tmp / "data", 12, 4)
    AcceleratorState._reset_state(True)
    run_stage(SFTStage, args(tiny_model_dir, train, valid, tmp / "one", 4))
    AcceleratorState._reset_state(True)
    return tmp, train, valid, curve(tmp / "one")


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_processes_match_one(engine, one_process_curve, tiny_model_dir):
    tmp, train, valid, reference = one_process_curve
    out = tmp / engine
    torchrun(args(tiny_model_dir, train, valid, out, 2) + ["--distributed.engine", engine], tmp)
    got = curve(out)
    assert len(got) == STEPS
    assert got == pytest.approx(reference, rel=1e-5)
    assert got[-1] != reference[0]  # the curve moved: the runs trained
    assert (out / "merged" / "manifest.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints" / f"step-{STEPS:07d}").glob("rng-rank*.json")) == ["rng-rank0.json", "rng-rank1.json"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal only applies without a GPU")
def test_deepspeed_is_refused_clearly_on_cpu(tiny_model_dir, tmp_path):
    from stages.sft import SFTConfig

    from pipeline.engine.accelerator import setup_accelerator

    cfg = load_config(SFTConfig, ["--model.path", str(tiny_model_dir), "--distributed.engine", "deepspeed",
                                  "--distributed.deepspeed_config", str(ROOT / "deepspeed_configs" / "zero2.json")])
    with pytest.raises(ValueError, match="needs a GPU"):
        setup_accelerator(cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeed through accelerate needs a GPU; none here")
def test_deepspeed_zero2_matches_one_process(one_process_curve, tiny_model_dir):
    tmp, train, valid, reference = one_process_curve
    out = tmp / "zero2"
    torchrun(args(tiny_model_dir, train, valid, out, 2) + ["--distributed.engine", "deepspeed", "--distributed.deepspeed_config",
                                                          str(ROOT / "deepspeed_configs" / "zero2.json")], tmp)
    assert curve(out) == pytest.approx(reference, rel=1e-3)


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
    torchrun(["--model.path", str(tiny_model_dir), "--reward_model.path", str(tiny_reward_dir), "--data.train", f"[{prompts}]",
              "--data.eval", "[]", "--output_dir", str(out), "--train.eval_steps", "0", "--train.batch_size", "2",
              "--train.max_steps", "2", "--train.learning_rate", "1e-2", "--train.lr_schedule", "constant", "--train.warmup", "0",
              "--train.log_steps", "1", "--lora.r", "4", "--generation.max_new_tokens", "6", "--ppo.mini_batch_size", "2",
              "--checkpoint.keep", "[{every: 2}]"], tmp_path, stage="ppo.py")
    scalars = read_scalars(out)
    assert dict(scalars["ppo/ratio_dev_first"])[1] == 0.0 and dict(scalars["ppo/kl"])[1] == 0.0
    assert dict(scalars["ppo/kl"])[2] != 0.0  # negative control: the update moved the policy
    assert (out / "merged" / "manifest.json").is_file() and (out / "summary.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints" / "step-0000002").glob("rng-rank*.json")) == ["rng-rank0.json", "rng-rank1.json"]
