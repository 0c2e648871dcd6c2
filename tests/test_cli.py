"""The `relay` front door (pipeline/tools/cli.py) and config help (pipeline/config/help.py): every
subcommand's --help works, help lists each key once under its section, TRL/HF habits get a
"did you mean", `relay train` finds the stage a YAML is for."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import stages as registry
from pipeline.config import ConfigError, load_config
from pipeline.config import help as help_module
from pipeline.tools import cli
from stages import script
from stages.sft import SFTConfig

REPO = Path(__file__).resolve().parents[1]
SUBCOMMANDS = [
    "train",
    "pipeline",
    "validate",
    "show",
    "chat",
    "report",
    "merge",
    "export",
    "serve",
    "embedded",
    "bundle",
]


@pytest.mark.parametrize("command", [c for c in SUBCOMMANDS if c not in ("pipeline", "embedded")])
def test_every_subcommand_help_exits_0(command, capsys):
    try:
        code = cli.main([command, "--help"])
    except SystemExit as exit_:  # argparse's --help
        code = exit_.code
    assert code == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_pipeline_help_exits_0():
    for argv in (
        ["bash", "run_scripts/run_pipeline.sh", "--help"],
        [sys.executable, "-m", "pipeline.tools.cli", "pipeline", "--help"],
    ):
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "--from sft" in done.stdout


def test_top_level_usage_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {c} " in out for c in SUBCOMMANDS)
    assert cli.main(["trian"]) == 2
    assert "did you mean 'relay train'?" in capsys.readouterr().err


def test_stage_help_lists_each_key_once_by_section(capsys):
    with pytest.raises(SystemExit) as exit_:
        load_config(SFTConfig, ["--help"], prog="relay train configs/sft.yaml")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--config FILE.yaml" in out and "--config_path" not in out
    assert out.count("--model.path ") == 1 and "--model str" not in out and "Config file for" not in out
    lines = out.splitlines()
    assert (
        lines.index("model:")
        < lines.index(next(line for line in lines if line.startswith("  --model.path")))
        < lines.index("lora:")
    )
    assert "Base model: a Hugging Face folder" in out  # the field docstring is the help text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "Qwen/Qwen2.5-0.5B"], "--model: is a section, not a value; set its keys, e.g. '--model.path'"),
        (
            ["--model_name_or_path", "Qwen/Qwen2.5-0.5B"],
            "--model_name_or_path: unknown option; did you mean '--model.path'?",
        ),
        (["--learning_rate", "1e-4"], "--learning_rate: unknown option; did you mean '--train.learning_rate'?"),
        (
            ["--per_device_train_batch_size", "4"],
            "--per_device_train_batch_size: unknown option; did you mean '--train.batch_size'?",
        ),
    ],
)
def test_trl_habits_get_relay_keys(argv, message):
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, argv)
    assert err.value.problems == [message]


SEED_HABITS = [
    ("train_config", "did you mean '--config'? (a YAML or JSON config file)"),
    ("lora_rank", "did you mean '--lora.r'?"),
    ("qlora", "did you mean '--model.finetuning'? (set it to qlora: a 4-bit base with LoRA)"),
    ("checkpointing_steps", "did you mean '--checkpoint.keep'?"),
    ("tb_dir", "did you mean '--output_dir'? (TensorBoard events go to <output_dir>/runs/;"),
    ("num_train_epochs", "did you mean '--train.max_steps'? (epochs are not steps"),
    ("data_paths", "did you mean '--data.train'?"),
    ("weighted_loss_mode", "did you mean '--multitask.weighted_loss_mode'? (sft only)"),
    ("padding_mode", "did you mean '--data.padding_mode'? (not in pt)"),
    ("role_markers", "did you mean '--data.role_markers'?"),
    ("seq_length", "did you mean '--train.seq_length'?"),
    ("train_file_dir", "did you mean '--data.train'?"),
    ("validation_file_dir", "did you mean '--data.eval'?"),
    ("max_train_samples", "did you mean '--data.max_samples'?"),
    ("max_eval_samples", "did you mean '--train.eval_batches'? (the held-out set is capped in batches"),
    ("load_in_8bit", "did you mean '--model.finetuning'? (Relay has no 8-bit loading; qlora"),
    ("block_size", "did you mean '--train.seq_length'?"),
    ("validation_split_percentage", "did you mean '--data.eval_fraction'? (a fraction of the training data, not a"),
]


@pytest.mark.parametrize("option, hint", SEED_HABITS, ids=[o for o, _ in SEED_HABITS])
def test_mftcoder_medicalgpt_and_levanter_habits_get_the_relay_key(option, hint):
    with pytest.raises(ConfigError) as err:
        load_config(SFTConfig, [f"--{option}", "1"])
    assert len(err.value.problems) == 1
    assert err.value.problems[0].startswith(f"--{option}: unknown option; {hint}")


def _has_key(cls: type, dotted: str) -> bool:
    import dataclasses
    import typing

    from pipeline.config.help import section_of

    current = cls
    for part in dotted.split("."):
        hints = typing.get_type_hints(current) if dataclasses.is_dataclass(current) else {}
        if part not in hints:
            return False
        current = section_of(hints[part])
    return True


@pytest.mark.parametrize("option", sorted(help_module.HABITS))
def test_every_habit_names_keys_that_exist_in_the_stages_it_says(option):
    habit = help_module.HABITS[option]
    configs = {name: registry.config_class(name) for name in registry.STAGES}
    hint = help_module.habit_hint(option)
    if habit.key == "config":  # the config file option, not a key
        assert load_config(SFTConfig, ["--config", str(REPO / "configs" / "sft.yaml")]).output_dir
    else:
        have = {name for name, cls in configs.items() if _has_key(cls, habit.key)}
        expected = set(habit.only) or set(configs) - set(habit.not_in)
        assert have == expected, f"{habit.key} is a key of {sorted(have)}"
        assert not (habit.only and habit.not_in)
        for name in have:
            with pytest.raises(ConfigError) as err:
                load_config(configs[name], [f"--{option}", "1"])
            assert err.value.problems == [f"--{option}: unknown option; {hint}"]
    for named in re.findall(r"\b[a-z_]+\.[a-z_]+\b", habit.note):  # the keys its note names
        assert any(_has_key(cls, named) for cls in configs.values()), named
    for named in re.findall(r"<([a-z_]+)>", habit.note):
        assert all(_has_key(cls, named) for cls in configs.values()), named


@pytest.mark.parametrize("name", ["pt", "sft", "rm", "ppo"])
def test_shipped_stage_yaml_names_its_stage(name):
    assert cli.stage_of_config(str(REPO / "configs" / f"{name}.yaml")) == name


def test_stage_from_file_name_or_flag(tmp_path):
    mine = tmp_path / "qwen_sft.yaml"
    mine.write_text("output_dir: outputs/qwen\n")
    assert cli.stage_of_config(str(mine)) == "sft"
    other = tmp_path / "mine.yaml"
    other.write_text("output_dir: x\n")
    with pytest.raises(cli.CLIError, match=r"cannot tell which stage .*mine.yaml is for: pass --stage"):
        cli.stage_of_config(str(other))
    assert cli.stage_of_config(str(other), "rm") == "rm"
    with pytest.raises(cli.CLIError, match="is a pipeline config: run it with `relay pipeline"):
        cli.stage_of_config(str(REPO / "configs" / "pipeline.yaml"))


def test_train_command_plain_and_torchrun():
    config = str(REPO / "configs" / "sft.yaml")
    assert cli.train_command([config, "--train.max_steps", "3"]) == [
        sys.executable,
        str(script("sft")),
        "--config",
        config,
        "--train.max_steps",
        "3",
    ]
    launched = cli.train_command([config, "--nproc", "2"])
    assert launched[:6] == [
        sys.executable,
        "-m",
        "pipeline.engine.launch",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]  # torchrun, one line on early ends
    assert launched[6:] == [str(script("sft")), "--config", config]
    with pytest.raises(cli.CLIError, match="--nproc: 'two'"):
        cli.train_command([config, "--nproc", "two"])


def test_validate_config_reports_a_bad_model_in_one_line(tmp_path, capsys):
    missing = tmp_path / "Qwen2.5-0.5B-Instruct"
    assert cli.main(["validate", str(REPO / "configs" / "sft.yaml"), "--model.path", str(missing)]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [f"  - model.path: {missing}: no such folder"]


def write_jsonl(path: Path, records: list) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bring_your_own_sharegpt_walkthrough_validates(tmp_path, tiny_model_dir, capsys):
    """README's Qwen + ShareGPT YAML, with the model and data paths pointed at stand-ins."""
    turns = [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4."}]
    data = write_jsonl(tmp_path / "sg" / "train.jsonl", [{"conversations": turns}] * 50)
    config = str(REPO / "configs" / "examples" / "qwen_sharegpt_sft.yaml")
    assert cli.stage_of_config(config) == "sft"
    assert cli.main(["validate", config, "--model.path", str(tiny_model_dir), "--data.train", f"[{data}]"]) == 0
    assert "sft config OK" in capsys.readouterr().out


def test_validate_of_a_streamed_corpus_does_not_say_zero_samples(tmp_path, tiny_model_dir, capsys):
    """A streamed PT corpus holds no sample in memory: validate said "0 training samples"."""
    data = write_jsonl(tmp_path / "pt" / "train.jsonl", [{"text": f"document {i} " * 5} for i in range(6)])
    argv = ["validate", str(REPO / "configs" / "pt.yaml"), "--model.path", str(tiny_model_dir)]
    argv += ["--data.train", f"[{data}]", "--data.eval", "[]", "--data.streaming", "true"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "pt config OK" in out and "a streamed training corpus" in out and "0 training samples" not in out


def test_bring_your_own_mftcoder_walkthrough_validates(tmp_path, tiny_model_dir, capsys):
    """README's MFTCoder chatML YAML (one file per task, role markers, CoBa); DeepSpeed needs CUDA,
    so this CPU check runs it on ddp."""
    for task in ("code_qa", "unit_tests"):
        rounds = [{"role": "human", "content": f"Write {task}"}, {"role": "bot", "content": "def f(): return 1"}]
        write_jsonl(tmp_path / "mft" / f"{task}.jsonl", [{"chat_rounds": rounds}] * 6)
    config = str(REPO / "configs" / "examples" / "mftcoder_chatml_sft.yaml")
    argv = [
        "validate",
        config,
        "--model.path",
        str(tiny_model_dir),
        "--data.train",
        f"[{tmp_path / 'mft'}]",
        "--data.eval",
        f"[{tmp_path / 'mft'}]",
        "--distributed.engine",
        "ddp",
    ]
    assert cli.main(argv) == 0
    assert "sft config OK" in capsys.readouterr().out


def _json_configs(folder: Path) -> tuple[Path, Path]:
    """configs/sft.yaml and configs/pipeline.yaml written as JSON (MFTCoder's configs are JSON),
    the SFT data paths made absolute."""
    from pipeline.config.loading import plain, read_yaml

    sft = plain(read_yaml(REPO / "configs" / "sft.yaml"))
    for key in ("train", "eval"):
        sft["data"][key] = [str(REPO / entry) for entry in sft["data"][key]]
    stage, pipeline = folder / "cfg_sft.json", folder / "cfg_pipeline.json"
    stage.write_text(json.dumps(sft, indent=1))
    pipeline.write_text(json.dumps(plain(read_yaml(REPO / "configs" / "pipeline.yaml")), indent=1))
    return stage, pipeline


def test_validate_reads_a_json_config_as_relay_train_runs_it_and_other_json_as_data(tmp_path, monkeypatch, capsys):
    stage, pipeline = _json_configs(tmp_path)
    assert cli.train_command([str(stage)])[1:] == [str(script("sft")), "--config", str(stage)]
    assert cli.main(["validate", str(stage)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"{stage}: sft config OK; model embedded;")
    assert cli.main(["validate", str(pipeline)]) == 0, capsys.readouterr().err
    assert "pipeline config OK; stages pt -> sft -> rm -> ppo" in capsys.readouterr().out
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    data = {
        "array.json": [{"messages": turns}],
        "record.json": {"messages": turns},
        "logged.json": {"model": "gpt-4o", "messages": turns},  # a chat log's record names its model
        "dataset_info.json": {"data": {"file_name": "array.json"}},
    }
    read_as_data = []
    monkeypatch.setattr(cli, "validate_data", lambda args: read_as_data.append(args[-1]) or 0)
    for name, value in data.items():
        (tmp_path / name).write_text(json.dumps(value))
        assert cli.main(["validate", "--kind", "sft", str(tmp_path / name)]) == 0
        assert cli.main(["validate", str(tmp_path / name)]) == 0
    assert read_as_data == [str(tmp_path / name) for name in data for _ in range(2)]


@pytest.mark.parametrize("spelling", [["--config_path", "{}"], ["--config_path={}"], ["--config", "{}"]])
def test_train_and_validate_take_the_config_as_the_stage_scripts_do(spelling, tmp_path, monkeypatch, capsys):
    config = str(REPO / "configs" / "sft.yaml")
    given = [arg.format(config) for arg in spelling]
    assert cli.train_command([*given, "--train.max_steps", "3"]) == cli.train_command(
        [config, "--train.max_steps", "3"]
    )
    checked = []
    monkeypatch.setattr(cli, "validate_config", lambda config, args: checked.append((config, args)) or 0)
    assert cli.main(["validate", *given, "--train.max_steps", "3"]) == 0
    assert checked == [(config, ["--train.max_steps", "3"])]
    assert cli.main(["train", str(REPO / "configs" / "rm.yaml"), *given]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: two configs given") and err.count("\n") == 1


def test_validate_pipeline_config_checks_the_base_model(tmp_path, capsys):
    missing = tmp_path / "Llama-3.2-1B"
    assert cli.main(["validate", str(REPO / "configs" / "pipeline.yaml"), "--base_model", str(missing)]) == 2
    assert f"  - base_model: {missing}: no such folder" in capsys.readouterr().err.splitlines()
    assert cli.main(["validate", str(REPO / "configs" / "pipeline.yaml")]) == 0
    assert "pipeline config OK" in capsys.readouterr().out


def test_a_config_that_cannot_be_read_is_one_line_naming_its_file_and_line(tmp_path, capsys):
    """Not UTF-8, a key given twice (YAML would keep the last: the first `train:`'s keys lost, here and
    in an included file), a syntax error: one line each, naming the file and line, for `validate`
    with and without --stage (the stage is read from the file first) and for `train`; a YAML merge
    (<<) overridden beside it is no duplicate."""
    bad = {
        "binary.yaml": (b"\xff\xfeoutput_dir: x\n", "binary.yaml:1: not UTF-8 text (byte 0)"),
        "twice.yaml": (b"output_dir: x\ntrain: {max_steps: 1}\ntrain: {batch_size: 2}\n", "twice.yaml:3: key 'train'"),
        "syntax.yaml": (b"output_dir: x\ntrain: {max_steps: 1\n", "syntax.yaml:3: expected ',' or '}'"),
        "outer.yaml": (b"lora: !include inner.yaml\n", "inner.yaml:2: key 'r' is given twice (lines 1 and 2)"),
        "lost.yaml": (b"lora: !include gone.yaml\n", f"lost.yaml: !include {tmp_path / 'gone.yaml'}: no such file"),
    }
    (tmp_path / "inner.yaml").write_text("r: 8\nr: 9\n")
    for name, (content, want) in bad.items():
        path = tmp_path / name
        path.write_bytes(content)
        for argv in (["validate", str(path), "--stage", "rm"], ["validate", str(path)], ["train", str(path)]):
            assert cli.main(argv) == 2, argv
            err = capsys.readouterr().err
            assert "Traceback" not in err and want in err, (argv, err)
            assert len([line for line in err.splitlines() if want in line]) == 1
    from pipeline.config.loading import read_yaml

    (tmp_path / "m.yaml").write_text("a: &base {x: 1, y: 2}\nb:\n  <<: *base\n  x: 3\n")
    assert read_yaml(tmp_path / "m.yaml") == {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 2}}


def test_an_empty_config_with_a_stage_loads_the_stages_defaults(tmp_path, capsys):
    """An empty YAML (or one of comments only) sets nothing: the stage's defaults, not an AttributeError."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set yet\n")
    assert cli.main(["validate", str(empty), "--stage", "rm", "--output_dir", str(tmp_path / "out")]) == 0, (
        capsys.readouterr().err
    )
    assert "rm config OK" in capsys.readouterr().out


def test_without_data_eval_the_held_out_share_comes_from_the_users_training_data(tmp_path, monkeypatch, capsys):
    """No stage holds out the bundled sample data by default: with only `data.train` and
    `data.eval_fraction`, the held-out samples are carved off the user's training data (whatever the
    working folder), and with neither there are none."""
    import json

    monkeypatch.chdir(tmp_path)  # the sample data's relative paths name nothing here
    pairs = [{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(40)]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    config = tmp_path / "rm.yaml"
    config.write_text(json.dumps({"output_dir": str(tmp_path / "out"), "data": {"train": [str(data)]}}))
    assert cli.main(["validate", str(config), "--stage", "rm"]) == 0, capsys.readouterr().err
    assert "; 40 training samples; outputs" in capsys.readouterr().out
    assert cli.main(["validate", str(config), "--stage", "rm", "--data.eval_fraction", "0.25"]) == 0
    counts = re.search(r"(\d+) training samples, (\d+) held-out", capsys.readouterr().out)
    assert counts and int(counts[1]) + int(counts[2]) == 40 and int(counts[2]) > 0
    for stage in registry.STAGES:
        assert registry.config_class(stage)().data.eval == [], stage


def test_a_pipeline_checks_every_stages_data_before_the_first_stage_trains(tmp_path, capsys):
    """A later stage's bad records and missing files are found when the pipeline is validated and
    before its first stage starts (the driver's plan), not after the earlier stages have trained:
    each as its stage's FILE:LINE line, every stage's at once."""
    import json

    sft_bad = tmp_path / "sft.jsonl"
    sft_bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    pairs = [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "same", "rejected": "same"}]
    dpo_bad = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    config = tmp_path / "pipeline.yaml"
    config.write_text(
        f"base_model: embedded\noutput_root: {tmp_path / 'out'}\nchain: [sft, dpo]\nstages:\n"
        f"  sft:\n    config: !include {REPO / 'configs' / 'sft.yaml'}\n"
        f"    data: {{train: [{sft_bad}], eval: []}}\n"
        f"  dpo:\n    config: !include {REPO / 'configs' / 'dpo.yaml'}\n"
        f"    data: {{train: [{dpo_bad}], eval: [{tmp_path / 'missing.jsonl'}]}}\n"
    )
    assert cli.main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"stages.sft: 1 data problem(s) (fix them, or set data.on_error=skip):\n  {sft_bad}:1: " in err
    assert "stages.dpo: 1 data problem(s)" in err and f"  {dpo_bad}:2: chosen and rejected are identical" in err
    assert f"stages.dpo: data.eval: '{tmp_path / 'missing.jsonl'}' names no data file" in err
    from pipeline.tools import driver

    assert driver.main(["stages", str(config)]) == 1  # the driver's plan, before any stage starts
    assert f"  {dpo_bad}:2: chosen and rejected are identical" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_validate_lists_a_stages_bad_records_beside_its_missing_files_and_model(tmp_path, capsys):
    """A stage's first checks (its data paths, its model folder) stop it before it tokenizes; `relay
    validate` lists the records' problems beside theirs, so that one run of it shows everything."""
    pairs = [{"prompt": "q", "chosen": "same", "rejected": "same"}, {"prompt": "q", "chosen": "a", "rejected": "b"}]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    missing_model, missing_eval = tmp_path / "no-model", tmp_path / "no-eval.jsonl"
    argv = ["validate", str(REPO / "configs" / "rm.yaml"), "--model.path", str(missing_model)]
    argv += ["--data.train", f"[{data}]", "--data.eval", f"[{missing_eval}]"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"  - model.path: {missing_model}: no such folder" in err
    assert f"  - data.eval: '{missing_eval}' names no data file" in err
    assert f"  {data}:1: chosen and rejected are identical" in err
    # a value out of range beside them: one round too
    argv = ["validate", str(REPO / "configs" / "rm.yaml"), "--lora.r", "0", "--data.train", f"[{data}]"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "  - lora.r: must be > 0, got 0" in err and f"  {data}:1: chosen and rejected are identical" in err


def test_validate_reads_a_pipelines_paths_as_the_pipeline_does(tmp_path, monkeypatch, capsys):
    """`relay pipeline` reads every path inside its config from the repository root (the driver runs
    there); `relay validate` read them from the working folder, so a config it passed failed at the
    run (and one it refused ran)."""
    config = tmp_path / "pipeline.yaml"
    config.write_text(
        "base_model: embedded\noutput_root: outputs/validate-paths\nchain: [sft]\nstages:\n"
        "  sft:\n    config: !include " + str(REPO / "configs" / "sft.yaml") + "\n"
        "    data: {train: [mydata/train.jsonl], eval: []}\n"
    )
    (tmp_path / "mydata").mkdir()
    write_jsonl(tmp_path / "mydata" / "train.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    monkeypatch.chdir(tmp_path)  # mydata/ is here, not in the repository
    assert cli.main(["validate", "pipeline.yaml"]) == 2
    assert "stages.sft: data.train: 'mydata/train.jsonl' names no data file" in capsys.readouterr().err
    config.write_text(config.read_text().replace("mydata/train.jsonl", "data/sample/sft/train"))
    assert cli.main(["validate", "pipeline.yaml"]) == 0, capsys.readouterr().err
