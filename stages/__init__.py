"""The stage registry: every stage's name, script, class, and what the driver needs to know about
it. The driver, the report, the gold table and the `relay` command read this table, never the stage
modules themselves (importing a stage loads torch and its models; the table costs nothing). A new
stage adds one `StageInfo` line here (ARCHITECTURE.md, "What a new stage provides").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Panel:
    """One panel of a stage's plot in the run report: curves by legend label, each a TensorBoard
    tag, or (with `prefix`) one curve per tag under that prefix, labelled by the rest of the tag."""

    title: str
    ylabel: str
    tags: dict[str, str] = field(default_factory=dict)
    prefix: str = ""


@dataclass(frozen=True)
class StageInfo:
    """What the pipeline driver, the report and the gold table know of a stage without importing it."""

    target: str
    """"module:Class" under stages/."""
    parents: tuple[str, ...] = ()
    """The stages whose merged model it may start from, preferred first; the first one enabled in
    the pipeline's chain is its parent, none: the base model. A chain must list a stage after
    every one of its parents that it lists."""
    model_kind: str = "causal"
    """'causal' (a generator: a row of the gold table, a final model) or 'reward' (a reward model
    for the stages that read one)."""
    reward_model: str = "none"
    """'required' | 'optional' | 'none': the stage reads a reward model (`--reward_model.path`):
    the chain's reward stage, else the pipeline's `reward_model`."""
    judged: bool = False
    """An RL/preference/distillation stage: the gold verdict compares its model with its parent's."""
    data_kind: str = "chat"
    """The data it reads: 'text' (PT), 'chat' (SFT), 'preference' (RM, DPO), 'prompt' (PPO, GRPO),
    'unpaired' (KTO)."""
    summary_keys: tuple[str, ...] = ()
    """Keys of its summary.json the pipeline summary copies as `<stage>_<key>`."""
    loss_curve: bool = True
    """Its train/loss and eval/loss go into the report's loss plot."""
    plot: tuple[str, str, tuple[Panel, ...]] = ("", "", ())
    """(file name, title, panels) of its own plot in the run report; no panels: none."""
    verdict_figures: dict[str, str] = field(default_factory=dict)
    """{summary key: the VerdictConfig field holding its minimum} the verdict checks when the stage ran."""
    samples: bool = False
    """A policy stage: it samples its own responses, so a generation backend applies to it (an axis
    of pipeline/config/capabilities.py's table; elsewhere "-")."""
    tools: bool = False
    """A policy stage whose config has a `tools:` section: its rollouts may call Python tools (the
    table's tools axis; elsewhere that axis is "-")."""
    corrects: bool = False
    """A policy stage whose loss weighs each sampled token by `generation.correction`'s weight
    (p_trainer / p_engine; pipeline/algorithms/mismatch.py): the table's correction axis. Elsewhere
    that axis is "-", and a correction other than auto or none is refused (it would not be applied)."""
    models: dict[str, str] = field(default_factory=dict)
    """{config key: manifest key} of the other model folders it reads beside its parent and reward
    model (distill's teacher). In a pipeline config the key may name `stage:NAME`, the merged model
    of the chain's stage NAME, which the driver passes on the command line; the stage records each
    model as {path, weights_hash} under the manifest key, and its output is stale once that model
    changes."""


LOSSES = ("train_loss_first", "train_loss_last", "eval_loss_first", "eval_loss_last")

STAGES: dict[str, StageInfo] = {
    "pt": StageInfo("pretrain:PTStage", data_kind="text", summary_keys=LOSSES),
    "sft": StageInfo(
        "sft:SFTStage",
        parents=("pt",),
        summary_keys=LOSSES,
        plot=(
            "sft_tasks",
            "SFT loss per task",
            (
                Panel("train loss per task", "loss", prefix="train/loss_task/"),
                Panel("eval loss per task", "loss", prefix="eval/loss_task/"),
            ),
        ),
    ),
    "rm": StageInfo(
        "reward:RMStage",
        parents=("sft", "pt"),
        model_kind="reward",
        data_kind="preference",
        summary_keys=(*LOSSES, "eval_accuracy", "eval_margin"),
        plot=(
            "rm",
            "Reward model",
            (
                Panel(
                    "pairwise accuracy",
                    "accuracy (chosen > rejected)",
                    {"train": "train/accuracy", "eval": "eval/accuracy"},
                ),
                Panel("eval margin", "mean r(chosen) - r(rejected)", {"eval": "eval/margin"}),
            ),
        ),
        verdict_figures={"eval_accuracy": "rm_min_eval_accuracy"},
    ),
    "ppo": StageInfo(
        "ppo:PPOStage",
        parents=("sft", "pt"),
        reward_model="required",
        judged=True,
        data_kind="prompt",
        samples=True,
        tools=True,
        corrects=True,
        summary_keys=("reward_first", "reward_last", "kl_last", "eval_reward_first", "eval_reward_last"),
        loss_curve=False,
        plot=(
            "ppo",
            "PPO",
            (
                Panel("reward", "mean RM score", {"train (raw)": "ppo/reward_raw", "eval": "eval/reward"}),
                Panel("KL to the reference", "KL (nats)", {"train": "ppo/kl", "eval": "eval/kl"}),
            ),
        ),
    ),
    "dpo": StageInfo(
        "dpo:DPOStage",
        parents=("sft", "pt"),
        judged=True,
        data_kind="preference",
        summary_keys=(*LOSSES, "eval_accuracy", "eval_margin"),
        plot=(
            "dpo",
            "DPO",
            (
                Panel(
                    "implicit rewards (train)",
                    "β·log(π/π_ref)",
                    {"chosen": "dpo/rewards_chosen", "rejected": "dpo/rewards_rejected"},
                ),
                Panel(
                    "pairwise accuracy",
                    "accuracy (chosen > rejected)",
                    {"train": "train/accuracy", "eval": "eval/accuracy"},
                ),
                Panel("margin", "reward(chosen) - reward(rejected)", {"train": "train/margin", "eval": "eval/margin"}),
            ),
        ),
    ),
    "kto": StageInfo(
        "kto:KTOStage",
        parents=("sft", "pt"),
        judged=True,
        data_kind="unpaired",
        summary_keys=(*LOSSES, "eval_margin"),
        plot=(
            "kto",
            "KTO",
            (
                Panel(
                    "implicit rewards (train)",
                    "β·log(π/π_ref)",
                    {"desirable": "kto/rewards_chosen", "undesirable": "kto/rewards_rejected"},
                ),
                Panel("KL estimate z_ref (train)", "nats", {"train": "kto/kl"}),
                Panel(
                    "margin",
                    "reward(desirable) - reward(undesirable)",
                    {"train": "train/margin", "eval": "eval/margin"},
                ),
            ),
        ),
    ),
    "grpo": StageInfo(
        "grpo:GRPOStage",
        parents=("sft", "pt"),
        reward_model="optional",
        judged=True,
        data_kind="prompt",
        samples=True,
        tools=True,
        corrects=True,
        summary_keys=("reward_first", "reward_last", "kl_last", "eval_reward_first", "eval_reward_last"),
        loss_curve=False,
        plot=(
            "grpo",
            "GRPO",
            (
                Panel("reward", "mean summed reward", {"train": "grpo/reward", "eval": "eval/reward"}),
                Panel("reward per source (train)", "mean reward", prefix="grpo/reward/"),
                Panel("completion length", "tokens", {"train": "grpo/completion_length"}),
            ),
        ),
    ),
    "distill": StageInfo(
        "distill:DistillStage",
        parents=("sft", "pt"),
        judged=True,
        data_kind="prompt",
        samples=True,
        models={"teacher.path": "teacher"},
        summary_keys=("loss_first", "loss_last", "kl_first", "kl_last", "eval_kl_first", "eval_kl_last"),
        loss_curve=False,
        plot=(
            "distill",
            "On-policy distillation",
            (
                Panel(
                    "per-token KL to the teacher",
                    "KL(student || teacher), nats",
                    {"train": "distill/kl", "eval": "eval/kl"},
                ),
                Panel("on-policy share", "1: the student's samples", {"train": "distill/on_policy"}),
                Panel("generation time", "seconds", {"train": "distill/gen_time"}),
            ),
        ),
    ),
}
"""name -> StageInfo, in the order stages are listed by default (the default chain is
pt -> sft -> rm -> ppo; a pipeline config's `chain` picks any other)."""


def info(name: str) -> StageInfo:
    """The stage's StageInfo.

    Raises:
        KeyError: no such stage.
    """
    return STAGES[name]


def script(name: str) -> Path:
    """The stage's script (what torchrun runs).

    Raises:
        KeyError: no such stage.
    """
    return ROOT / f"{STAGES[name].target.split(':')[0]}.py"


def stage_class(name: str):
    """The stage's class (imports its module).

    Raises:
        KeyError: no such stage.
    """
    module, cls = STAGES[name].target.split(":")
    return getattr(importlib.import_module(f"stages.{module}"), cls)


RECORD_KINDS = {"text": "pt", "chat": "sft", "preference": "rm", "prompt": "prompts", "unpaired": "kto"}
"""A stage's data kind (`StageInfo.data_kind`) -> the kind of records data_formats.validate checks."""


def record_kind(name: str) -> str:
    """The kind of records stage `name` reads (data_formats.validate's --kind)."""
    return RECORD_KINDS[info(name).data_kind]


def config_class(name: str):
    """The stage's config dataclass."""
    return stage_class(name).config_class
