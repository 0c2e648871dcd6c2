"""The pipeline config the driver runs (pipeline/tools/driver.py): its typed sections (`PipelineConfig`,
one `StageEntry` per registered stage, the verdict and the gold table), the stage selection on the
command line (`--from`, `--only`), and what is read from the config alone: the chain's order, each
stage's resolved config, the reward stage and the `stage:NAME` model references. Pure: no file but
the YAML is read. What runs on it (paths, done-ness, checks across a stage boundary, each stage's
command line) is pipeline/tools/chain.py."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import stages as registry
from pipeline.config import ConfigError, load_config
from pipeline.config.sections import STAGE_REF
from pipeline.tools.evaluate import BenchmarkConfig
from pipeline.tools.gold import GREEDY
from pipeline.tools.serving import SERVING

STAGE_ORDER = tuple(registry.STAGES)
"""Every registered stage, in registry order."""
DEFAULT_CHAIN = ("pt", "sft", "rm", "ppo")
LOG_NAME = "driver.log"
TIMINGS_NAME = "timings.json"


class DriverError(RuntimeError):
    """The pipeline cannot go on (a failed check, a stale or missing stage output)."""


@dataclass
class StageEntry:
    enabled: bool = True
    """Run this stage. A disabled stage drops out of the chain."""
    config: dict[str, Any] = field(default_factory=dict)
    """The stage's own config, usually `!include pt.yaml` (same keys as the stage's --config YAML)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Keys merged into the stage's `data` section (train/eval files, format, ...)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Nested keys merged over `config` last, e.g. {train: {max_steps: 20}}."""
    script: Optional[str] = None
    """Stage script; default the registry's (stages/<module>.py)."""


Stages = make_dataclass("Stages", [(name, StageEntry, field(default_factory=StageEntry)) for name in STAGE_ORDER])
Stages.__doc__ = "One entry per registered stage; only those named in the pipeline's `chain` run."


@dataclass
class VerdictConfig:
    rm_min_eval_accuracy: float = 0.7
    """The RM's held-out accuracy must reach this for a PASS verdict (chance is 0.5)."""


@dataclass
class GoldConfig:
    """The gold table (pipeline/tools/gold.py): greedy answers to held-out questions with an answer key,
    scored for the house phrase and the right fact. The PPO verdict rests on it."""

    data: Optional[str] = None
    """Gold JSONL ({prompt, attribute, expected, ...}); None: no gold table, and no PASS verdict."""
    models: Optional[list[str]] = None
    """Rows of the table: 'base' (base_model) and generator stages of the chain (their merged
    models). None: base, the judged stage's parent and the judged stage (base, sft, ppo for the
    default chain). The judged stage's parent is always added: the verdict compares against it."""
    max_new_tokens: int = 40
    """Greedy answer length limit."""
    batch_size: int = 8
    """Prompts per generate() call (left-padded)."""
    dtype: str = "fp32"
    """Weights dtype while answering (fp32 | bf16 | fp16 | auto)."""
    backend: str = "relay"
    """Who decodes the answers: relay (Relay's engine) or vllm (a vLLM server per model, from
    run_scripts/install_vllm.sh); pipeline/tools/gold.py's GREEDY."""
    min_phrase_gain: float = 0.2
    """PASS needs the RL model's phrase rate to exceed its parent's by at least this."""
    max_fact_drop: float = 0.05
    """PASS needs the RL model's fact accuracy to be at most this much below its parent's."""
    benchmarks: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    """lm-evaluation-harness scores of the base and every generator stage's merged model on local
    task YAMLs (`relay eval`): the report's retention table. Off while `tasks` is empty."""

    def problems(self, chain: Sequence[str] = DEFAULT_CHAIN) -> list[str]:
        out = self.benchmarks.problems()
        unknown_rows = [m for m in self.benchmarks.models or () if m not in gold_names(chain)]
        if unknown_rows:
            out.append(
                f"gold.benchmarks.models: {', '.join(map(repr, unknown_rows))} not among {', '.join(gold_names(chain))}"
            )
        if self.data is not None and not Path(self.data).is_file():
            out.append(f"gold.data: {self.data!r} is not a file")
        known = gold_names(chain)
        unknown = [m for m in self.models or () if m not in known]
        if unknown:
            others = [s for s in chain if s in registry.STAGES and s not in known]
            why = f" ({', '.join(others)} {'is' if len(others) == 1 else 'are'} not a generator)" if others else ""
            out.append(f"gold.models: {', '.join(map(repr, unknown))} not among {', '.join(known)}{why}")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            out.append("gold.max_new_tokens and gold.batch_size must be >= 1")
        if self.dtype not in ("fp32", "bf16", "fp16", "auto"):
            out.append(f"gold.dtype: {self.dtype!r} is not one of 'fp32', 'bf16', 'fp16', 'auto'")
        if self.backend not in GREEDY:
            out.append(f"gold.backend: {self.backend!r} is not one of {tuple(GREEDY)}")
        elif self.data is not None:
            missing = SERVING[self.backend].missing()
            if missing:
                out.append(f"gold.backend: {missing}")
        return out


@dataclass
class PipelineConfig:
    base_model: str = "embedded"
    """The model PT starts from: a local Hugging Face folder or 'embedded'."""
    output_root: str = "outputs/pipeline"
    """One folder per stage goes here (pt/, sft/, rm/, ppo/), plus summary.json and report.md."""
    chain: list[str] = field(default_factory=lambda: list(DEFAULT_CHAIN))
    """The stages to run, in order: any registered stages (stages/__init__.py), each after the
    stages it may start from, e.g. [pt, sft, dpo] or [pt, sft, rm, grpo]."""
    finetuning: Optional[str] = None
    """full|lora|qlora for every stage (sets model.finetuning); None keeps each stage's setting."""
    all_stages: dict[str, Any] = field(default_factory=dict)
    """Nested keys merged into every stage's config (e.g. {train: {precision: bf16}})."""
    reward_model: Optional[str] = None
    """The reward model of the stages that read one (PPO, GRPO) when the chain has no enabled
    reward stage (a merged RM folder)."""
    stages: Stages = field(default_factory=Stages)
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    gold: GoldConfig = field(default_factory=GoldConfig)
    report: bool = True
    """Write report.md and plots at the end (python -m pipeline.tools.report)."""

    def problems(self) -> list[str]:
        out = []
        if self.finetuning not in (None, "full", "lora", "qlora"):
            out.append(f"finetuning: {self.finetuning!r} is not one of None, 'full', 'lora', 'qlora'")
        if not self.output_root:
            out.append("output_root: must not be empty")
        chain_problems = chain_order_problems(self.chain)
        out += chain_problems
        if chain_problems:
            return out + self.gold.problems([s for s in self.chain if s in registry.STAGES])
        if not any(entry(self, s).enabled for s in self.chain):
            out.append("stages: every stage is disabled")
        for name in registry.STAGES:
            if name not in self.chain and entry(self, name) != StageEntry():
                out.append(
                    f"stages.{name}: configured but not in "
                    f"chain ({', '.join(self.chain)}); add it to chain or remove it"
                )
        for name in self.chain:
            if (
                entry(self, name).enabled
                and registry.info(name).reward_model == "required"
                and reward_stage(self) is None
                and not self.reward_model
            ):
                rm = next((s for s in registry.STAGES if registry.info(s).model_kind == "reward"), "rm")
                how = f"enable stages.{rm}" if rm in self.chain else f"put {rm} in chain before {name}"
                out.append(f"reward_model: {name.upper()} needs a reward model; {how} or set reward_model")
        return out + model_ref_problems(self) + self.gold.problems(self.chain)


@dataclass
class Selection:
    start: Optional[str] = None
    only: Optional[str] = None


def entry(cfg: PipelineConfig, stage: str) -> StageEntry:
    return getattr(cfg.stages, stage)


def chain_order_problems(chain: Sequence[str]) -> list[str]:
    """Why `chain` is not a runnable list of stages: unknown or repeated names, a stage before one
    of its parents, a reward stage after a stage that reads it (pure)."""
    out = []
    unknown = [s for s in chain if s not in registry.STAGES]
    if unknown:
        out.append(
            f"chain: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not a registered stage "
            f"({', '.join(registry.STAGES)})"
        )
    repeated = sorted({s for s in chain if list(chain).count(s) > 1})
    if repeated:
        out.append(f"chain: {', '.join(repeated)} listed more than once")
    if not chain:
        out.append("chain: names no stage")
    if out:
        return out
    position = {s: i for i, s in enumerate(chain)}
    for i, name in enumerate(chain):
        info = registry.info(name)
        late = [p for p in info.parents if position.get(p, -1) > i]
        if info.reward_model != "none":
            late += [s for s in chain[i + 1 :] if registry.info(s).model_kind == "reward"]
        out += [f"chain: {name} comes before {p}, which it builds on" for p in late]
    return out


def gold_names(chain: Sequence[str]) -> list[str]:
    """'base' and the generator stages of `chain`: what the gold table may have rows for (pure)."""
    return ["base"] + [s for s in chain if s in registry.STAGES and registry.info(s).model_kind == "causal"]


# ---------------------------------------------------------------------------------------------
# Config and selection
# ---------------------------------------------------------------------------------------------


def split_selection(argv: Sequence[str]) -> tuple[Selection, list[str]]:
    """Take `--from STAGE` / `--only STAGE` out of argv; the rest goes to the config loader.

    Raises:
        ConfigError: a flag without a value or naming an unknown stage, or both flags at once.
    """
    selection, rest, problems = Selection(), [], []
    args = list(argv)
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        if flag in ("--from", "--only"):
            value = args[i].split("=", 1)[1] if "=" in args[i] else (args[i + 1] if i + 1 < len(args) else None)
            i += 1 if "=" in args[i] else 2
            if value not in STAGE_ORDER:
                problems.append(f"{flag}: {value!r} is not a stage ({', '.join(STAGE_ORDER)})")
            setattr(selection, "start" if flag == "--from" else "only", value)
            continue
        rest.append(args[i])
        i += 1
    if selection.start and selection.only:
        problems.append("--from and --only: give one of them")
    if problems:
        raise ConfigError(problems, "command line")
    return selection, rest


def load_pipeline(config_path: str, argv: Sequence[str]) -> tuple[PipelineConfig, Selection]:
    """The pipeline config from YAML + dotted overrides, and the stage selection.

    Raises:
        ConfigError: every problem in the YAML, the overrides or the selection.
    """
    selection, rest = split_selection(argv)
    cfg = load_config(PipelineConfig, ["--config", config_path, *rest], prog="run_pipeline")
    for name in (selection.start, selection.only):
        if name and name not in cfg.chain:
            raise ConfigError(
                [
                    f"{name}: selected on the command line but "
                    f"not in the chain ({', '.join(cfg.chain)}) of {config_path}"
                ],
                "command line",
            )
        if name and not entry(cfg, name).enabled:
            raise ConfigError([f"{name}: selected on the command line but disabled in {config_path}"], "command line")
    return cfg, selection


def planned_stages(cfg: PipelineConfig, selection: Selection) -> list[str]:
    """The enabled stages the selection asks for, in chain order."""
    enabled = [s for s in cfg.chain if entry(cfg, s).enabled]
    if selection.only:
        return [selection.only]
    if selection.start:
        return enabled[enabled.index(selection.start) :]
    return enabled


def reward_stage(cfg: PipelineConfig) -> Optional[str]:
    """The chain's enabled reward-model stage (model_kind 'reward'), or None."""
    return next((s for s in cfg.chain if registry.info(s).model_kind == "reward" and entry(cfg, s).enabled), None)


def model_refs(cfg: PipelineConfig, stage: str) -> dict[str, str]:
    """{config key: value} of the other model folders `stage` reads (its registry `models`, e.g.
    distill's teacher.path) that its resolved config sets (pure)."""
    config, out = stage_config(cfg, stage), {}
    for key in registry.info(stage).models:
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str) and value:
            out[key] = value
    return out


def referenced_stage(value: str) -> Optional[str]:
    """NAME for a model key's value `stage:NAME`, else None (a folder)."""
    return value[len(STAGE_REF) :] if value.startswith(STAGE_REF) else None


def model_ref_problems(cfg: PipelineConfig) -> list[str]:
    """Why a `stage:NAME` model key of an enabled stage cannot be resolved: NAME is not a stage of the
    chain before it, is disabled, or is not a generator (pure)."""
    out = []
    for position, stage in enumerate(cfg.chain):
        if not entry(cfg, stage).enabled:
            continue
        for key, value in model_refs(cfg, stage).items():
            name, where = referenced_stage(value), f"stages.{stage}: {key}: {value!r}"
            if name is None:
                continue
            if name not in cfg.chain:
                out.append(f"{where} names no stage of the chain ({', '.join(cfg.chain)})")
            elif cfg.chain.index(name) >= position:
                out.append(f"{where}: {name} must come before {stage} in the chain")
            elif not entry(cfg, name).enabled:
                out.append(f"{where}: stages.{name} is disabled")
            elif registry.info(name).model_kind != "causal":
                out.append(f"{where}: {name} trains a {registry.info(name).model_kind} model, not a generator")
    return out


def deep_merge(base: dict, extra: dict) -> dict:
    """`extra` over `base`, recursing into mappings; lists and scalars are replaced (pure)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def stage_config(cfg: PipelineConfig, stage: str) -> dict:
    """The stage's config: its YAML, then all_stages, data, finetuning, then its overrides (pure)."""
    item = entry(cfg, stage)
    merged = deep_merge(item.config, cfg.all_stages)
    if item.data:
        merged = deep_merge(merged, {"data": item.data})
    if cfg.finetuning:
        merged = deep_merge(merged, {"model": {"finetuning": cfg.finetuning}})
    return deep_merge(merged, item.overrides)
