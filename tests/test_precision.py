"""Master weights: full fine-tuning under bf16 autocast keeps fp32 trainable weights and optimizer
state (as DeepSpeed does), so a small learning rate's update is not rounded away; 'bf16-pure'
keeps the loaded dtype."""

from __future__ import annotations

import json

import pytest
import torch
from stagerun import run_stage

from pipeline.config import load_config
from pipeline.engine.precision import fp32_masters, keeps_masters


def _sgd_step(weight: torch.nn.Parameter, lr: float) -> None:
    weight.grad = torch.ones_like(weight)
    torch.optim.SGD([weight], lr=lr).step()


def test_a_small_update_that_pure_bf16_loses():
    pure = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    _sgd_step(pure, 1e-3)
    assert torch.equal(pure.data, torch.ones(4, dtype=torch.bfloat16))  # 1 - 1e-3 rounds back to 1 in bf16
    layer = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    frozen = torch.nn.Linear(4, 4).to(torch.bfloat16).requires_grad_(False)
    assert fp32_masters(torch.nn.ModuleList([layer, frozen])) == 1
    assert layer.weight.dtype == torch.float32 and frozen.weight.dtype == torch.bfloat16
    _sgd_step(layer.weight, 1e-3)
    assert torch.allclose(layer.weight, torch.full((4, 4), 0.999))


@pytest.mark.parametrize(
    "precision,mixed,want",
    [
        ("auto", "bf16", True),
        ("bf16", "bf16", True),
        ("fp16", "fp16", True),
        ("bf16-pure", "bf16", False),
        ("fp32", "no", False),
        ("auto", "no", False),
    ],
)
def test_which_precisions_keep_masters(precision, mixed, want):
    assert keeps_masters(precision, mixed) is want


@pytest.fixture
def fresh_accelerate():
    """accelerate keeps one mixed precision per process: an earlier test's state would refuse bf16,
    and this test's bf16 would refuse a later test's fp32."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_full_fine_tuning_on_a_bf16_model_trains_fp32_masters_unless_pure(
    precision, tiny_model_dir, tmp_path, fresh_accelerate
):
    from stages.pretrain import PTConfig, PTStage

    docs = tmp_path / "pt.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " + "lorem ipsum " * 3}) + "\n" for i in range(8)))
    cfg = load_config(
        PTConfig,
        [
            "--model.path",
            str(tiny_model_dir),
            "--model.finetuning",
            "full",
            "--model.dtype",
            "bf16",
            "--train.precision",
            precision,
            "--data.train",
            f"[{docs}]",
            "--data.eval",
            "[]",
            "--output_dir",
            str(tmp_path / "pt"),
            "--train.max_steps",
            "1",
            "--train.seq_length",
            "32",
            "--train.batch_size",
            "2",
            "--train.learning_rate",
            "1e-6",
            "--train.eval_steps",
            "0",
            "--checkpoint.save_interval",
            "1000h",
        ],
    )
    seen = []
    run_stage(
        PTStage,
        cfg,
        on_step=lambda stage, record: seen.append(
            (
                {p.dtype for p in stage.model.parameters() if p.requires_grad},
                {s.dtype for s in stage.optimizer.state_dict()["state"][0].values() if s.dim() > 0},
            )
        ),
    )
    want = torch.float32 if precision == "bf16" else torch.bfloat16
    assert seen == [({want}, {want})]  # weights and AdamW's moments
