"""The pipeline driver's Python half: config, stage plan, done-ness, cross-stage checks, summary.

    bash run_scripts/run_pipeline.sh configs/pipeline.yaml [--from sft] [--only rm] [--dotted.keys v]

The bash script owns the loop and the launches (torchrun per stage); for each stage it asks this
module, through small subcommands, what to do:

    python -m pipeline.driver stages    CONFIG [selection/overrides]   # stage names to visit
    python -m pipeline.driver prepare   CONFIG STAGE [...]             # 'skip' or the stage's argv
    python -m pipeline.driver finish    CONFIG STAGE [...]             # check the new merged folder
    python -m pipeline.driver summarize CONFIG [...]                   # gold table, summary.json, verdict
    python -m pipeline.driver report-dir CONFIG [...]                  # where to write the report

Chain: PT -> SFT -> RM (on the SFT model) -> PPO (policy = SFT model, reward = RM). A disabled
stage drops out of the chain (its successor starts from the stage before it). A stage is done when
`merged/manifest.json` exists, the weights on disk hash to what it records, and its parent hash is
the current parent's (for PPO also: the reward model it scored with, recorded in its manifest as
`reward_model: {path, weights_hash}`, is the current RM folder): re-running the driver after a
crash resumes at the first unfinished stage.

Verdict: the RM's held-out accuracy, and the gold table (pipeline/gold.py; `gold:` section):
greedy answers of the base, SFT and PPO models to held-out questions with an answer key. PASS
needs PPO's phrase rate above its parent's by gold.min_phrase_gain and its fact accuracy within
gold.max_fact_drop of its parent's. PPO's reward curve is reported, not judged.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from pipeline.config import ConfigError, load_config
from pipeline.gold import GoldError, GoldSettings, format_table, gold_table
from pipeline.manifest import chat_template_of, check_parent_compatible, read_manifest, text_hash, tokenizer_hash, vocab_size_of, weights_hash

STAGE_ORDER = ("pt", "sft", "rm", "ppo")
STAGE_SCRIPTS = {"pt": "stages/pretrain.py", "sft": "stages/sft.py", "rm": "stages/reward.py", "ppo": "stages/ppo.py"}
STAGE_CLASSES = {"pt": "stages.pretrain:PTConfig", "sft": "stages.sft:SFTConfig", "rm": "stages.reward:RMConfig", "ppo": "stages.ppo:PPOConfig"}
CHECKED_KEYS = ("tokenizer_hash", "chat_template_hash", "vocab_size")
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
    """Stage script; default stages/{pretrain,sft,reward,ppo}.py."""


@dataclass
class Stages:
    pt: StageEntry = field(default_factory=StageEntry)
    sft: StageEntry = field(default_factory=StageEntry)
    rm: StageEntry = field(default_factory=StageEntry)
    ppo: StageEntry = field(default_factory=StageEntry)


@dataclass
class VerdictConfig:
    rm_min_eval_accuracy: float = 0.7
    """The RM's held-out accuracy must reach this for a PASS verdict (chance is 0.5)."""


GOLD_MODELS = ("base", "pt", "sft", "ppo")


@dataclass
class GoldConfig:
    """The gold table (pipeline/gold.py): greedy answers to held-out questions with an answer key,
    scored for the house phrase and the right fact. The PPO verdict rests on it."""

    data: Optional[str] = None
    """Gold JSONL ({prompt, attribute, expected, ...}); None: no gold table, and no PASS verdict."""
    models: list[str] = field(default_factory=lambda: ["base", "sft", "ppo"])
    """Rows of the table: 'base' (base_model) and stage names (their merged models). The RL
    model's parent (sft, else pt, else base) is always added: the verdict compares against it."""
    max_new_tokens: int = 40
    """Greedy answer length limit."""
    batch_size: int = 8
    """Prompts per generate() call (left-padded)."""
    dtype: str = "fp32"
    """Weights dtype while answering (fp32 | bf16 | fp16 | auto)."""
    min_phrase_gain: float = 0.2
    """PASS needs the RL model's phrase rate to exceed its parent's by at least this."""
    max_fact_drop: float = 0.05
    """PASS needs the RL model's fact accuracy to be at most this much below its parent's."""

    def problems(self) -> list[str]:
        out = []
        if self.data is not None and not Path(self.data).is_file():
            out.append(f"gold.data: {self.data!r} is not a file")
        unknown = [m for m in self.models if m not in GOLD_MODELS]
        if unknown:
            out.append(f"gold.models: {', '.join(map(repr, unknown))} not among {', '.join(GOLD_MODELS)} (rm is not a generator)")
        if self.max_new_tokens < 1 or self.batch_size < 1:
            out.append("gold.max_new_tokens and gold.batch_size must be >= 1")
        if self.dtype not in ("fp32", "bf16", "fp16", "auto"):
            out.append(f"gold.dtype: {self.dtype!r} is not one of 'fp32', 'bf16', 'fp16', 'auto'")
        return out


@dataclass
class PipelineConfig:
    base_model: str = "embedded"
    """The model PT starts from: a local Hugging Face folder or 'embedded'."""
    output_root: str = "outputs/pipeline"
    """One folder per stage goes here (pt/, sft/, rm/, ppo/), plus summary.json and report.md."""
    finetuning: Optional[str] = None
    """full|lora|qlora for every stage (sets model.finetuning); None keeps each stage's setting."""
    all_stages: dict[str, Any] = field(default_factory=dict)
    """Nested keys merged into every stage's config (e.g. {train: {precision: bf16}})."""
    reward_model: Optional[str] = None
    """PPO's reward model when the rm stage is disabled (a merged RM folder)."""
    stages: Stages = field(default_factory=Stages)
    verdict: VerdictConfig = field(default_factory=VerdictConfig)
    gold: GoldConfig = field(default_factory=GoldConfig)
    report: bool = True
    """Write report.md and plots at the end (python -m pipeline.report)."""

    def problems(self) -> list[str]:
        out = []
        if self.finetuning not in (None, "full", "lora", "qlora"):
            out.append(f"finetuning: {self.finetuning!r} is not one of None, 'full', 'lora', 'qlora'")
        if not self.output_root:
            out.append("output_root: must not be empty")
        if not any(entry(self, s).enabled for s in STAGE_ORDER):
            out.append("stages: every stage is disabled")
        if entry(self, "ppo").enabled and not entry(self, "rm").enabled and not self.reward_model:
            out.append("reward_model: PPO needs a reward model; enable stages.rm or set reward_model")
        return out + self.gold.problems()


@dataclass
class Selection:
    start: Optional[str] = None
    only: Optional[str] = None


def entry(cfg: PipelineConfig, stage: str) -> StageEntry:
    return getattr(cfg.stages, stage)


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
        if name and not entry(cfg, name).enabled:
            raise ConfigError([f"{name}: selected on the command line but disabled in {config_path}"], "command line")
    return cfg, selection


def planned_stages(cfg: PipelineConfig, selection: Selection) -> list[str]:
    """The enabled stages the selection asks for, in pipeline order."""
    enabled = [s for s in STAGE_ORDER if entry(cfg, s).enabled]
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
    from pipeline.embedded import is_embedded, materialize

    folder = materialize() if is_embedded(path) else Path(path)
    if not folder.is_dir():
        raise DriverError(f"base_model: {path!r} is not a local model folder")
    return folder.resolve()


def parent_stage(cfg: PipelineConfig, stage: str) -> Optional[str]:
    """The enabled stage whose merged model `stage` starts from (None: the base model).

    RM and PPO both start from the SFT model, so neither takes the RM as its parent.
    """
    candidates = {"pt": (), "sft": ("pt",), "rm": ("sft", "pt"), "ppo": ("sft", "pt")}[stage]
    return next((c for c in candidates if entry(cfg, c).enabled), None)


def parent_path(cfg: PipelineConfig, stage: str) -> Path:
    parent = parent_stage(cfg, stage)
    return resolve_base(cfg.base_model) if parent is None else merged_dir(cfg, parent).resolve()


def reward_path(cfg: PipelineConfig) -> Path:
    return merged_dir(cfg, "rm").resolve() if entry(cfg, "rm").enabled else Path(cfg.reward_model).resolve()


# ---------------------------------------------------------------------------------------------
# Done-ness and cross-stage checks
# ---------------------------------------------------------------------------------------------


def folder_facts(folder: Path) -> dict[str, Any]:
    """What a model folder holds now, in manifest terms (tokenizer/template hashes, vocab size)."""
    return {
        "tokenizer_hash": tokenizer_hash(folder),
        "chat_template_hash": text_hash(chat_template_of(folder)),
        "vocab_size": vocab_size_of(folder),
    }


def compare(name_a: str, facts_a: dict, name_b: str, facts_b: dict, keys: Sequence[str] = CHECKED_KEYS) -> list[str]:
    """One line per key whose values differ, showing both values (pure)."""
    return [
        f"{key} differs: {name_a} has {facts_a.get(key)!r}, {name_b} has {facts_b.get(key)!r}"
        for key in keys
        if facts_a.get(key) != facts_b.get(key)
    ]


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
        raise DriverError(f"{folder}: weights hash {actual} does not match its manifest's {manifest.get('weights_hash')}; delete {stage_dir(cfg, stage)} to rebuild it")
    saved, wanted = config_file(cfg, stage), render_stage_config(cfg, stage)
    if saved.is_file() and saved.read_text(encoding="utf-8") != wanted:
        raise DriverError(
            f"{folder} was built with the config in {saved}, which differs from what the pipeline config "
            f"now gives this stage:\n{wanted}delete {stage_dir(cfg, stage)} to rebuild it"
        )
    parent = parent_path(cfg, stage)
    expected = weights_hash(parent)
    if manifest.get("parent_hash") != expected:
        raise DriverError(
            f"{folder} is stale: built on parent weights {manifest.get('parent_hash')} ({manifest.get('parent_path')}), "
            f"but its parent {parent} now has {expected}; delete {stage_dir(cfg, stage)} to rebuild it"
        )
    problem = reward_model_problem(cfg, stage, manifest)
    if problem:
        raise DriverError(problem)
    return "done"


def reward_model_problem(cfg: PipelineConfig, stage: str, manifest: dict) -> Optional[str]:
    """For PPO: why its output was not trained against the current reward model, or None.

    The PPO manifest records `reward_model: {path, weights_hash}`; a rebuilt RM (another weights
    hash) or a missing record makes the PPO output stale (PPO always scores with an RM).
    """
    if stage != "ppo":
        return None
    folder, rm = merged_dir(cfg, stage), reward_path(cfg)
    current = weights_hash(rm)
    record = manifest.get("reward_model")
    if not isinstance(record, dict) or not record.get("weights_hash"):
        return (
            f"{folder}/manifest.json does not record the reward model PPO scored with (reward_model: path, weights_hash), "
            f"so it cannot be checked against the current reward model {rm} ({current}); delete {stage_dir(cfg, stage)} to rebuild it"
        )
    if record["weights_hash"] != current:
        return (
            f"{folder} is stale: the reward model was rebuilt since PPO ran: PPO scored with reward model weights "
            f"{record['weights_hash']} ({record.get('path')}), but {rm} now has {current}; delete {stage_dir(cfg, stage)} to rebuild it"
        )
    return None


def check_folder_against_manifest(folder: Path) -> list[str]:
    """The folder's tokenizer/template/vocab still match what its manifest recorded."""
    if read_manifest(folder) is None:
        return [f"{folder}: no manifest.json (not produced by Relay; cannot check what it inherits)"]
    return check_parent_compatible(folder, folder)


def check_link(child_stage: str, child: Path, parent: Path) -> list[str]:
    """Tokenizer and vocab (and, except across SFT, chat template) agree between parent and child.

    Only SFT may bring a new chat template: in role_markers mode it saves its own Jinja.
    """
    problems = check_parent_compatible(parent, child)
    if child_stage == "sft":
        problems = [p for p in problems if not p.startswith("chat template")]
    return problems


def checks_before(cfg: PipelineConfig, stage: str) -> list[str]:
    """Cross-stage checks before `stage` starts: its parent is intact and agrees with its own
    parent; for PPO, the reward model and the policy share tokenizer, template and vocab."""
    parent, previous = parent_path(cfg, stage), parent_stage(cfg, stage)
    # A base model from elsewhere may have no manifest; a stage's output must have one.
    problems = check_folder_against_manifest(parent) if previous or read_manifest(parent) else []
    grand = (read_manifest(parent) or {}).get("parent_path")
    if previous is not None and grand and Path(grand).is_dir():
        problems += check_link(previous, parent, Path(grand))
    if stage == "ppo":
        rm = reward_path(cfg)
        if read_manifest(rm) is None:
            problems.append(f"{rm}: the reward model has no manifest.json (has the rm stage finished?)")
        else:
            problems += check_folder_against_manifest(rm)
            problems += compare(f"reward model {rm}", folder_facts(rm), f"policy {parent}", folder_facts(parent))
    return problems


def checks_after(cfg: PipelineConfig, stage: str) -> list[str]:
    """The new merged folder exists, records its parent (path and hash), and agrees with it."""
    folder, parent = merged_dir(cfg, stage), parent_path(cfg, stage)
    manifest = read_manifest(folder)
    if manifest is None:
        return [f"{folder}: the stage finished without writing merged/manifest.json"]
    problems = []
    if manifest.get("parent_path") != str(parent):
        problems.append(f"{folder}/manifest.json: parent_path is {manifest.get('parent_path')!r}, expected {str(parent)!r}")
    if manifest.get("parent_hash") != weights_hash(parent):
        problems.append(f"{folder}/manifest.json: parent_hash is {manifest.get('parent_hash')!r}, expected {weights_hash(parent)!r}")
    rm_problem = reward_model_problem(cfg, stage, manifest)
    problems += [rm_problem] if rm_problem else []
    return problems + check_folder_against_manifest(folder) + check_link(stage, folder, parent)


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

    output_dir, model.path and reward_model.path go on the command line, so the log shows them.
    """
    path = config_file(cfg, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_stage_config(cfg, stage), encoding="utf-8")
    argv = [entry(cfg, stage).script or STAGE_SCRIPTS[stage], "--config", str(path), "--output_dir", str(stage_dir(cfg, stage)), "--model.path", str(parent_path(cfg, stage))]
    if stage == "ppo":
        argv += ["--reward_model.path", str(reward_path(cfg))]
    return argv


def stage_config_problems(cfg: PipelineConfig, stages: Sequence[str]) -> list[str]:
    """Every problem in the resolved configs of `stages`, found before the first stage starts
    (a typo in PPO's overrides should not wait for PT, SFT and RM to finish). Each is checked with
    its stage's own config class; stages with a custom `script` are left to that script.
    """
    import importlib
    import tempfile

    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in stages:
            if entry(cfg, stage).script:
                continue
            module, name = STAGE_CLASSES[stage].split(":")
            path = Path(tmp) / f"{stage}.yaml"
            path.write_text(render_stage_config(cfg, stage), encoding="utf-8")
            # The parent does not exist yet; 'embedded' stands in for it while the config is checked.
            argv = ["--config", str(path), "--output_dir", str(stage_dir(cfg, stage)), "--model.path", "embedded"]
            argv += ["--reward_model.path", "embedded"] if stage == "ppo" else []
            try:
                load_config(getattr(importlib.import_module(module), name), argv)
            except ConfigError as err:
                problems += [f"stages.{stage}: {p.removeprefix(f'{path}: ')}" for p in err.problems]
    return problems


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------

FIGURES = {
    "pt": ("train_loss_first", "train_loss_last", "eval_loss_first", "eval_loss_last"),
    "sft": ("train_loss_first", "train_loss_last", "eval_loss_first", "eval_loss_last"),
    "rm": ("train_loss_first", "train_loss_last", "eval_loss_first", "eval_loss_last", "eval_accuracy", "eval_margin"),
    "ppo": ("reward_first", "reward_last", "kl_last", "eval_reward_first", "eval_reward_last"),
}


def read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def verdict(figures: dict, cfg: VerdictConfig, gold_reasons: Optional[list[str]] = None) -> list[str]:
    """Reasons the run did not show learning (empty: PASS). Pure.

    The RM must reach its held-out accuracy; the RL model is judged by the gold table
    (`gold_verdict`, whose reasons come in `gold_reasons`; None: no gold table was configured).
    PPO's own reward curve is information only: a noisy curve rises by chance.
    """
    out = []
    accuracy = figures.get("rm_eval_accuracy")
    if accuracy is None:
        out.append("the RM reported no eval_accuracy")
    elif accuracy < cfg.rm_min_eval_accuracy:
        out.append(f"RM held-out accuracy {accuracy:.3f} is below {cfg.rm_min_eval_accuracy}")
    if gold_reasons is None:
        out.append("no gold table (set gold.data): the RL model was not judged on held-out answers")
    else:
        out += gold_reasons
    return out


def gold_verdict(rows: Sequence[dict], rl: str, reference: str, cfg: GoldConfig) -> list[str]:
    """Reasons the RL model's gold row does not show what PPO should do, compared with the row of
    the model it started from (empty: PASS). Pure.

    PASS needs phrase_rate(rl) - phrase_rate(reference) >= cfg.min_phrase_gain (the house style
    the RM rewards was learned) and fact_accuracy(reference) - fact_accuracy(rl) <= cfg.max_fact_drop
    (it was not bought with wrong facts).
    """
    by_name = {r["model"]: r for r in rows}
    missing = [name for name in (rl, reference) if name not in by_name]
    if missing:
        return [f"gold: no row for {', '.join(missing)}"]
    a, b = by_name[rl], by_name[reference]
    out = []
    gain = a["phrase_rate"] - b["phrase_rate"]
    if gain < cfg.min_phrase_gain - 1e-9:
        out.append(
            f"gold: the {rl} model's phrase rate {a['phrase_rate']:.3f} is not above the {reference} model's "
            f"{b['phrase_rate']:.3f} by {cfg.min_phrase_gain} (gain {gain:+.3f})"
        )
    drop = b["fact_accuracy"] - a["fact_accuracy"]
    if drop > cfg.max_fact_drop + 1e-9:
        out.append(
            f"gold: the {rl} model's fact accuracy {a['fact_accuracy']:.3f} fell below the {reference} model's "
            f"{b['fact_accuracy']:.3f} by {drop:.3f}, more than the {cfg.max_fact_drop} allowed"
        )
    return out


def gold_models(cfg: PipelineConfig, ran: Sequence[str]) -> list[tuple[str, str]]:
    """(row name, model path) for the gold table: the configured models that exist, plus the RL
    model's parent (the verdict's reference), in pipeline order."""
    wanted = set(cfg.gold.models)
    if "ppo" in ran:
        wanted.add(parent_stage(cfg, "ppo") or "base")
    out = []
    for name in ("base", "pt", "sft", "ppo"):
        if name not in wanted:
            continue
        if name == "base":
            out.append(("base", str(resolve_base(cfg.base_model))))
        elif name in ran and read_manifest(merged_dir(cfg, name)) is not None:
            out.append((name, str(merged_dir(cfg, name).resolve())))
    return out


def compute_gold(cfg: PipelineConfig, ran: Sequence[str]) -> Optional[dict]:
    """The gold table of this run ({data, rows, reference, rl}), None when gold.data is unset.

    Rows are cached in output_root/gold/cache.json by weights hash (a re-run regenerates nothing);
    answers go to output_root/gold/answers/<model>.jsonl.
    """
    if not cfg.gold.data:
        return None
    root = Path(cfg.output_root) / "gold"
    settings = GoldSettings(cfg.gold.max_new_tokens, cfg.gold.batch_size, cfg.gold.dtype)
    started = time.time()
    rows = gold_table(gold_models(cfg, ran), cfg.gold.data, settings, root / "cache.json", root / "answers", lambda m: log(cfg, m))
    return {
        "data": cfg.gold.data,
        "rows": rows,
        "rl": "ppo" if "ppo" in ran else None,
        "reference": (parent_stage(cfg, "ppo") or "base") if "ppo" in ran else None,
        "wall_seconds": round(time.time() - started, 1),
    }


def record_time(cfg: PipelineConfig, stage: str, event: str) -> None:
    """Note when a stage started/finished in output_root/timings.json (the driver's wall clock,
    which, unlike the stage's own wall_seconds, includes process start, loading and merging)."""
    path = Path(cfg.output_root) / TIMINGS_NAME
    timings = read_json(path) or {}
    timings.setdefault(stage, {})[event] = time.time()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(timings, indent=2) + "\n", encoding="utf-8")


def wall_seconds(cfg: PipelineConfig, stage: str, summary: dict) -> Optional[float]:
    """Driver-measured seconds for the stage's last run, else the stage's own figure."""
    times = (read_json(Path(cfg.output_root) / TIMINGS_NAME) or {}).get(stage, {})
    if "started" in times and "finished" in times and times["finished"] >= times["started"]:
        return round(times["finished"] - times["started"], 1)
    return summary.get("wall_seconds")


def summarize(cfg: PipelineConfig) -> dict:
    """Collect every stage's summary.json into output_root/summary.json (flat `<stage>_<key>`
    figures plus each stage's full summary) with a verdict; return it."""
    root = Path(cfg.output_root)
    figures: dict[str, Any] = {}
    stages: dict[str, Any] = {}
    for stage in STAGE_ORDER:
        summary = read_json(stage_dir(cfg, stage) / "summary.json")
        if not entry(cfg, stage).enabled or summary is None:
            continue
        stages[stage] = summary
        figures.update({f"{stage}_{k}": summary[k] for k in FIGURES[stage] if k in summary})
        figures[f"{stage}_wall_seconds"] = wall_seconds(cfg, stage, summary)
    final = next((s for s in reversed(STAGE_ORDER) if s != "rm" and s in stages), None)
    gold = compute_gold(cfg, list(stages))
    if gold is not None:
        figures["gold_wall_seconds"] = gold["wall_seconds"]
    if "rm" in stages and "ppo" in stages:
        gold_reasons = None if gold is None else gold_verdict(gold["rows"], gold["rl"], gold["reference"], cfg.gold)
        reasons = verdict(figures, cfg.verdict, gold_reasons)
    else:
        reasons = ["RM or PPO did not run"]
    out = {
        **figures,
        "gold": gold,
        "final_model": str(merged_dir(cfg, final).resolve()) if final else None,
        "reward_model": str(reward_path(cfg)) if "ppo" in stages else None,
        "tensorboard": f"tensorboard --logdir {root}",
        "verdict": "PASS" if not reasons else "WARNING",
        "verdict_reasons": reasons,
        "stages": stages,
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "summary.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


def format_summary(summary: dict) -> str:
    """The human-readable summary the demo prints."""

    def num(value: Any, digits: int = 4) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = ["", "=== Relay pipeline summary ==="]
    for stage in ("pt", "sft", "rm"):
        if stage in summary["stages"]:
            g = lambda k: num(summary.get(f"{stage}_{k}"))  # noqa: E731
            lines.append(f"{stage:>3}: train loss {g('train_loss_first')} -> {g('train_loss_last')}, eval loss {g('eval_loss_first')} -> {g('eval_loss_last')}  ({num(summary.get(f'{stage}_wall_seconds'), 0)} s)")
    if "rm" in summary["stages"]:
        lines.append(f" rm: held-out accuracy {num(summary.get('rm_eval_accuracy'))}, margin {num(summary.get('rm_eval_margin'))}")
    if "ppo" in summary["stages"]:
        g = lambda k: num(summary.get(f"ppo_{k}"))  # noqa: E731
        lines.append(f"ppo: mean reward {g('reward_first')} -> {g('reward_last')}, eval reward {g('eval_reward_first')} -> {g('eval_reward_last')}, final KL {g('kl_last')}  ({num(summary.get('ppo_wall_seconds'), 0)} s)")
    gold = summary.get("gold")
    if gold:
        lines += [f"gold table ({gold['data']}, greedy; {num(gold.get('wall_seconds'), 0)} s):", format_table(gold["rows"])]
        if gold.get("rl"):
            lines.append(f"verdict: the {gold['rl']} model against the {gold['reference']} model")
    total = sum(v for k, v in summary.items() if k.endswith("_wall_seconds") and isinstance(v, (int, float)))
    lines += [f"wall time (stages + gold): {total:.0f} s", f"final model: {summary['final_model']}", f"curves: {summary['tensorboard']}"]
    lines.append(f"verdict: {summary['verdict']}" + "".join(f"\nWARNING: {r}" for r in summary["verdict_reasons"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Subcommands (what run_pipeline.sh calls)
# ---------------------------------------------------------------------------------------------


def log(cfg: PipelineConfig, message: str) -> None:
    """To stderr (stdout carries answers to the bash script) and to output_root/driver.log."""
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
    print(f"[driver] {message}", file=sys.stderr, flush=True)
    root = Path(cfg.output_root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOG_NAME, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def cmd_prepare(cfg: PipelineConfig, stage: str) -> list[str]:
    """['skip'] for a finished stage, else the stage's argv after the cross-stage checks pass.

    Raises:
        DriverError: a check failed or the stage's output is stale.
    """
    if stage_status(cfg, stage) == "done":
        log(cfg, f"{stage}: skipped, already complete ({merged_dir(cfg, stage)}/manifest.json)")
        return ["skip"]
    problems = checks_before(cfg, stage)
    if problems:
        raise DriverError(f"{stage}: cross-stage checks failed:\n" + "\n".join(f"  - {p}" for p in problems))
    argv = stage_argv(cfg, stage)
    record_time(cfg, stage, "started")
    log(cfg, f"{stage}: running {' '.join(argv)}")
    return argv


def cmd_finish(cfg: PipelineConfig, stage: str) -> None:
    """Raises DriverError when the new merged folder fails its checks."""
    problems = checks_after(cfg, stage)
    if problems:
        raise DriverError(f"{stage}: output checks failed:\n" + "\n".join(f"  - {p}" for p in problems))
    record_time(cfg, stage, "finished")
    log(cfg, f"{stage}: finished, {merged_dir(cfg, stage)} checked against its parent {parent_path(cfg, stage)}")


@contextlib.contextmanager
def answers_only_on_stdout():
    """Yield a stream for the answers to the bash script; while inside, everything else written
    to file descriptor 1 (libraries that log to stdout, e.g. DeepSpeed's accelerator notice when
    the embedded model is first converted) goes to stderr, so it cannot become part of an argv."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real descriptor (e.g. an embedding host): nothing to protect
        yield sys.stdout
        return
    answer = os.fdopen(os.dup(saved), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        yield answer
    finally:
        sys.stdout.flush()
        answer.flush()
        answer.close()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: Optional[list[str]] = None) -> int:
    if argv is None and not sys.stdout.isatty():
        with answers_only_on_stdout() as answer:
            return run_command(list(sys.argv[1:]), answer)
    return run_command(list(sys.argv[1:] if argv is None else argv), sys.stdout)


def run_command(args: list[str], answer) -> int:
    """One subcommand; what the bash script reads goes to `answer`, everything else to stderr."""
    usage = "usage: python -m pipeline.driver {stages,prepare,finish,summarize,report-dir} CONFIG [STAGE] [--from S|--only S] [--key value ...]"
    if len(args) < 2 or args[0] not in ("stages", "prepare", "finish", "summarize", "report-dir"):
        print(usage, file=sys.stderr)
        return 2
    command, config_path, rest = args[0], args[1], args[2:]
    stage = None
    if command in ("prepare", "finish"):
        if not rest or rest[0] not in STAGE_ORDER:
            print(f"{command}: needs a stage ({', '.join(STAGE_ORDER)})\n{usage}", file=sys.stderr)
            return 2
        stage, rest = rest[0], rest[1:]
    try:
        cfg, selection = load_pipeline(config_path, rest)
        if command == "stages":
            planned = planned_stages(cfg, selection)
            problems = stage_config_problems(cfg, planned)
            if problems:
                raise ConfigError(problems, config_path)
            print("\n".join(planned), file=answer)
        elif command == "prepare":
            print("\n".join(cmd_prepare(cfg, stage)), file=answer)
        elif command == "finish":
            cmd_finish(cfg, stage)
        elif command == "report-dir":
            print(cfg.output_root if cfg.report else "", file=answer)
        else:
            summary = summarize(cfg)
            log(cfg, f"summary written to {Path(cfg.output_root) / 'summary.json'} (verdict {summary['verdict']})")
            print(format_summary(summary), file=answer)
    except (ConfigError, DriverError, GoldError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
