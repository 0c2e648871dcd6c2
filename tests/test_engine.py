"""The stage engine: accumulation on accelerate's mechanism in every stage, the stage registry,
backends loaded only when asked for, and a new stage built from nothing but the listed parts."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from stagerun import run_stage
from test_pt_sft import fresh_accelerate_state  # noqa: F401 (autouse fixture)

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class SyncRecorder:
    """Records `accelerator.sync_gradients` at every backward of a stage."""

    def __init__(self, monkeypatch):
        from accelerate import Accelerator

        self.flags: list[bool] = []
        original = Accelerator.backward

        def backward(accelerator, loss, **kwargs):
            self.flags.append(accelerator.sync_gradients)
            return original(accelerator, loss, **kwargs)

        monkeypatch.setattr(Accelerator, "backward", backward)


@pytest.mark.parametrize("stage", ["sft", "rm", "ppo"])
def test_gradients_sync_once_per_optimizer_step(tmp_path, tiny_model_dir, tiny_reward_dir, stage, monkeypatch):
    """With train.grad_accum 2, every stage's first micro-batch runs with sync_gradients False and
    the last with True: DDP/FSDP reduce once and DeepSpeed's engine (which steps whenever it is
    True) steps once per optimizer step. Before, no stage entered accelerate's accumulate(), so
    it was True on every micro-batch."""
    recorder = SyncRecorder(monkeypatch)
    common = [
        "--output_dir",
        str(tmp_path / stage),
        "--train.max_steps",
        "2",
        "--train.batch_size",
        "2",
        "--train.grad_accum",
        "2",
        "--train.eval_steps",
        "0",
        "--lora.r",
        "4",
        "--checkpoint.resume",
        "false",
        "--tracking.trackers",
        "[]",
    ]
    if stage == "sft":
        from stages.sft import SFTStage as cls

        data = _jsonl(
            tmp_path / "c.jsonl",
            [
                {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": "A."}]}
                for i in range(8)
            ],
        )
        argv = ["--model.path", str(tiny_model_dir), "--data.train", f"[{data}]", "--data.eval", "[]"]
        per_step = [False, True]
    elif stage == "rm":
        from stages.reward import RMStage as cls

        data = _jsonl(
            tmp_path / "p.jsonl",
            [{"question": f"Q{i}?", "response_chosen": "Yes.", "response_rejected": "No."} for i in range(8)],
        )
        argv = ["--model.path", str(tiny_reward_dir), "--data.train", f"[{data}]", "--data.eval", "[]"]
        per_step = [False, True]
    else:
        from stages.ppo import PPOStage as cls

        data = _jsonl(tmp_path / "q.jsonl", [{"prompt": f"Question {i}?"} for i in range(8)])
        argv = [
            "--model.path",
            str(tiny_model_dir),
            "--reward_model.path",
            str(tiny_reward_dir),
            "--data.train",
            f"[{data}]",
            "--data.eval",
            "[]",
            "--generation.max_new_tokens",
            "3",
            "--ppo.epochs",
            "1",
            "--ppo.mini_batch_size",
            "2",
        ]
        per_step = [False, False, True, True]  # one process: the policy and the critic each run a backward
    run_stage(cls, load_config(cls.config_class, common + argv))
    assert recorder.flags == per_step * 2


def test_the_registry_names_every_stage_and_its_script():
    import stages
    from pipeline.engine.stage import Stage

    assert list(stages.STAGES)[:4] == ["pt", "sft", "rm", "ppo"] and "dpo" in stages.STAGES
    for name in stages.STAGES:
        cls = stages.stage_class(name)
        assert issubclass(cls, Stage) and cls.name == name
        assert stages.script(name).is_file()
        assert stages.config_class(name) is cls.config_class


def test_backends_load_only_when_the_config_asks(tmp_path, tiny_model_dir):
    """A LoRA run on ddp imports neither DeepSpeed nor bitsandbytes (both are installed here, and
    accelerate/peft import them on sight): no 'Setting accelerator to CPU' line, no kernel hints."""
    data = _jsonl(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]}] * 4,
    )
    argv = [
        "--model.path", str(tiny_model_dir), "--data.train", f"[{data}]", "--data.eval", "[]",
        "--output_dir", str(tmp_path / "o"), "--train.max_steps", "1", "--train.batch_size", "2",
        "--tracking.trackers", "[]",
    ]  # fmt: skip
    code = (
        "import sys; from stages.sft import SFTStage; from pipeline.engine.stage_main import main; "
        f"rc = main(SFTStage, {argv!r}); "
        "print('LOADED', sorted(k for k in ('deepspeed', 'bitsandbytes') if sys.modules.get(k)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "PATH": "/usr/bin:/bin",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(ROOT),
            "TMPDIR": tempfile.gettempdir(),  # the run's (torch makes its compile cache folder there at import)
        },
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOADED []" in done.stdout
    assert "Setting accelerator to CPU" not in done.stderr


def test_a_new_stage_provides_only_its_own_parts(tmp_path, tiny_model_dir, monkeypatch):
    """A toy stage written from ARCHITECTURE.md's list (config, build_data, train_step, evaluate,
    state_dict/load_state_dict) gets validation, checkpoints, an exact resume, the final export
    and summary.json from the engine."""
    from pipeline.config import StageConfig, TextDataConfig
    from pipeline.engine.stage import Stage
    from pipeline.engine.steps import micro_step

    class ToyStage(Stage):
        """Trains the model to give token 7 a high logit after token 5; counts its steps itself."""

        name = "toy"
        config_class = StageConfig

        def __init__(self, cfg):
            super().__init__(cfg)
            self.counter = 0

        def build_data(self):
            self.train_samples = [torch.tensor([[5, 6, 5, 6]])] * 4
            return []

        def train_step(self):
            (group,) = self.next_sample_indices()
            ids = self.train_samples[group[0]]
            with micro_step(self.accelerator, self.model, 0, 1):
                loss = -self.model(input_ids=ids).logits[0, :, 7].log_softmax(-1).mean()
                self.accelerator.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.counter += 1
            return {"train/loss": float(loss)}

        def evaluate(self):
            return {"eval/counter": float(self.counter)}

        def state_dict(self):
            return {"counter": self.counter}

        def load_state_dict(self, state):
            self.counter = state["counter"]

    cfg = StageConfig(output_dir=str(tmp_path / "toy"))
    cfg.data = TextDataConfig(train=[str(_jsonl(tmp_path / "d.jsonl", [{"text": "x"}]))], eval=[])
    cfg.model.path, cfg.train.max_steps, cfg.train.eval_steps, cfg.lora.r = str(tiny_model_dir), 4, 2, 4
    cfg.tracking.trackers = []
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "2")
    first = run_stage(ToyStage, cfg)
    assert first.step == 2 and first.final_summary is None
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    resumed = run_stage(ToyStage, cfg)
    assert resumed.counter == 4 and [e["eval/counter"] for e in resumed.history.evals] == [2.0, 4.0]
    assert (tmp_path / "toy" / "merged" / "manifest.json").is_file()
    assert json.loads((tmp_path / "toy" / "summary.json").read_text())["steps"] == 4
