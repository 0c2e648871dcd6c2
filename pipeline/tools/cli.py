"""`relay`: the one command a user lives in.

    relay train CONFIG.yaml [--stage S] [--nproc N] [--section.key value ...]   # one stage (YAML or JSON)
    relay pipeline [CONFIG.yaml] [--from S | --only S] [--section.key value ...]  # PT -> SFT -> RM -> PPO
    relay validate CONFIG.yaml|.json [--section.key value ...]   # every config/model/data problem, no training
    relay validate --kind sft FILES...                      # data files record by record (FILE:LINE: reason)
    relay capabilities [--write-readme [README.md]]         # which combinations Relay runs (the README's table)
    relay show FILE [--boundaries]                          # what a conversation trains on
    relay chat --model DIR [--prompt TEXT] [--compare DIR2]
    relay report RUN_DIR                                    # report.md + plots
    relay merge --base DIR --adapter DIR --out DIR          # LoRA adapter -> full model
    relay export RUN_OR_MERGED_DIR --out DIR [--gguf]       # a shippable model folder + model card
    relay serve DIR [--port 8000]                           # OpenAI-compatible /v1/chat/completions
    relay bundle --out DIR | --check DIR                    # wheels for an offline CUDA torch node
    relay sample --model DIR --data.train [P.jsonl] --out F.jsonl --mode sft|dpo   # scored samples -> SFT/DPO data
    relay eval MODEL [MODEL ...] [--tasks T1,T2] [--include_path DIR]   # lm-evaluation-harness scores, local tasks

The per-stage scripts (`stages/*.py`, `run_scripts/run_*.sh`) stay; `relay train` runs the same
scripts (through torchrun when --nproc > 1). Every subcommand's `--help` lists its options.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import stages as registry
from data_formats.llamafactory_registry import REGISTRY_NAME
from data_formats.validate import main as validate_data
from pipeline.algorithms.judge_config import JudgeConfig
from pipeline.config import (
    ConfigError,
    DistributedConfig,
    GenerationConfig,
    ModelConfig,
    StageConfig,
    ToolsConfig,
    capability_table,
    load_config,
)
from pipeline.config.capabilities import config_refusals
from pipeline.config.loading import read_yaml
from pipeline.engine.tracking import quiet_console
from pipeline.modeling.preflight import model_problems
from pipeline.tools.chain import plan_problems, stage_data_problems
from pipeline.tools.chain_config import load_pipeline, planned_stages

REPO = Path(__file__).resolve().parents[2]
# A subcommand's module is imported only when it runs: `relay report` should not pay for torch. What
# `relay` imports at its top is torch-free (tests/test_layout.py checks it).
COMMANDS = {
    "train": (None, "run one stage from its YAML (the stage the config is for)"),
    "pipeline": (None, "run PT -> SFT -> RM -> PPO, each stage's merged model the next one's base"),
    "validate": (None, "check a config (model, data, keys) or data files, loading no model"),
    "capabilities": (None, "print which stage/backend/tools/adapter/engine combinations Relay runs"),
    "show": ("data_formats.show", "show what a conversation trains on (tokens, masks)"),
    "chat": ("pipeline.tools.chat", "chat with a merged model"),
    "report": ("pipeline.tools.report", "write report.md and plots for a run"),
    "merge": ("pipeline.modeling.merge", "merge a LoRA adapter into its base model"),
    "export": ("pipeline.tools.release", "write a shippable model folder with a model card (and GGUF)"),
    "serve": ("pipeline.tools.serve", "serve a model folder on an OpenAI-compatible HTTP API"),
    "embedded": ("pipeline.modeling.embedded", "locate (converting once) the embedded model folder"),
    "bundle": ("pipeline.tools.bundle", "download the wheels an offline CUDA torch node needs (or check a bundle)"),
    "sample": (
        "pipeline.tools.sample",
        "sample N answers per prompt, score them, write best-of-N SFT or best/worst DPO data",
    ),
    "eval": ("pipeline.tools.evaluate", "score models on lm-evaluation-harness tasks over local files"),
}
LOADS_MODELS = ("chat", "merge", "export", "serve", "sample", "eval")
"""Subcommands that load models: their loading bars and known-harmless warnings are silenced."""
PIPELINE_KEYS = ("stages", "chain", "output_root", "base_model")
USAGE_LINE = re.compile(r"stages/(\w+)\.py|run_scripts/run_(\w+)\.sh")


def usage() -> str:
    lines = ["usage: relay COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "relay COMMAND --help shows a command's options. Start with: bash run_scripts/demo.sh"]
    return "\n".join(lines)


class CLIError(ValueError):
    """A command line that cannot run; the message is one line for the user."""


def stage_names() -> list[str]:
    return list(registry.STAGES)


def stage_of_config(config: str, explicit: Optional[str] = None) -> str:
    """Which stage a YAML is for: `--stage`, else the stage script its usage line names (every
    shipped YAML opens with its command), else a stage name in the file name (`qwen_sft.yaml`).

    Raises:
        CLIError: no such file, a pipeline config, or the stage cannot be told.
    """
    names = stage_names()
    if explicit is not None:
        if explicit not in names:
            raise CLIError(f"--stage {explicit!r} is not one of {', '.join(names)}")
        return explicit
    path = Path(config)
    if not path.is_file():
        raise CLIError(f"{config}: no such config file")
    try:
        data = read_yaml(path)
    except ConfigError as err:
        raise CLIError(err.problems[0]) from err
    text = path.read_text(encoding="utf-8")
    if any(k in data for k in PIPELINE_KEYS):
        raise CLIError(f"{config} is a pipeline config: run it with `relay pipeline {config}`")
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        match = USAGE_LINE.search(line)
        if match:
            found = match.group(1) or match.group(2)
            by_module = {registry.script(name).stem: name for name in names}
            if found in names or found in by_module:
                return found if found in names else by_module[found]
    tokens = set(re.split(r"[^a-z0-9]+", path.stem.lower()))
    hits = [n for n in names if n in tokens]
    if len(hits) == 1:
        return hits[0]
    raise CLIError(
        f"cannot tell which stage {config} is for: pass --stage ({'|'.join(names)}), or name the file "
        "after it (e.g. my_sft.yaml)"
    )


CONFIG_OPTIONS = ("--config", "--config_path")
"""The options that name the config, as the stage scripts take them (`--config_path`: Levanter's)."""


def pop_config(args: list[str]) -> Optional[str]:
    """Remove the config from `args` and return it: `--config FILE`, `--config_path FILE`, else the
    first argument when it is no option (None when there is none).

    Raises:
        CLIError: two configs are named, or the option has no value.
    """
    named = [(option, value) for option in CONFIG_OPTIONS if (value := pop_option(args, option)) is not None]
    if args and not args[0].startswith("-"):
        named.insert(0, ("", args.pop(0)))
    if len(named) > 1:
        given = " and ".join(f"{option} {value}".strip() for option, value in named)
        raise CLIError(f"two configs given ({given}): give one")
    return named[0][1] if named else None


CONFIG_SECTIONS = tuple(f.name for f in dataclasses.fields(StageConfig))
"""The keys every stage config has (output_dir and its sections)."""


def is_config_json(path: str) -> bool:
    """Whether a .json file is a stage or pipeline config rather than data: a JSON object (data is an
    array of records, or one record) holding `output_dir`, a stage config section as a mapping
    (`model: {...}`, `train: {...}`), or a pipeline config's keys; what `relay train` would run. A
    file that is no JSON object, and LLaMA-Factory's registry (`dataset_info.json`), are data (and
    their problems are reported as the data's)."""
    if Path(path).name == REGISTRY_NAME:
        return False
    try:
        with open(path, encoding="utf-8-sig") as f:
            if f.read(4096).lstrip()[:1] != "{":  # a JSON array: data, not read whole here
                return False
            f.seek(0)
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(data, dict):
        return False
    sections = [k for k in CONFIG_SECTIONS if k != "output_dir" and isinstance(data.get(k), dict)]
    pipeline = [k for k in PIPELINE_KEYS if k in data and (k != "stages" or isinstance(data[k], dict))]
    return "output_dir" in data or bool(sections) or bool(pipeline)


def pop_option(args: list[str], name: str) -> Optional[str]:
    """Remove `--name VALUE` / `--name=VALUE` from args; return VALUE (None when absent).

    Raises:
        CLIError: the option has no value.
    """
    for i, arg in enumerate(args):
        if arg == name:
            if i + 1 >= len(args):
                raise CLIError(f"{name}: needs a value")
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(name + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


TRAIN_USAGE = f"""usage: relay train CONFIG.yaml [--stage {"|".join(registry.STAGES)}] [--nproc N]
                   [--section.key VALUE ...]

Runs the stage CONFIG is for (its usage line names the stage script, e.g. configs/sft.yaml opens
with `stages/sft.py`; else a stage name in the file name; else --stage). CONFIG is YAML or JSON,
given first or as --config / --config_path FILE. --nproc N > 1 launches N processes with torchrun
on this machine (multi-node: run_scripts/run_pipeline.sh with NNODES).
Overrides are dotted keys: --model.path DIR --train.max_steps 50 --lora.r 8. A text key takes VALUE
as typed (--data.system_prompt "Note: be brief"; null leaves an optional one unset); other keys read
it as YAML (--lora.target_modules "[q_proj, v_proj]").

relay train CONFIG.yaml --help lists every key of that stage."""


def train_command(args: list[str]) -> list[str]:
    """The process to run for `relay train` (pure: the tests read it).

    Raises:
        CLIError: no config, a bad --nproc, or an unknown stage.
    """
    args = list(args)
    stage = pop_option(args, "--stage")
    nproc_text = pop_option(args, "--nproc") or os.environ.get("NPROC", "1")
    if not nproc_text.isdigit() or int(nproc_text) < 1:
        raise CLIError(f"--nproc: {nproc_text!r} is not a number of processes >= 1")
    config = pop_config(args)
    if config is None:
        if stage is None:
            raise CLIError("relay train needs a CONFIG.yaml (or --stage NAME to run a stage on its defaults)")
        argv = list(args)
    else:
        stage = stage_of_config(config, stage)
        argv = ["--config", config, *args]
    if int(nproc_text) == 1:
        return [sys.executable, str(registry.script(stage)), *argv]
    return [
        sys.executable,
        "-m",
        "pipeline.engine.launch",
        "--standalone",
        "--nproc_per_node",
        nproc_text,
        str(registry.script(stage)),
        *argv,
    ]


AXIS_KEYS = (
    "model.finetuning",
    "distributed.engine",
    "distributed.deepspeed_config",
    "generation.backend",
    "generation.correction",
    "tools.funcs",
    "judge.base_url",
)
"""The config keys that place a run in the capability table (pipeline/config/capabilities.py)."""
READ_KEYS = (*AXIS_KEYS, "judge.max_concurrency")
"""What `axis_values` reads: the axes, and what the table's refusal of a judge on N ranks reads."""


def axis_values(config: Optional[str], args: Sequence[str]) -> "SimpleNamespace":
    """The capability axes a stage config and its dotted overrides set, read without loading the
    stage (no torch): the shared sections' defaults, the YAML's values, then the overrides.

    Raises:
        CLIError: the YAML cannot be read.
    """
    sections = {
        "model": ModelConfig(),
        "distributed": DistributedConfig(),
        "generation": GenerationConfig(),
        "tools": ToolsConfig(),
        "judge": JudgeConfig(),
    }
    values = {key: getattr(sections[key.split(".")[0]], key.split(".")[1]) for key in READ_KEYS}
    try:
        data = read_yaml(config) if config else {}
    except ConfigError as err:
        raise CLIError(str(err.problems[0])) from err
    for key in READ_KEYS:
        section, name = key.split(".")
        if isinstance(data.get(section), dict) and name in data[section]:
            values[key] = data[section][name]
    rest = list(args)
    for key in READ_KEYS:
        given = pop_option(rest, f"--{key}")
        if given is not None:
            values[key] = [] if given.strip() in ("[]", "") and key == "tools.funcs" else given
    spaces = {name: SimpleNamespace() for name in sections}
    for key, value in values.items():
        section, name = key.split(".")
        setattr(spaces[section], name, value)
    # The judge as its own class (the table asks it for its refusal on N ranks); a value it cannot
    # read stays the default here: the stage's own checks name it.
    try:
        concurrency = int(values["judge.max_concurrency"])
    except (TypeError, ValueError):
        concurrency = sections["judge"].max_concurrency
    spaces["judge"] = dataclasses.replace(
        sections["judge"], base_url=values["judge.base_url"], max_concurrency=concurrency
    )
    return SimpleNamespace(**spaces)


def combination_problems(stage: str, config: Optional[str], args: Sequence[str], nproc: int) -> list[str]:
    """The capability table's refusal of the run `relay train` would start with `nproc` ranks
    (pipeline/config/capabilities.py), asked before torchrun starts any rank."""
    return config_refusals(stage, axis_values(config, args), ranks=nproc)


def run_train(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(TRAIN_USAGE)
        return 0
    command = train_command(args)
    rest = list(args)
    stage, nproc = pop_option(rest, "--stage"), int(pop_option(rest, "--nproc") or os.environ.get("NPROC", "1"))
    config = pop_config(rest)
    stage = stage_of_config(config, stage) if config else stage
    problems = combination_problems(stage, config, rest, nproc)
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    return hand_over(command)


def hand_over(command: list[str], env: Optional[dict] = None) -> int:
    """Become `command` (exec: the same process, its exit code relay's): a signal to `relay train`
    or `relay pipeline` (a scheduler's preemption, `kill`, Ctrl-C) reaches the stage or the driver
    itself, which finishes its step, saves and says so. Run as a child, the command went on alone
    once a signal had ended relay's own process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, dict(os.environ) if env is None else env)
    return 1  # not reached: execvpe returns only by raising


CAPABILITIES_USAGE = """usage: relay capabilities [--write-readme [README.md]]

Prints which combinations of stage, generation backend, tools, adapter, distributed engine and
mismatch correction Relay runs (each one trained by a test), and why every other one is refused.
--write-readme rewrites the table between the README's capability markers."""


def run_capabilities(args: list[str]) -> int:
    if args and args[0] in ("-h", "--help"):
        print(CAPABILITIES_USAGE)
        return 0
    if args and args[0] == "--write-readme":
        path = Path(args[1]) if len(args) > 1 else REPO / "README.md"
        if not capability_table.write_readme(path):
            print(
                f"error: {path} has no {capability_table.BEGIN} ... {capability_table.END} markers "
                "to write the table between",
                file=sys.stderr,
            )
            return 2
        print(f"{path}: capability table written")
        return 0
    if args:
        print(f"error: unknown argument {args[0]!r}\n\n{CAPABILITIES_USAGE}", file=sys.stderr)
        return 2
    try:
        print(capability_table.render(), flush=True)
    except BrokenPipeError:  # `relay capabilities | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


VALIDATE_USAGE = f"""usage: relay validate CONFIG.yaml [--stage S] [--nproc N] [--section.key VALUE ...]
       relay validate [--kind KIND] [--format F] FILES...

With a stage or pipeline config: every problem a run would hit before training (unknown keys, values,
the model folder, data files and records, and whether Relay runs its combination of stage, backend,
tools, adapter and engine with N ranks: `relay capabilities`), loading the tokenizer but no model.
CONFIG is a .yaml/.yml file, a .json file holding a config (a JSON object with output_dir or a
config's sections, as `relay train` runs it; other .json files are data), or --config /
--config_path FILE. With data files:
each record is checked and every bad one reported as FILE:LINE: reason. KIND is a data kind (pt, sft,
rm, prompts, kto) or any stage name ({", ".join(registry.STAGES)}: the kind of data it reads)."""


def data_kind_args(args: list[str]) -> list[str]:
    """`args` with a stage name given to --kind replaced by the kind of data that stage reads.

    Raises:
        CLIError: --kind names neither a data kind nor a registered stage (one line listing both).
    """
    out = list(args)
    for i, arg in enumerate(out):
        name, eq, value = arg.partition("=")
        if arg == "--kind" and i + 1 < len(out):
            out[i + 1] = _data_kind(out[i + 1], registry.STAGES)
        elif name == "--kind" and eq:
            out[i] = f"--kind={_data_kind(value, registry.STAGES)}"
    return out


def _data_kind(value: str, stages: dict) -> str:
    if value in stages:
        return registry.record_kind(value)
    if value in registry.RECORD_KINDS.values():
        return value
    kinds = ", ".join(registry.RECORD_KINDS.values())
    raise CLIError(f"--kind {value!r}: not a data kind ({kinds}) nor a stage ({', '.join(stages)})")


def validate_pipeline(config: str, args: list[str]) -> str:
    """Every planned stage of a pipeline config checked (model folders, configs, data, and what
    `--from` / `--only` needs of the stages before them: `chain.plan_problems`, which the driver's
    plan asks too), read as `relay pipeline` reads it: the config's own path from here, every path
    in it from the repository root (run_scripts/run_pipeline.sh); returns the line saying what was
    checked.

    Raises:
        ConfigError: every problem.
    """
    resolved = str(Path(config).resolve())
    with contextlib.chdir(REPO):
        cfg, selection = load_pipeline(resolved, args)
        planned = planned_stages(cfg, selection)
        problems = model_problems(cfg.base_model, "base_model") + plan_problems(cfg, planned)
        if cfg.reward_model:
            problems += model_problems(cfg.reward_model, "reward_model", need="reward")
    if problems:
        raise ConfigError(problems, config)
    return f"{config}: pipeline config OK; stages {' -> '.join(planned)} into {cfg.output_root}"


def with_records(stage: str, data, problems: list[str]) -> ConfigError:
    """`problems` that stop a stage before it reads its records, with its records' own problems
    beside them (found in one round, not after the others are fixed)."""
    return ConfigError(problems + [p for p in stage_data_problems(stage, data) if p not in problems])


def validate_config(config: str, args: list[str]) -> int:
    """`relay validate CONFIG.yaml`: the stage's whole validation (preflight, data) or, for a
    pipeline YAML, every planned stage's config. Prints problems (exit 2) or what was checked."""
    args = list(args)
    explicit = pop_option(args, "--stage")
    nproc_text = pop_option(args, "--nproc") or "1"
    if not nproc_text.isdigit() or int(nproc_text) < 1:
        print(f"error: --nproc: {nproc_text!r} is not a number of processes >= 1", file=sys.stderr)
        return 2
    nproc = int(nproc_text)
    try:
        try:
            stage = stage_of_config(config, explicit)
        except CLIError as err:
            if "is a pipeline config" not in str(err):
                raise
            print(validate_pipeline(config, args))
            return 0
        from pipeline.engine.stage import hide_unrequested_backends  # torch: only when a stage's config is validated

        cls = registry.stage_class(stage)
        cfg = load_config(cls.config_class, ["--config", config, *args], check=False)
        if problems := cfg.problems():
            raise with_records(stage, cfg.data, problems)
        if nproc > 1:  # the stage itself checks the one-process run
            refused = config_refusals(stage, cfg, ranks=nproc)
            if refused:
                raise ConfigError(refused, config)
        hide_unrequested_backends(cfg)
        runner = cls(cfg)
        try:
            runner.validate()
        except ConfigError as err:
            if runner.tokenizer is not None:  # it stopped on its records: they are listed
                raise
            raise with_records(stage, cfg.data, err.problems) from err
    except CLIError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    held_out = f", {len(runner.eval_samples)} held-out" if runner.eval_samples else ""
    # a streamed PT corpus is read as it trains: its records were checked, none is held in memory
    training = (
        "a streamed training corpus"
        if getattr(runner, "stream", None)
        else f"{len(runner.train_samples)} training samples"
    )
    print(f"{config}: {stage} config OK; model {cfg.model.path}; {training}{held_out}; outputs to {cfg.output_dir}")
    return 0


def run_validate(args: list[str]) -> int:
    if args and args[0] in ("-h", "--help"):
        print(VALIDATE_USAGE)
        return 0
    if any(arg.split("=", 1)[0] in CONFIG_OPTIONS for arg in args):
        rest = list(args)
        config = pop_config(rest)
        return validate_config(config, rest)
    if args and (args[0].endswith((".yaml", ".yml")) or (args[0].endswith(".json") and is_config_json(args[0]))):
        return validate_config(args[0], args[1:])
    return int(validate_data(data_kind_args(args)) or 0)


def run_pipeline(args: Sequence[str]) -> int:
    """Run the bash driver (it lives in the source tree: Relay is installed editable)."""
    script = REPO / "run_scripts" / "run_pipeline.sh"
    if not script.is_file():
        print(f"error: {script} not found; `relay pipeline` needs the Relay source tree", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("PYTHON", sys.executable)
    return hand_over(["bash", str(script), *args], env)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(command, list(COMMANDS), n=1)
        hint = f"; did you mean 'relay {close[0]}'?" if close else ""
        print(f"error: unknown command {command!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        if command == "train":
            return run_train(rest)
        if command == "validate":
            return run_validate(rest)
        if command == "capabilities":
            return run_capabilities(rest)
        if command == "pipeline":
            return run_pipeline(rest)
        if command == "show":
            rest = data_kind_args(rest)
    except CLIError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if command in LOADS_MODELS and not {"-h", "--help"} & set(rest):
        quiet_console()
    result = importlib.import_module(COMMANDS[command][0]).main(rest)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
