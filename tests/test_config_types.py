"""How a config's values are read by type: a text key takes the text as written (on the command line
and in the YAML), never YAML's reading of it; options that the chosen variant does not read are
refused; the usage lines name commands and stages that exist."""

import contextlib
import importlib
import io
from dataclasses import dataclass, field

import pytest

import stages as registry
from pipeline.algorithms.judge_config import JudgeConfig
from pipeline.algorithms.multitask import MODES, MultitaskConfig
from pipeline.config import ChatDataConfig, ConfigError, PromptDataConfig, StageConfig, load_config, save_config


@dataclass
class ToyData(ChatDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/toy.jsonl"])


@dataclass
class Toy(StageConfig):
    data: ToyData = field(default_factory=ToyData)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "option, text",
    [
        ("--data.system_prompt", "Note: answer briefly"),  # YAML: {'Note': 'answer briefly'}
        ("--tracking.run_name", "{a}"),  # YAML: {'a': None}
        ("--tracking.run_name", "123"),  # YAML: 123
        ("--tracking.run_name", "0123"),  # YAML 1.1: the octal 83
        ("--data.system_prompt", "[be brief, be kind]"),  # YAML: a list
        ("--data.system_prompt", "yes"),  # YAML 1.1: true
        ("--data.system_prompt", '"quoted"'),  # YAML: the quotes dropped
        ("--data.system_prompt", "include notes.txt"),  # draccus: reads the file notes.txt
        ("--data.system_prompt", ""),
        ("--model.revision", "1.10"),  # YAML: 1.1
    ],
)
def test_a_text_key_takes_the_command_lines_value_as_typed(option, text, tmp_path):
    cfg = load_config(Toy, [option, text])
    section, key = option[2:].split(".")
    assert getattr(getattr(cfg, section), key) == text
    save_config(cfg, tmp_path / "config.yaml")  # what a run writes is what it read
    again = load_config(Toy, ["--config", str(tmp_path / "config.yaml")])
    assert getattr(getattr(again, section), key) == text
    assert load_config(Toy, [f"{option}={text}"]) == cfg


def test_null_leaves_an_optional_text_key_unset():
    cfg = load_config(Toy, ["--data.system_prompt", "x", "--data.system_prompt", "null", "--tracking.run_name", "~"])
    assert (cfg.data.system_prompt, cfg.tracking.run_name) == (None, None)


def test_a_judge_rubric_with_a_colon_is_the_rubric():
    """`--judge.template "Rate: {answer}"` was the mapping {'Rate': '{answer}'}, refused as
    `unknown field {'Rate'}`."""
    cfg = load_config(Toy, ["--judge.template", "Rate: {answer}"], check=False)
    assert cfg.judge.template == "Rate: {answer}"
    assert not [p for p in cfg.judge.problems() if "template" in p], cfg.judge.problems()


def test_other_keys_still_read_the_command_line_as_yaml():
    cfg = load_config(Toy, ["--lora.target_modules", "[q_proj, v_proj]", "--checkpoint.resume", "false"])
    assert (cfg.lora.target_modules, cfg.checkpoint.resume) == (["q_proj", "v_proj"], False)
    # a key that takes text or a bool: the text where YAML's reading (a mapping) is neither
    assert load_config(Toy, ["--checkpoint.resume", "runs/a: b"]).checkpoint.resume == "runs/a: b"
    with pytest.raises(ConfigError) as err:
        load_config(Toy, ["--train.max_steps", "Note: x", "stray"])
    assert err.value.problems == [
        "--train.max_steps: expected int, got 'Note: x'",
        "'stray': not an option; options are --section.key VALUE",
    ]


def test_a_mapping_or_a_list_in_the_yaml_for_a_text_key_is_refused_at_its_line(tmp_path):
    """draccus makes text of anything (str() of the mapping): it was accepted and trained on."""
    cfg = write(
        tmp_path / "c.yaml",
        "output_dir: x\ndata:\n  system_prompt: {Note: answer briefly}\ntracking: {run_name: [a, b]}\n"
        "lora: {target_modules: [{q: 1}]}\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(Toy, ["--config", str(cfg)])
    assert err.value.problems == [
        f"{cfg}:3: data.system_prompt: expected a string, got a mapping ({{'Note': 'answer briefly'}}); "
        "quote the text to keep it as written",
        f"{cfg}:4: tracking.run_name: expected a string, got a list (['a', 'b']); quote the text to keep it as written",
        f"{cfg}:5: lora.target_modules: expected a list of str, got [{{'q': 1}}]",
    ]


def test_a_text_key_in_the_yaml_keeps_the_text_written(tmp_path):
    """YAML reads `0123` as 83, `yes` as true and `1.10` as 1.1; a text key takes what was written.
    Quoted text, null and an included section read as before."""
    write(tmp_path / "lora.yaml", "r: 4\n")
    cfg = write(
        tmp_path / "c.yaml",
        "output_dir: x\ntracking: {run_name: 0123}\ndata: {system_prompt: yes}\nmodel: {revision: 1.10}\n"
        "lora: !include lora.yaml\njudge: {system: null, model: 'on'}\n",
    )
    loaded = load_config(Toy, ["--config", str(cfg)], check=False)
    assert (loaded.tracking.run_name, loaded.data.system_prompt, loaded.model.revision) == ("0123", "yes", "1.10")
    assert (loaded.lora.r, loaded.judge.system, loaded.judge.model) == (4, None, "on")


# --- options the chosen variant does not read --------------------------------------------------


def test_prompt_data_refuses_packing_that_no_sampling_stage_reads():
    """PPO, GRPO and distill read prompts one per row and never read padding_mode: `pack` is refused
    as RM and KTO refuse it; SFT's conversations still pack."""
    line = (
        "data.padding_mode: the stages that sample from prompts pad each prompt to its own row ('padding'); "
        "packing is not supported"
    )
    assert PromptDataConfig(train=["p.jsonl"], padding_mode="pack").problems() == [line]
    assert PromptDataConfig(train=["p.jsonl"]).problems() == []
    assert ChatDataConfig(train=["c.jsonl"], padding_mode="pack").problems() == []
    for name in ("ppo", "grpo", "distill"):
        cfg = load_config(registry.config_class(name), ["--data.padding_mode", "pack"], check=False)
        assert line in cfg.problems(), name


def test_coba_options_under_a_mode_that_does_not_read_them_are_refused():
    readers = [name for name, mode in MODES.items() if mode.adaptive]
    assert readers == ["coba", "self-paced"]
    for mode in (name for name in MODES if name not in readers):
        assert MultitaskConfig(weighted_loss_mode=mode, coba_tau=2.0, coba_valid_batches=3).problems() == [
            f"multitask.coba_tau: read only by weighted_loss_mode coba, self-paced; {mode} would ignore it",
            f"multitask.coba_valid_batches: read only by weighted_loss_mode coba, self-paced; {mode} would ignore it",
        ]
        assert MultitaskConfig(weighted_loss_mode=mode).problems() == []
    for mode in readers:
        assert MultitaskConfig(weighted_loss_mode=mode, coba_tau=2.0, coba_valid_batches=3).problems() == []


# --- usage lines ------------------------------------------------------------------------------------


def _help(module: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    return out.getvalue()


def test_usage_lines_name_commands_and_stages_that_exist():
    from pipeline.tools.cli import COMMANDS, TRAIN_USAGE, VALIDATE_USAGE

    assert f"[--stage {'|'.join(registry.STAGES)}]" in TRAIN_USAGE.splitlines()[0]
    assert f"({', '.join(registry.STAGES)}: the kind of data it reads)" in " ".join(VALIDATE_USAGE.split())
    for name, (module, _) in COMMANDS.items():
        if module is not None:
            assert _help(module).startswith(f"usage: relay {name} "), name
    # not a relay command: its usage is the command that runs it
    assert "gold" not in COMMANDS
    assert _help("pipeline.tools.gold").startswith("usage: python -m pipeline.tools.gold ")
    bundle = " ".join(_help("pipeline.tools.bundle").split())
    assert "environment, for an offline GPU node (an air-gapped cluster whose image already has CUDA torch)." in bundle
