"""Distillation in a chain: `teacher.path: stage:NAME` names a chain stage's merged model, the driver
passes it as --teacher.path, a rebuilt teacher makes the distilled model stale, and the shipped
configs/pipeline_distill.yaml is the demo's chain plus distill.

The driver test runs the bash driver over [sft, rm, ppo, distill]: the first three are
tests/test_driver.py's stand-in stage (seconds), distill is the real stage on tiny models.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file
from test_distill import fresh_state  # noqa: F401
from test_driver import FAKE_STAGE, ROOT, run_driver

from pipeline.config import ConfigError, load_config
from pipeline.modeling.manifest import read_manifest, weights_hash, write_manifest
from pipeline.tools.chain import checks_after, checks_before, stage_argv, stage_config_problems, stage_status
from pipeline.tools.chain_config import DriverError, PipelineConfig, load_pipeline, model_ref_problems, stage_config

DEMO_STAGES = ("pt", "sft", "rm", "ppo")


def test_shipped_chain_is_the_demo_plus_distill_with_ppo_as_teacher(tmp_path):
    cfg, _ = load_pipeline(str(ROOT / "configs" / "pipeline_distill.yaml"), [])
    demo, _ = load_pipeline(str(ROOT / "configs" / "demo.yaml"), [])
    assert cfg.chain == [*DEMO_STAGES, "distill"] and cfg.output_root == demo.output_root
    # the same stages and settings as the demo: after the demo, only distill runs
    assert all(stage_config(cfg, s) == stage_config(demo, s) for s in DEMO_STAGES)
    assert stage_config(cfg, "distill")["teacher"]["path"] == "stage:ppo"
    assert stage_config_problems(cfg, cfg.chain) == []
    cfg.output_root = str(tmp_path)
    argv = stage_argv(cfg, "distill")
    assert argv[argv.index("--teacher.path") + 1] == str((tmp_path / "ppo/merged").resolve())
    assert argv[argv.index("--model.path") + 1] == str((tmp_path / "sft/merged").resolve())
    assert "--reward_model.path" not in argv


def test_a_stage_reference_that_cannot_resolve_is_refused_in_one_line():
    def refs(chain, teacher, **enabled):
        cfg = PipelineConfig(chain=list(chain), reward_model="/rm")
        cfg.stages.distill.overrides = {"teacher": {"path": teacher}}
        for name, on in enabled.items():
            getattr(cfg.stages, name).enabled = on
        return model_ref_problems(cfg)

    assert refs(["sft", "rm", "ppo", "distill"], "stage:ppo") == []
    assert refs(["sft", "distill"], "/any/folder") == []
    assert refs(["sft", "distill"], "stage:ppo") == [
        "stages.distill: teacher.path: 'stage:ppo' names no stage of the chain (sft, distill)"
    ]
    assert refs(["sft", "distill", "grpo"], "stage:grpo") == [
        "stages.distill: teacher.path: 'stage:grpo': grpo must come before distill in the chain"
    ]
    assert refs(["sft", "rm", "distill"], "stage:rm") == [
        "stages.distill: teacher.path: 'stage:rm': rm trains a reward model, not a generator"
    ]
    assert refs(["sft", "grpo", "distill"], "stage:grpo", grpo=False) == [
        "stages.distill: teacher.path: 'stage:grpo': stages.grpo is disabled"
    ]


def test_a_stage_reference_outside_the_driver_is_refused_in_one_line(tiny_model_dir):
    from stages.distill import DistillConfig

    with pytest.raises(ConfigError) as err:
        load_config(DistillConfig, ["--model.path", str(tiny_model_dir), "--teacher.path", "stage:ppo"])
    assert [p for p in err.value.problems if p.startswith("teacher.path")] == [
        "teacher.path: 'stage:ppo' names a chain stage's model, which only `relay pipeline` resolves; "
        "a stage run alone needs a model folder"
    ]


def _distill_chain(tmp: Path, base: Path) -> tuple[Path, Path]:
    """[sft, rm, ppo, distill] of tests/test_driver.py's stand-in stage (it records the teacher it is given)."""
    scripts, root = tmp / "scripts", tmp / "out"
    scripts.mkdir(parents=True)
    stages = {}
    for stage, script in (("sft", "sft"), ("rm", "reward"), ("ppo", "ppo"), ("distill", "distill")):
        (scripts / f"{script}.py").write_text(FAKE_STAGE)
        stages[stage] = {"config": {"train": {"max_steps": 2}}, "script": str(scripts / f"{script}.py")}
    stages["distill"]["overrides"] = {"teacher": {"path": "stage:ppo"}}
    config = {
        "base_model": str(base),
        "output_root": str(root),
        "chain": ["sft", "rm", "ppo", "distill"],
        "finetuning": "lora",
        "report": False,
        "stages": stages,
    }
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, root


def _retrain(folder: Path) -> None:
    """Stand in for a retrained model: new weights and a manifest consistent with them."""
    recorded = read_manifest(folder)
    tensors = {k: (v + np.float32(0.5)).astype(v.dtype) for k, v in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    write_manifest(folder, stage=recorded["stage"], parent=recorded["parent_path"], config=recorded["config"])


@pytest.mark.usefixtures("fresh_state")
def test_the_driver_hands_the_chains_rl_model_to_distill_as_teacher(tmp_path, tiny_model_dir):
    """The bash driver over stand-ins passes PPO's merged folder as --teacher.path; the real distill
    stage on the driver's command line records that teacher, so the driver counts it done; a
    retrained teacher makes it stale."""
    from stagerun import run_stage

    from stages.distill import DistillStage

    config, root = _distill_chain(tmp_path, tiny_model_dir)
    fake_log = tmp_path / "fake.log"
    result = run_driver(config, fake_log)
    assert result.returncode == 0, result.stderr[-4000:]
    calls = [json.loads(line) for line in fake_log.read_text().splitlines()]
    assert [c["stage"] for c in calls] == ["sft", "reward", "ppo", "distill"]
    argv = calls[-1]["argv"]
    teacher, student = (root / "ppo/merged").resolve(), (root / "sft/merged").resolve()
    assert argv[argv.index("--teacher.path") + 1] == str(teacher)
    assert argv[argv.index("--model.path") + 1] == str(student) and "--reward_model.path" not in argv

    # the real stage (1 LoRA step on tiny data) in place of the stand-in, on the driver's argv
    cfg, _ = load_pipeline(str(config), [])
    shutil.rmtree(root / "distill")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count to {i}"}) + "\n" for i in range(2)))
    cfg.stages.distill.script = None
    cfg.stages.distill.config = {
        "model": {"dtype": "fp32"},
        "lora": {"r": 4, "alpha": 8},
        "data": {"train": [str(prompts)], "eval": [], "completions": []},
        "train": {"max_steps": 1, "batch_size": 2, "seq_length": 64, "eval_steps": 0, "precision": "fp32"},
        "generation": {"max_new_tokens": 4},
        "checkpoint": {"save_interval": "1000h"},
    }
    assert checks_before(cfg, "distill") == []
    argv = stage_argv(cfg, "distill")
    assert argv[0] == "stages/distill.py" and argv[argv.index("--teacher.path") + 1] == str(teacher)
    stage = run_stage(DistillStage, argv[1:])
    assert stage.history.steps[-1]["distill/kl"] > 0
    assert read_manifest(root / "distill/merged")["teacher"] == {
        "path": str(teacher),
        "weights_hash": weights_hash(teacher),
        "loss_type": "jsd",
        "top_k": 0,
        "backend": "relay",
    }
    assert stage_status(cfg, "distill") == "done" and checks_after(cfg, "distill") == []

    before = weights_hash(teacher)
    _retrain(teacher)
    problem = checks_after(cfg, "distill")[0]
    assert problem == str(pytest.raises(DriverError, stage_status, cfg, "distill").value)
    assert problem.startswith(f"{root / 'distill/merged'} is stale: the teacher changed since DISTILL ran")
    assert before in problem and weights_hash(teacher) in problem
