"""Config sanity in every stage, all at once (issue 12, point 6): values that would train nothing
(a seq_length too short to supervise anything, a zero learning rate, PPO's batch arithmetic) are
listed with every other problem before a model loads; a run whose loss climbs far above its
start or whose weights blow up stops as diverged and publishes nothing; a non-finite step is
one line naming the step's samples."""

from __future__ import annotations

import json
import math

import pytest
import torch
from stagerun import run_stage
from test_pt_sft import fresh_accelerate_state, sft_args, write_sft  # noqa: F401 (autouse fixture)

from pipeline.config import ConfigError, StageConfig, TextDataConfig
from pipeline.engine.divergence import Diverged, loss_divergence, weight_divergence
from pipeline.engine.stage import Stage
from pipeline.engine.stage_main import main
from pipeline.engine.steps import micro_step


def no_model_loads(monkeypatch):
    import pipeline.modeling.models as models

    monkeypatch.setattr(
        models, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a model was loaded"))
    )


def test_pt_seq_length_1_and_a_zero_lr_are_listed_together(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from stages.pretrain import PTStage

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 10}) + "\n" for i in range(8)))
    no_model_loads(monkeypatch)
    code = main(
        PTStage,
        [
            "--model.path",
            str(tiny_model_dir),
            "--data.train",
            f"[{data}]",
            "--output_dir",
            str(tmp_path / "pt"),
            "--train.seq_length",
            "1",
            "--train.learning_rate",
            "0",
        ],
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert (
        "train.seq_length: 1 token leaves nothing to predict" in err
        and "train.learning_rate: must be > 0, got 0.0" in err
    )
    assert not (tmp_path / "pt").exists()


def test_config_problems_are_said_once_by_rank_0(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Every rank of a launch finds the same problems: rank 0 prints them, the others only exit 2
    (under --nproc 2 each was printed twice, interleaved)."""
    from stages.sft import SFTStage

    argv = ["--model.path", str(tiny_model_dir), "--output_dir", str(tmp_path / "o"), "--train.batch_size", "0"]
    for rank, said in (("1", ""), ("0", "train.batch_size: must be > 0, got 0")):
        monkeypatch.setenv("RANK", rank)
        assert main(SFTStage, argv) == 2
        err = capsys.readouterr().err
        assert (said in err) if said else err == "", err


def test_sft_whose_every_label_is_masked_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    from stages.sft import SFTStage

    train, valid = write_sft(tmp_path / "data", 6, 2)
    sft_data_every_label_masked = []
    real = SFTStage.build_data

    def masked(self):
        problems = real(self)
        for sample in self.train_samples:
            sample["labels"] = [-100] * len(sample["labels"])
            sft_data_every_label_masked.append(sample)
        return problems

    monkeypatch.setattr(SFTStage, "build_data", masked)
    no_model_loads(monkeypatch)
    with pytest.raises(ConfigError, match="no training sample has a token to learn"):
        run_stage(SFTStage, sft_args(tiny_model_dir, train, valid, tmp_path / "sft"))
    assert sft_data_every_label_masked


def test_ppo_lists_its_problems_like_every_stage_without_a_zero_division(
    tiny_model_dir, tiny_reward_dir, tmp_path, monkeypatch, capsys
):
    from stages.ppo import PPOStage

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    no_model_loads(monkeypatch)
    code = main(
        PPOStage,
        [
            "--model.path",
            str(tiny_model_dir),
            "--reward_model.path",
            str(tiny_reward_dir),
            "--data.train",
            f"[{prompts}]",
            "--output_dir",
            str(tmp_path / "ppo"),
            "--train.batch_size",
            "0",
            "--ppo.mini_batch_size",
            "0",
            "--ppo.epochs",
            "0",
            "--generation.max_new_tokens",
            "0",
            "--generation.temperature",
            "0",
            "--ppo.cliprange",
            "-1",
        ],
    )
    err = capsys.readouterr().err
    assert code == 2 and "ZeroDivisionError" not in err and "Traceback" not in err
    for expected in (
        "train.batch_size: must be > 0",
        "ppo.mini_batch_size: must be >= 1",
        "ppo.epochs: must be >= 1",
        "generation.max_new_tokens: must be >= 1",
        "generation.temperature: must be > 0",
        "ppo.cliprange: must be > 0",
    ):
        assert expected in err, expected


def test_divergence_rules():
    from pipeline.config.sections import DivergenceConfig

    cfg = DivergenceConfig(window=3, loss_ratio=2.0)
    vocab = 49152
    stuck = [2.5, 2.4, 2.6] + [math.log(vocab)] * 3  # a LoRA run that fell to the uniform distribution
    assert "4.3x the first 3 steps' 2.500" in loss_divergence(stuck, cfg)
    assert loss_divergence([2.5, 2.4, 2.6, 2.2, 2.0, 1.9], cfg) is None
    assert loss_divergence(stuck[:5], cfg) is None  # not enough steps yet
    assert weight_divergence(6e10, cfg).startswith("a trainable weight reached magnitude 6e+10")
    assert weight_divergence(float("nan"), cfg) is not None and weight_divergence(3.0, cfg) is None


class ToyStage(Stage):
    """One LoRA step per optimizer step on a fixed batch; `blow_up` scales the trained weights
    after step 3, `losses` replaces the reported loss curve."""

    name = "toy"
    config_class = StageConfig
    losses: list = []
    blow_up = False

    def build_data(self):
        self.train_samples = [torch.tensor([[5, 6, 5, 6]])] * 4
        return []

    def train_step(self):
        (group,) = self.next_sample_indices()
        with micro_step(self.accelerator, self.model, 0, 1):
            loss = -self.model(input_ids=self.train_samples[group[0]]).logits[0, :, 7].log_softmax(-1).mean()
            self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.blow_up and self.step == 3:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.requires_grad:
                        p.mul_(1e12)
        return {"train/loss": self.losses[self.step] if self.losses else float(loss)}


def toy_cfg(tmp_path, tiny_model_dir):
    cfg = StageConfig(output_dir=str(tmp_path / "toy"))
    cfg.data = TextDataConfig(train=[str(tmp_path / "d.jsonl")], eval=[])
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    cfg.model.path, cfg.train.max_steps, cfg.train.eval_steps, cfg.lora.r = str(tiny_model_dir), 12, 0, 4
    cfg.train.divergence.window, cfg.tracking.trackers = 3, []
    return cfg


@pytest.mark.parametrize("how", ["loss", "weights"])
def test_a_diverged_run_stops_and_publishes_nothing(how, tiny_model_dir, tmp_path, monkeypatch):
    from pipeline.config import KeepPolicy

    monkeypatch.setattr(ToyStage, "losses", [2.5, 2.4, 2.6, 6.0, 10.8, 10.8, 10.8, 10.8] if how == "loss" else [])
    monkeypatch.setattr(ToyStage, "blow_up", how == "weights")
    cfg = toy_cfg(tmp_path, tiny_model_dir)
    cfg.checkpoint.keep = [KeepPolicy(every=2)]
    with pytest.raises(Diverged) as err:
        run_stage(ToyStage, cfg)
    step = 6 if how == "loss" else 4
    assert str(err.value).startswith(f"diverged at step {step}: ")
    assert f"the last checkpoint is {tmp_path / 'toy' / 'checkpoints' / f'step-{step - 2:07d}'}" in str(err.value)
    assert not (tmp_path / "toy" / "merged").exists() and not (tmp_path / "toy" / "adapter").exists()
    cfg.train.divergence.enabled = False
    monkeypatch.setattr(ToyStage, "losses", [2.5] * 12 if how == "loss" else [])
    monkeypatch.setattr(ToyStage, "blow_up", False)
    cfg.checkpoint.resume_changed = True
    assert run_stage(ToyStage, cfg).step == 12  # the check is configurable


def test_a_non_finite_step_is_one_line_naming_its_samples(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import pipeline.engine.steps as steps
    from stages.sft import SFTStage

    real = steps.weighted_token_losses
    monkeypatch.setattr(
        steps,
        "weighted_token_losses",
        lambda *a, **k: (lambda o, loss, t: (o * float("nan"), loss * float("nan"), t))(*real(*a, **k)),
    )
    train, valid = write_sft(tmp_path / "data", 6, 2)
    code = main(SFTStage, sft_args(tiny_model_dir, train, valid, tmp_path / "sft", "--tracking.trackers", "[]"))
    printed = capsys.readouterr().err
    lines = [line for line in printed.splitlines() if line.strip() and "%|" not in line]
    assert code == 1 and "Traceback" not in printed and len(lines) == 1
    assert lines[0].startswith("sft: step 1: loss is nan; stopping before the optimizer step")
    assert "the step's samples: " in lines[0] and f"{train}/" in lines[0] and ".jsonl:" in lines[0]
