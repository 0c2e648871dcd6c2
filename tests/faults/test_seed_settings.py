"""Settings the seed documents describe (MFTCoder's multitask options, MedicalGPT's data options,
Levanter's schedule, checkpoint and tracker settings) that passed `relay validate` and then failed
mid-run with a traceback, or did nothing: each is now one line among the config's problems, found
before any model loads; the settings the seeds spell their own way (`max_samples: -1`) do what
the seed says."""

from __future__ import annotations

import pytest
from test_pt_sft import fresh_accelerate_state, sft_args, write_sft  # noqa: F401 (autouse fixture)

from pipeline.algorithms.multitask import MultitaskConfig
from pipeline.config import (
    ChatDataConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    KeepPolicy,
    TrackingConfig,
    TrainConfig,
    load_config,
)
from pipeline.engine.stage_checks import early_stopping_problems


@pytest.mark.parametrize(
    "settings,problem",
    [
        (
            {"lr_schedule": "inv_sqrt", "min_lr_ratio": 0.0, "warmup": 0.5},
            "train.lr_schedule: inv_sqrt needs min_lr_ratio > 0",
        ),
        ({"warmup": 3, "decay": 3}, "train: cycle 0 has 4 steps, fewer than warmup (3) + decay (3)"),
        ({"cycle_length": [3, 3]}, "train.cycle_length: the cycle lengths add up to 6, more than the 4 steps"),
        ({"cycles": [3, 2]}, "train.cycles: cycle ends must increase inside (0, 4], got [3, 2, 4]"),
    ],
    ids=["inv_sqrt-to-zero", "warmup+decay", "cycle-lengths", "cycle-ends"],
)
def test_a_schedule_that_cannot_be_built_is_a_config_problem(settings, problem):
    """Levanter's schedule settings were checked when the scheduler was built, after the data, or
    at the first decay step (inv_sqrt to 0: one step trained, then a traceback and no checkpoint)."""
    found = TrainConfig(max_steps=4, **settings).problems()
    assert [p for p in found if p.startswith(problem)], found
    assert TrainConfig(max_steps=4, lr_schedule="inv_sqrt", min_lr_ratio=0.1, warmup=0.5).problems() == []
    # beside other problems of the section, not only once they are fixed
    assert len(TrainConfig(max_steps=4, batch_size=0, **settings).problems()) == 2


def test_keep_rules_out_of_order_are_refused_as_levanter_refuses_them():
    """A rule after one that runs to the end, or one whose `until` is not above the previous one,
    never applied: steps 1 and 2 were not kept under [{every: 3}, {every: 1, until: 2}]."""
    assert CheckpointConfig(keep=[KeepPolicy(every=3), KeepPolicy(every=1, until=2)]).problems() == [
        "checkpoint.keep[0]: only the last rule may run to the end (until: null); the rules after it would never "
        "apply (Levanter's rule)"
    ]
    assert CheckpointConfig(keep=[KeepPolicy(every=1, until=5), KeepPolicy(every=2, until=3)]).problems() == [
        "checkpoint.keep[1].until: 3 must be above the previous rule's (5): rules are in order of until "
        "(Levanter's rule)"
    ]
    assert CheckpointConfig(keep=[KeepPolicy(every=1, until=-5)]).problems() == [
        "checkpoint.keep[0].until: must be a step >= 1 (or null: to the end), got -5"
    ]
    assert CheckpointConfig(keep=[KeepPolicy(every=1, until=5), KeepPolicy(every=10)]).problems() == []


def test_wandb_without_wandb_is_a_config_problem(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert TrackingConfig(trackers=["tensorboard", "wandb"]).problems() == [
        "tracking.trackers has 'wandb' but wandb is not installed: pip install wandb"
    ]


def test_data_settings_the_seeds_spell_their_way():
    """MedicalGPT's `max_train_samples: -1` means every record (it kept all but the last); other
    values below 1, a held-out split given twice, and role markers the chat template never reads
    are refused."""
    assert DataConfig(train=["a"], max_samples=-1).problems() == [] and DataConfig(max_samples=-1).record_limit is None
    assert DataConfig(train=["a"], max_samples=-5).problems() == [
        "data.max_samples: must be >= 1, or null / -1 for every record, got -5"
    ]
    assert DataConfig(train=["a"], eval=["b"], eval_fraction=0.5).problems() == [
        "data: give data.eval or data.eval_fraction, not both (the fraction would carve nothing)"
    ]
    marked = ChatDataConfig(train=["a"], role_markers={"system": "S", "user": "U", "assistant": "A", "tool": "T"})
    assert marked.problems() == [
        "data.role_markers: no role 'tool'; markers are for system, user and assistant",
        "data.role_markers: read only with data.template: role_markers (the chat template writes its own turn "
        "markers); set the template, or leave role_markers out",
    ]
    assert ChatDataConfig(train=["a"], role_layout="code").problems()[0].startswith("data.role_layout: read only")
    assert ChatDataConfig(train=["a"], template="role_markers", role_layout="code").problems() == []


def test_task_weights_outside_case3_are_refused():
    assert MultitaskConfig(weighted_loss_mode="coba", task_weights={"code": 5.0}).problems() == [
        "multitask.task_weights: read only by weighted_loss_mode case3; coba would ignore them"
    ]
    assert MultitaskConfig(weighted_loss_mode="case3", task_weights={"code": 5.0}).problems() == []


def test_early_stopping_that_could_never_fire_is_refused():
    train = TrainConfig(early_stopping_stall_num=2)
    assert early_stopping_problems(train, True, False) == [
        "train.early_stopping_stall_num: this stage's evaluation has no eval/loss to watch (its held-out figures "
        "are rewards)"
    ]
    assert early_stopping_problems(TrainConfig(early_stopping_stall_num=2, eval_steps=0), True, True) == [
        "train.early_stopping_stall_num: needs evaluations, and train.eval_steps is 0"
    ]
    assert early_stopping_problems(train, False, True) == [
        "train.early_stopping_stall_num: needs held-out data (data.eval or data.eval_fraction)"
    ]
    assert early_stopping_problems(train, True, True) == []
    from stages.grpo import GRPOStage
    from stages.ppo import PPOStage
    from stages.sft import SFTStage

    assert (PPOStage.evaluates_loss, GRPOStage.evaluates_loss, SFTStage.evaluates_loss) == (False, False, True)


def test_coba_with_a_task_that_has_no_held_out_sample_is_refused_before_any_model_loads(tiny_model_dir, tmp_path):
    """CoBa (and MFTCoder's self-paced) weighs each task by its held-out loss: a task with none
    ended the run at its first step in a traceback ('validation losses must be finite')."""
    from stages.sft import SFTStage

    train, valid = write_sft(tmp_path / "data", big=6, small=6)
    argv = sft_args(tiny_model_dir, train, valid / "big.jsonl", tmp_path / "out", "--multitask.weighted_loss_mode")
    for mode in ("coba", "self-paced"):
        stage = SFTStage(load_config(SFTStage.config_class, [*argv, mode]))
        with pytest.raises(ConfigError) as err:
            stage.validate()
        assert err.value.problems == [
            f"multitask.weighted_loss_mode: {mode} weighs each task by its held-out loss, and task(s) ['small'] "
            "have no held-out sample (give them data.eval files, or a larger data.eval_fraction)"
        ]
    capped = SFTStage(load_config(SFTStage.config_class, sft_args(tiny_model_dir, train, valid, tmp_path / "o2")))
    capped.cfg.data.max_samples = -1
    capped.validate()
    assert len(capped.train_samples) == 12  # MedicalGPT's -1: every record
