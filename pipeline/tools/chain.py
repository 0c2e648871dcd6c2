"""The pipeline's chain, for the driver (pipeline/tools/driver.py): the pipeline config, the stage
plan, paths, done-ness, the checks across a stage boundary, and each stage's command line.

The chain is any list of registered stages (`chain:`, default pt -> sft -> rm -> ppo; also e.g.
pt -> sft -> dpo or pt -> sft -> rm -> grpo). What the driver needs of a stage — the stages it
may start from, whether it reads a reward model, its summary keys — is its `StageInfo` in the
registry (stages/__init__.py), never its module. A stage's parent is the first of its
`parents` enabled in the chain (none: the base model), so RM and PPO both start from the SFT
model; a disabled stage drops out (its successor starts from the stage before it). A stage that
reads a reward model gets the chain's reward stage (model_kind 'reward'), else `reward_model`.
A stage is done when `merged/manifest.json` exists, the weights on disk hash to what it records,
and its parent hash is the current parent's (for a stage that scored with a reward model also:
the reward model recorded in its manifest as `reward_model: {path, weights_hash}` is the current
one): re-running the driver after a crash resumes at the first unfinished stage.
A stage that reads other models (its registry `models`: distill's teacher) may name a chain
stage's merged model in its config as `stage:NAME` (`teacher.path: stage:ppo`); the driver passes
that folder on the command line, and the stage's output is stale once the model it recorded changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

import stages as registry
from pipeline.config import ConfigError, load_config
from pipeline.config.sections import STAGE_REF
from pipeline.engine.identity import config_changes
from pipeline.modeling.handoff import link_problems, manifest_problems, pairing_problems
from pipeline.modeling.manifest import read_manifest, weights_hash
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


# ---------------------------------------------------------------------------------------------
# Paths and chain
# ---------------------------------------------------------------------------------------------


def stage_dir(cfg: PipelineConfig, stage: str) -> Path:
    return Path(cfg.output_root) / stage


def merged_dir(cfg: PipelineConfig, stage: str) -> Path:
    return stage_dir(cfg, stage) / "merged"


def resolve_base(path: str) -> Path:
    """The base model's folder ('embedded' is converted once and cached).

    Raises:
        DriverError: the path is not a local folder (the driver checks manifests, so it needs one).
    """
    from pipeline.modeling.embedded import is_embedded, materialize

    folder = materialize() if is_embedded(path) else Path(path)
    if not folder.is_dir():
        raise DriverError(f"base_model: {path!r} is not a local model folder")
    return folder.resolve()


def parent_stage(cfg: PipelineConfig, stage: str) -> Optional[str]:
    """The stage whose merged model `stage` starts from: the first of its registry `parents`
    enabled in the chain (None: the base model). RM and PPO both start from the SFT model, so
    neither takes the RM as its parent."""
    return next((c for c in registry.info(stage).parents if c in cfg.chain and entry(cfg, c).enabled), None)


def parent_path(cfg: PipelineConfig, stage: str) -> Path:
    parent = parent_stage(cfg, stage)
    return resolve_base(cfg.base_model) if parent is None else merged_dir(cfg, parent).resolve()


def reward_stage(cfg: PipelineConfig) -> Optional[str]:
    """The chain's enabled reward-model stage (model_kind 'reward'), or None."""
    return next((s for s in cfg.chain if registry.info(s).model_kind == "reward" and entry(cfg, s).enabled), None)


def reward_path(cfg: PipelineConfig) -> Optional[Path]:
    """The reward model of the chain: its reward stage's merged folder, else `reward_model`, else None."""
    rm = reward_stage(cfg)
    if rm is not None:
        return merged_dir(cfg, rm).resolve()
    return Path(cfg.reward_model).resolve() if cfg.reward_model else None


def stage_reward_path(cfg: PipelineConfig, stage: str) -> Optional[Path]:
    """The reward model `stage` reads (None: it reads none, or an optional one that is not there)."""
    return None if registry.info(stage).reward_model == "none" else reward_path(cfg)


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


def model_path(cfg: PipelineConfig, value: str) -> Path:
    """The folder a model key names: the chain stage's merged model for `stage:NAME`, else the value."""
    name = referenced_stage(value)
    return merged_dir(cfg, name).resolve() if name else Path(value)


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


# ---------------------------------------------------------------------------------------------
# Done-ness and cross-stage checks
# ---------------------------------------------------------------------------------------------


def stage_status(cfg: PipelineConfig, stage: str) -> str:
    """'done' when the stage's merged output is complete and built on the current parent, else 'todo'.

    Raises:
        DriverError: the output exists but is stale (built on another parent or with another
            config than the pipeline config now gives it) or its weights no
            longer match its manifest; both values are in the message. Nothing is deleted: the
            user decides.
    """
    folder = merged_dir(cfg, stage)
    manifest = read_manifest(folder)
    if manifest is None:
        return "todo"
    actual = weights_hash(folder)
    if manifest.get("weights_hash") != actual:
        raise DriverError(
            f"{folder}: weights hash {actual} does not match its manifest's {manifest.get('weights_hash')}; delete "
            f"{stage_dir(cfg, stage)} to rebuild it"
        )
    saved = config_file(cfg, stage)
    changed = (
        config_changes(yaml.safe_load(saved.read_text(encoding="utf-8")) or {}, stage_config(cfg, stage))
        if saved.is_file()
        else []
    )
    if changed:
        raise DriverError(
            f"{folder} was built with the config in {saved}, which differs from what the pipeline config "
            f"now gives this stage ({'; '.join(changed)}):\n{render_stage_config(cfg, stage)}delete "
            f"{stage_dir(cfg, stage)} to rebuild it"
        )
    parent = parent_path(cfg, stage)
    expected = weights_hash(parent)
    if manifest.get("parent_hash") != expected:
        raise DriverError(
            f"{folder} is stale: built on parent weights {manifest.get('parent_hash')} "
            f"({manifest.get('parent_path')}), "
            f"but its parent {parent} now has {expected}; delete {stage_dir(cfg, stage)} to rebuild it"
        )
    problem = reward_model_problem(cfg, stage, manifest)
    if problem:
        raise DriverError(problem)
    problems = recorded_model_problems(cfg, stage, manifest)
    if problems:
        raise DriverError(problems[0])
    return "done"


def recorded_model_problems(cfg: PipelineConfig, stage: str, manifest: dict) -> list[str]:
    """For a stage that reads other models (a teacher): why its output was not trained with the
    models its config names now. Its manifest records each as {path, weights_hash} under the
    registry's manifest key; another weights hash, or no record, makes the output stale."""
    out, folder = [], merged_dir(cfg, stage)
    models = registry.info(stage).models
    for key, value in model_refs(cfg, stage).items():
        path, label = model_path(cfg, value), models[key]
        if not path.is_dir():
            continue
        record, current = manifest.get(label), weights_hash(path)
        if not isinstance(record, dict) or not record.get("weights_hash"):
            out.append(
                f"{folder}/manifest.json does not record the {label} {stage.upper()} learned from "
                f"({label}: path, weights_hash), so it cannot be checked against {key} {path} ({current}); "
                f"delete {stage_dir(cfg, stage)} to rebuild it"
            )
        elif record["weights_hash"] != current:
            out.append(
                f"{folder} is stale: the {label} changed since {stage.upper()} ran: it learned from weights "
                f"{record['weights_hash']} ({record.get('path')}), but {key} {path} now has {current}; delete "
                f"{stage_dir(cfg, stage)} to rebuild it"
            )
    return out


def reward_model_problem(cfg: PipelineConfig, stage: str, manifest: dict) -> Optional[str]:
    """For a stage that reads a reward model: why its output was not trained against the current
    reward model, or None.

    Such a stage's manifest records `reward_model: {path, weights_hash}`; a rebuilt RM (another
    weights hash) or a missing record makes its output stale. A stage whose reward model is
    optional and absent now must not record one either.
    """
    if registry.info(stage).reward_model == "none":
        return None
    folder, rm, name = merged_dir(cfg, stage), stage_reward_path(cfg, stage), stage.upper()
    record = manifest.get("reward_model")
    if rm is None:
        if isinstance(record, dict) and record:
            return (
                f"{folder} is stale: {name} scored with reward model {record.get('path')}, but the pipeline now gives "
                f"it none; delete {stage_dir(cfg, stage)} to rebuild it"
            )
        return None
    current = weights_hash(rm)
    if not isinstance(record, dict) or not record.get("weights_hash"):
        return (
            f"{folder}/manifest.json does not record the "
            f"reward model {name} scored with (reward_model: path, weights_hash), "
            f"so it cannot be checked against the current reward model {rm} ({current}); delete "
            f"{stage_dir(cfg, stage)} to rebuild it"
        )
    if record["weights_hash"] != current:
        return (
            f"{folder} is stale: the reward model was "
            f"rebuilt since {name} ran: {name} scored with reward model weights "
            f"{record['weights_hash']} ({record.get('path')}), but {rm} now has {current}; delete "
            f"{stage_dir(cfg, stage)} to rebuild it"
        )
    return None


def checks_before(cfg: PipelineConfig, stage: str) -> list[str]:
    """Cross-stage checks before `stage` starts: its parent is intact and agrees with its own
    parent; for a stage reading a reward model, the reward model and the policy share tokenizer,
    template and vocab."""
    parent, previous = parent_path(cfg, stage), parent_stage(cfg, stage)
    if previous is not None and not (parent / "config.json").is_file():  # e.g. --from sft on a fresh output_root
        return [
            f"{previous} has not run: {parent} does not "
            f"exist yet; run the pipeline from {previous} (--from {previous}), "
            f"or point base_model at a model and leave {previous} out of the chain"
        ]
    # A base model from elsewhere may have no manifest; a stage's output must have one.
    problems = manifest_problems(parent) if previous or read_manifest(parent) else []
    grand = (read_manifest(parent) or {}).get("parent_path")
    if previous is not None and grand and Path(grand).is_dir():
        problems += link_problems(parent, Path(grand), may_change_template=previous == "sft")
    rm = stage_reward_path(cfg, stage)
    if rm is not None:
        if read_manifest(rm) is None:
            problems.append(f"{rm}: the reward model has no manifest.json (has the rm stage finished?)")
        else:
            problems += manifest_problems(rm)
            problems += pairing_problems("reward model", rm, "policy", parent)
    for key, value in model_refs(cfg, stage).items():
        folder, name, label = model_path(cfg, value), referenced_stage(value), registry.info(stage).models[key]
        if name is not None and read_manifest(folder) is None:
            problems.append(
                f"{key}: {name} has not run: {folder} has no manifest.json; "
                f"run the pipeline from {name} (--from {name})"
            )
            continue
        if name is not None:
            problems += manifest_problems(folder)
        if folder.is_dir():  # the model scores the stage's token ids: the chat template may differ
            problems += [
                p for p in pairing_problems(label, folder, "model", parent) if not p.startswith("chat template")
            ]
    return problems


def checks_after(cfg: PipelineConfig, stage: str) -> list[str]:
    """The new merged folder exists, records its parent (path and hash), and agrees with it."""
    folder, parent = merged_dir(cfg, stage), parent_path(cfg, stage)
    manifest = read_manifest(folder)
    if manifest is None:
        return [f"{folder}: the stage finished without writing merged/manifest.json"]
    problems = []
    if manifest.get("parent_path") != str(parent):
        problems.append(
            f"{folder}/manifest.json: parent_path is {manifest.get('parent_path')!r}, expected {str(parent)!r}"
        )
    if manifest.get("parent_hash") != weights_hash(parent):
        problems.append(
            f"{folder}/manifest.json: parent_hash is {manifest.get('parent_hash')!r}, expected {weights_hash(parent)!r}"
        )
    rm_problem = reward_model_problem(cfg, stage, manifest)
    problems += [rm_problem] if rm_problem else []
    problems += recorded_model_problems(cfg, stage, manifest)
    return problems + manifest_problems(folder) + link_problems(folder, parent, may_change_template=stage == "sft")


# ---------------------------------------------------------------------------------------------
# Stage command
# ---------------------------------------------------------------------------------------------


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


def config_file(cfg: PipelineConfig, stage: str) -> Path:
    """Where the driver writes the stage's resolved config (also the record of what it ran with)."""
    return Path(cfg.output_root) / "configs" / f"{stage}.yaml"


def render_stage_config(cfg: PipelineConfig, stage: str) -> str:
    return yaml.safe_dump(stage_config(cfg, stage), sort_keys=False)


def stage_argv(cfg: PipelineConfig, stage: str) -> list[str]:
    """Write the stage's resolved YAML under output_root/configs/ and return its argv (script first).

    output_dir, model.path, (for a stage reading one) reward_model.path and every `stage:NAME` model
    key resolved to NAME's merged folder go on the command line, so the log shows them.
    """
    path = config_file(cfg, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_stage_config(cfg, stage), encoding="utf-8")
    argv = [
        entry(cfg, stage).script or f"stages/{registry.script(stage).name}",
        "--config",
        str(path),
        "--output_dir",
        str(stage_dir(cfg, stage)),
        "--model.path",
        str(parent_path(cfg, stage)),
    ]
    rm = stage_reward_path(cfg, stage)
    if rm is not None:
        argv += ["--reward_model.path", str(rm)]
    for key, value in model_refs(cfg, stage).items():
        if referenced_stage(value) is not None:
            argv += [f"--{key}", str(model_path(cfg, value))]
    return argv


def stage_config_problems(cfg: PipelineConfig, stages: Sequence[str]) -> list[str]:
    """Every problem in the resolved configs of `stages`, found before the first stage starts
    (a typo in PPO's overrides should not wait for PT, SFT and RM to finish). Each is checked with
    its stage's own config class; stages with a custom `script` are left to that script.
    """
    import tempfile

    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages:
            if entry(cfg, stage).script:
                continue
            path = Path(tmp) / f"{stage}.yaml"
            path.write_text(render_stage_config(cfg, stage), encoding="utf-8")
            # The parent does not exist yet; 'embedded' stands in for it while the config is checked.
            argv = ["--config", str(path), "--output_dir", str(stage_dir(cfg, stage)), "--model.path", "embedded"]
            argv += ["--reward_model.path", "embedded"] if stage_reward_path(cfg, stage) is not None else []
            argv += [
                a for key, v in model_refs(cfg, stage).items() if referenced_stage(v) for a in (f"--{key}", "embedded")
            ]
            try:
                load_config(registry.config_class(stage), argv)
            except ConfigError as err:
                problems += [f"stages.{stage}: {p.removeprefix(f'{path}: ')}" for p in err.problems]
    return problems
