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

import re
from pathlib import Path
from typing import Optional, Sequence

import yaml

import stages as registry
from data_formats.sources import DataError, expand_entry
from data_formats.validate import data_problems, read_and_parse
from pipeline.config import ConfigError, load_config
from pipeline.engine.identity import TRAINING_DATA, data_digest, output_changes, training_entries
from pipeline.modeling.handoff import link_problems, manifest_problems, pairing_problems
from pipeline.modeling.manifest import read_manifest, weights_hash
from pipeline.tools.chain_config import (
    DriverError,
    PipelineConfig,
    entry,
    model_refs,
    referenced_stage,
    reward_stage,
    stage_config,
)

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
        DriverError: the path is not a local folder (the driver checks manifests, so it needs one), or
            the embedded model cannot be converted here.
    """
    from pipeline.modeling.embedded import EmbeddedError, is_embedded, materialize

    try:
        folder = materialize() if is_embedded(path) else Path(path)
    except EmbeddedError as err:
        raise DriverError(f"base_model: {err}") from err
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


def reward_path(cfg: PipelineConfig) -> Optional[Path]:
    """The reward model of the chain: its reward stage's merged folder, else `reward_model`, else None."""
    rm = reward_stage(cfg)
    if rm is not None:
        return merged_dir(cfg, rm).resolve()
    return Path(cfg.reward_model).resolve() if cfg.reward_model else None


def stage_reward_path(cfg: PipelineConfig, stage: str) -> Optional[Path]:
    """The reward model `stage` reads (None: it reads none, or an optional one that is not there)."""
    return None if registry.info(stage).reward_model == "none" else reward_path(cfg)


def model_path(cfg: PipelineConfig, value: str) -> Path:
    """The folder a model key names: the chain stage's merged model for `stage:NAME`, else the value."""
    name = referenced_stage(value)
    return merged_dir(cfg, name).resolve() if name else Path(value)


# ---------------------------------------------------------------------------------------------
# Done-ness and cross-stage checks
# ---------------------------------------------------------------------------------------------


def stage_status(cfg: PipelineConfig, stage: str) -> str:
    """'done' when the stage's merged output is complete and built on the current parent, else 'todo'.

    Raises:
        DriverError: the output exists but is stale (built on another parent, with another
            config than the pipeline config now gives it, or on other files under the data keys its
            manifest's `data_digest_keys` names: data.train, distill's data.completions) or its weights no
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
        output_changes(yaml.safe_load(saved.read_text(encoding="utf-8")) or {}, stage_config(cfg, stage))
        if saved.is_file()
        else []
    )
    if changed:
        raise DriverError(
            f"{folder} was built with the config in {saved}, which differs from what the pipeline config now "
            f"gives this stage ({'; '.join(changed)}); delete {stage_dir(cfg, stage)} to rebuild it"
        )
    recorded = manifest.get("data_digest")  # outputs written before it was recorded are not checked
    keys = manifest.get("data_digest_keys") or TRAINING_DATA  # the keys the stage trained on (Stage.training_data)
    if recorded and recorded != data_digest(training_entries(stage_config(cfg, stage), keys)):
        files = ", ".join(f"{key}'s" for key in keys)
        raise DriverError(
            f"{folder} is stale: its training data ({files} files) changed since it was trained; delete "
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


def not_run(cfg: PipelineConfig, stage: str) -> str:
    """Why a stage another one reads cannot be read yet, in the driver's one wording."""
    return (
        f"{stage} has not run: {merged_dir(cfg, stage).resolve()} does not exist yet; run the pipeline from "
        f"{stage} (--from {stage})"
    )


def stage_inputs(cfg: PipelineConfig, stage: str) -> list[str]:
    """The chain stages whose merged models `stage` reads: its parent, the chain's reward stage where
    it reads a reward model, and the stages its `stage:NAME` model keys name."""
    out = [parent_stage(cfg, stage)]
    out += [reward_stage(cfg)] if stage_reward_path(cfg, stage) is not None else []
    out += [referenced_stage(value) for value in model_refs(cfg, stage).values()]
    return [s for s in out if s is not None]


def selection_problems(cfg: PipelineConfig, planned: Sequence[str]) -> list[str]:
    """What a selection (`--from S`, `--only S`) needs of the enabled stages before its first stage
    (docs/pipeline.md): one that a planned stage reads must have finished, and one that finished
    must be fresh (stage_status), since the planned stages build on it and the summary reports it.
    Empty when the plan starts at the chain's first enabled stage. `relay validate` and the
    driver's plan both ask it, so a selection validate passes is one the run accepts."""
    if not planned:
        return []
    read = {s for p in planned for s in stage_inputs(cfg, p)}
    out = []
    for stage in cfg.chain[: cfg.chain.index(planned[0])]:
        if not entry(cfg, stage).enabled:
            continue
        try:
            if stage_status(cfg, stage) == "done":
                continue
        except DriverError as err:
            out.append(str(err))
            continue
        if stage in read:
            out.append(not_run(cfg, stage))
    return out


def plan_problems(cfg: PipelineConfig, planned: Sequence[str]) -> list[str]:
    """Every problem that would stop the planned stages, found before the first one starts: their
    configs and data (stage_config_problems) and the stages before the selection
    (selection_problems). What `relay validate` reports for a pipeline and the driver's plan refuses."""
    return stage_config_problems(cfg, planned) + selection_problems(cfg, planned)


def checks_before(cfg: PipelineConfig, stage: str) -> list[str]:
    """Cross-stage checks before `stage` starts: its parent is intact and agrees with its own
    parent; for a stage reading a reward model, the reward model and the policy share tokenizer,
    template and vocab."""
    parent, previous = parent_path(cfg, stage), parent_stage(cfg, stage)
    if previous is not None and not (parent / "config.json").is_file():  # e.g. --from sft on a fresh output_root
        return [f"{not_run(cfg, previous)}, or point base_model at a model and leave {previous} out of the chain"]
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
                stage_cfg = load_config(registry.config_class(stage), argv)
            except ConfigError as err:
                # the rendered file is a temporary one: its name and lines mean nothing to the user
                rendered = re.compile(rf"^{re.escape(str(path))}(:\d+)?: ")
                problems += [f"stages.{stage}: {rendered.sub('', p)}" for p in err.problems]
                continue
            problems += [f"stages.{stage}: {p}" for p in stage_data_problems(stage, stage_cfg.data)]
    return problems


def stage_data_problems(stage: str, data) -> list[str]:
    """What a stage's data paths and records would stop it on (the checks its own start makes before
    tokenizing: a path that names no file, a record its kind of data cannot parse), so that a later
    stage's data is checked before the first stage trains. Records are read from files only, and only
    where bad ones stop the stage (data.on_error strict); a streamed corpus is left to its stage."""
    out = data_problems(data.train, "data.train") + data_problems(data.eval, "data.eval")
    if data.on_error != "strict" or getattr(data, "streaming", False):
        return out
    files = [e for e in [*data.train, *data.eval] if not data_problems([e], "") and expand_entry(e)[1] is None]
    parsing = {  # what the stage's own reading passes (data_formats.datasets)
        "fmt": data.format,
        "text_field": getattr(data, "text_field", "text"),
        "system_prompt": getattr(data, "system_prompt", None),
        "margin_field": getattr(data, "margin_field", None),
    }
    _, bad = read_and_parse(files, registry.record_kind(stage), max_record_bytes=data.max_record_bytes, **parsing)
    return out + ([str(DataError(bad))] if bad else [])  # as the stage words them
