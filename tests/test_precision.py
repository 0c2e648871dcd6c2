"""Master weights: full fine-tuning under bf16 autocast keeps fp32 trainable weights and optimizer
state (as DeepSpeed does), so a small learning rate's update is not rounded away; 'bf16-pure'
keeps the loaded dtype."""

from __future__ import annotations

import json

import pytest
import torch
from stagerun import fresh_accelerate, run_stage

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
def accelerate_state_restored():
    """accelerate keeps one mixed precision per process: an earlier test's state would refuse bf16,
    and this test's bf16 would refuse a later test's fp32."""
    fresh_accelerate()
    yield
    fresh_accelerate()


def pt_cfg(model, folder, precision: str, dtype: str = "bf16"):
    """One step of full-weight PT on the tiny model at `precision`, the model loaded in `dtype`."""
    from stages.pretrain import PTConfig

    docs = folder / "pt.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " + "lorem ipsum " * 3}) + "\n" for i in range(8)))
    return load_config(
        PTConfig,
        [
            "--model.path",
            str(model),
            "--model.finetuning",
            "full",
            "--model.dtype",
            dtype,
            "--train.precision",
            precision,
            "--data.train",
            f"[{docs}]",
            "--data.eval",
            "[]",
            "--output_dir",
            str(folder / f"pt-{precision}"),
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


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_full_fine_tuning_on_a_bf16_model_trains_fp32_masters_unless_pure(
    precision, tiny_model_dir, tmp_path, accelerate_state_restored
):
    from stages.pretrain import PTStage

    cfg = pt_cfg(tiny_model_dir, tmp_path, precision)
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


def test_in_process_runs_of_two_precisions_run_back_to_back(tiny_model_dir, tmp_path, accelerate_state_restored):
    """An fp32 run, then a bf16 one in the same process (the GPU tests run PPO so): each in-process
    run starts from accelerate's state as a launch of its own does (accelerate refused the second
    precision: 'AcceleratorState has already been initialized', first met by the GPU check's PPO tests)."""
    from stages.pretrain import PTStage

    for precision in ("fp32", "bf16"):
        stage = run_stage(PTStage, pt_cfg(tiny_model_dir, tmp_path, precision, dtype=precision))
        assert stage.step == 1 and stage.accelerator.mixed_precision == ("no" if precision == "fp32" else "bf16")
