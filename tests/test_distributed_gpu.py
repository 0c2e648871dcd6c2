"""GPU-only distributed checks (skipped without CUDA; CI never depends on them): DeepSpeed ZeRO-2,
ZeRO-2 offload, ZeRO-3 and ZeRO-3 offload for SFT and RM with grad_accum 1 and 4 equal the one-GPU
plain run with the same global batch; PPO under ZeRO-3 equals it too; QLoRA trains under ZeRO-2
and tracks the one-GPU QLoRA run (under ZeRO-3 and FSDP it is refused up front:
tests/test_zero_cpu.py, tests/test_fsdp.py); bf16 tracks fp32 within a stated tolerance; resuming a ZeRO run
is refused up front (its optimizer state is sharded). FSDP's equivalence and exact resume are
tests/test_distributed_stages.py (two GPUs); ZeRO on two CPU ranks: tests/test_zero_cpu.py.

Ranks: min(2, GPUs). On one GPU the DeepSpeed runs are one rank (ZeRO's partitioning, its engine
stepping once per optimizer step, its clipping and precision are still what runs); NCCL cannot
put two ranks on one GPU, so the two-rank checks need two GPUs. Figures go to bench/RESULTS.md.

    HF_HUB_OFFLINE=1 python -m pytest -q tests/test_distributed_gpu.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_distributed_stages import LOSS_KEYS, figures, launch, merged_weights, stage_argv, write_data

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: DeepSpeed/FSDP/QLoRA on CUDA")
RANKS = max(1, min(2, torch.cuda.device_count())) if torch.cuda.is_available() else 1
ZERO = {
    "zero2": "zero2.json",
    "zero2_offload": "zero2_offload.json",
    "zero3": "zero3.json",
    "zero3_offload": "zero3_offload.json",
}
REL_FP32 = 1e-3
"""DeepSpeed reduces and partitions in its own order: fp32 curves agree to ~1e-5; 1e-3 is the bound."""
REL_QLORA = 1e-2
REL_BF16 = 2e-2
"""bf16 vs fp32 on the tiny model over 2 steps: losses within 2% (measured figures: bench/RESULTS.md)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir, tiny_reward_dir):
    root = tmp_path_factory.mktemp("dist_gpu")
    return root, write_data(root / "data"), tiny_model_dir, tiny_reward_dir


def argv(setup, stage: str, accum: int, ranks: int, name: str, *extra: str) -> list[str]:
    root, data, model, reward = setup
    batch = (8 if stage == "ppo" else 4) // ranks
    return stage_argv(stage, accum, batch, root / name, data, model, reward) + list(extra)


def run(setup, specs: list[dict], name: str, ranks: int) -> Path:
    folder = setup[0] / name
    launch(specs, folder, ranks, torchrun=True)
    return folder


def deepspeed(config: str) -> list[str]:
    return [
        "--distributed.engine",
        "deepspeed",
        "--distributed.deepspeed_config",
        str(ROOT / "deepspeed_configs" / ZERO[config]),
    ]


def assert_same(got: Path, want: Path, stage: str, rel: float) -> None:
    a, b = figures(got, stage), figures(want, stage)
    for key in LOSS_KEYS[stage]:
        assert a[key] == pytest.approx(b[key], rel=rel), key


_ONE_GPU: dict[tuple[str, int], Path] = {}


def one_gpu(setup, stage: str, accum: int) -> Path:
    """The plain one-GPU reference of (stage, accum), run once for all three ZeRO configs (each
    launch costs a Python, torch and DeepSpeed start-up: run_scripts/gpu_check.sh has a budget)."""
    if (stage, accum) not in _ONE_GPU:
        name = f"one-{stage}-{accum}"
        _ONE_GPU[stage, accum] = run(
            setup, [{"stage": stage, "argv": argv(setup, stage, accum, 1, f"{name}/{stage}")}], name, 1
        )
    return _ONE_GPU[stage, accum]


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("stage", ["sft", "rm"])
@pytest.mark.parametrize("zero", list(ZERO))
def test_zero_equals_one_gpu(zero, stage, accum, setup):
    """grad_accum 4 is the case accelerate got wrong before `micro_step`: outside `accumulate`
    DeepSpeed's engine stepped after every micro-batch."""
    name = f"{zero}-{stage}-{accum}"
    one = one_gpu(setup, stage, accum)
    got = run(
        setup,
        [{"stage": stage, "argv": argv(setup, stage, accum, RANKS, f"{name}-ds/{stage}", *deepspeed(zero))}],
        f"{name}-ds",
        RANKS,
    )
    assert_same(got / stage, one / stage, stage, REL_FP32)


def test_ppo_under_zero3_equals_one_gpu(setup):
    one = run(setup, [{"stage": "ppo", "argv": argv(setup, "ppo", 1, 1, "ppo-one/ppo")}], "ppo-one", 1)
    got = run(
        setup,
        [{"stage": "ppo", "argv": argv(setup, "ppo", 1, RANKS, "ppo-z3/ppo", *deepspeed("zero3"))}],
        "ppo-z3",
        RANKS,
    )
    assert_same(got / "ppo", one / "ppo", "ppo", REL_FP32)
    assert (got / "ppo" / "merged" / "manifest.json").is_file()


@pytest.mark.parametrize(
    "engine", ["zero2"]
)  # ZeRO-3 and FSDP2 refuse 4-bit weights up front (test_zero_cpu.py, test_fsdp.py)
def test_qlora_trains_under_sharding_and_tracks_one_gpu(engine, setup):
    qlora = ["--model.finetuning", "qlora", "--model.dtype", "bf16", "--train.precision", "bf16"]
    one = run(
        setup,
        [{"stage": "sft", "argv": argv(setup, "sft", 1, 1, f"qlora-{engine}-one/sft", *qlora)}],
        f"qlora-{engine}-one",
        1,
    )
    flags = deepspeed(engine)
    got = run(
        setup,
        [{"stage": "sft", "argv": argv(setup, "sft", 1, RANKS, f"qlora-{engine}/sft", *qlora, *flags)}],
        f"qlora-{engine}",
        RANKS,
    )
    assert_same(got / "sft", one / "sft", "sft", REL_QLORA)
    assert merged_weights(got / "sft")


def test_bf16_tracks_fp32(setup):
    runs = {}
    for precision in ("fp32", "bf16"):
        extra = ["--train.precision", precision, "--model.dtype", precision]
        runs[precision] = run(
            setup,
            [{"stage": "sft", "argv": argv(setup, "sft", 1, 1, f"prec-{precision}/sft", *extra)}],
            f"prec-{precision}",
            1,
        )
    a, b = figures(runs["bf16"] / "sft", "sft"), figures(runs["fp32"] / "sft", "sft")
    assert a["train/loss"] == pytest.approx(b["train/loss"], rel=REL_BF16)
    (setup[0] / "bf16-vs-fp32.json").write_text(json.dumps({"bf16": a, "fp32": b}))


def test_resuming_a_zero3_run_is_refused_up_front(setup):
    """A ZeRO checkpoint holds rank 0's optimizer share only, so resuming one is refused in the
    config problems (before any model loads) with the way that works."""
    from pipeline.config import ConfigError, load_config
    from stages.sft import SFTStage

    flags = deepspeed("zero3")
    folder = run(
        setup,
        [{"stage": "sft", "argv": argv(setup, "sft", 1, RANKS, "z3-stop/sft", *flags), "stop_after": 1}],
        "z3-stop",
        RANKS,
    )
    assert (folder / "sft" / "checkpoints").is_dir()
    stage = SFTStage(load_config(SFTStage.config_class, argv(setup, "sft", 1, RANKS, "z3-stop/sft", *flags)))
    with pytest.raises(ConfigError) as err:
        stage.validate()
    assert any(
        p.startswith("checkpoint.resume: resuming a distributed.engine deepspeed run is not supported")
        for p in err.value.problems
    )
