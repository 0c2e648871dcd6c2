"""The config loader: unknown keys with suggestions, !include, CLI precedence, all problems at once."""

from dataclasses import dataclass, field

import pytest

from pipeline.config import (
    ChatDataConfig,
    ConfigError,
    StageConfig,
    load_config,
    parse_duration,
    save_config,
)


@dataclass
class ToyData(ChatDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/toy.jsonl"])


@dataclass
class ToyStage(StageConfig):
    data: ToyData = field(default_factory=ToyData)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_load_without_config():
    cfg = load_config(ToyStage, [])
    assert cfg.model.path == "embedded" and cfg.model.trust_remote_code is False
    assert cfg.data.train == ["data/toy.jsonl"]


def test_typo_keys_fail_with_suggestions_all_at_once(tmp_path):
    cfg = write(tmp_path / "c.yaml", "train:\n  max_step: 3\n  learning_rat: 0.1\nmodle:\n  path: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(ToyStage, ["--config", str(cfg), "--lora.rank", "4"])
    problems = err.value.problems
    assert len(problems) == 4
    assert any("train.max_step" in p and "did you mean 'train.max_steps'" in p for p in problems)
    assert any("train.learning_rat" in p and "'train.learning_rate'" in p for p in problems)
    assert any(p.endswith("modle: unknown key; did you mean 'model'?") for p in problems)
    assert any("--lora.rank" in p and "--lora.r" in p for p in problems)


def test_typo_inside_list_of_sections(tmp_path):
    cfg = write(tmp_path / "c.yaml", "checkpoint:\n  keep:\n    - every: 5\n      untill: 10\n")
    with pytest.raises(
        ConfigError, match=r"checkpoint.keep\[0\].untill: unknown key; did you mean 'checkpoint.keep\[0\].until'"
    ):
        load_config(ToyStage, ["--config", str(cfg)])


def test_include_and_cli_override_precedence(tmp_path):
    write(tmp_path / "lora.yaml", "r: 8\nalpha: 16\n")
    cfg_file = write(
        tmp_path / "run.yaml",
        "output_dir: out/x\nlora: !include lora.yaml\ntrain:\n  max_steps: 7\n  learning_rate: 0.001\n",
    )
    cfg = load_config(ToyStage, ["--config", str(cfg_file), "--train.max_steps", "9", "--lora.alpha=4"])
    assert cfg.lora.r == 8  # from the included file
    assert cfg.lora.alpha == 4  # CLI beats the included YAML
    assert cfg.train.max_steps == 9  # CLI beats YAML
    assert cfg.train.learning_rate == pytest.approx(0.001)  # YAML beats the default
    assert cfg.output_dir == "out/x"


def test_loads_in_one_process_keep_nothing_of_each_other(tmp_path):
    """A load after one with a file, an override and a bad value reads only its own arguments."""
    cfg_file = write(tmp_path / "run.yaml", "output_dir: out/x\ntrain:\n  max_steps: 7\n")
    first = load_config(ToyStage, ["--config", str(cfg_file), "--lora.alpha", "4"])
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(ToyStage, ["--train.learning_rate", "abc"])
    second = load_config(ToyStage, ["--train.max_steps", "3"])
    assert (first.output_dir, first.train.max_steps, first.lora.alpha) == ("out/x", 7, 4)
    default = ToyStage()
    assert (second.output_dir, second.train.max_steps, second.lora.alpha) == (
        default.output_dir,
        3,
        default.lora.alpha,
    )
    assert load_config(ToyStage, []) == default


def test_semantic_problems_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config(
            ToyStage, ["--model.finetuning", "qlorra", "--train.max_steps", "0", "--data.padding_mode", "packed"]
        )
    text = str(err.value)
    assert "model.finetuning: 'qlorra'" in text
    assert "train.max_steps: must be > 0" in text
    assert "data.padding_mode: 'packed'" in text
    assert len(err.value.problems) == 3


def test_resume_accepts_bool_or_path():
    assert load_config(ToyStage, ["--checkpoint.resume", "false"]).checkpoint.resume is False
    assert load_config(ToyStage, ["--checkpoint.resume", "/x/step-5"]).checkpoint.resume == "/x/step-5"


def test_round_trip_through_saved_yaml(tmp_path):
    cfg = load_config(ToyStage, ["--train.max_steps", "11", "--lora.target_modules", "[q_proj,v_proj]"])
    save_config(cfg, tmp_path / "saved.yaml")
    again = load_config(ToyStage, ["--config", str(tmp_path / "saved.yaml")])
    assert again == cfg


def test_durations():
    assert parse_duration("90s") == 90 and parse_duration("15m") == 900 and parse_duration("1.5h") == 5400
    assert parse_duration(30) == 30
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_a_problem_in_an_included_file_names_that_file_and_line(tmp_path):
    """Each unknown key and wrong value is placed where it was written: in the `!include`d file,
    at its own line (not against the file that includes it); a key merged in by `<<: !include`
    has no line of its own there and is placed at the mapping that merges it."""
    (tmp_path / "common").mkdir()
    lora = write(tmp_path / "common/lora.yaml", "r: 8\nalfa: 16\ndropout: high\n")
    write(tmp_path / "steps.yaml", "warm: 1\n")
    cfg = write(
        tmp_path / "c.yaml",
        "output_dir: out/x\nlora: !include common/lora.yaml\ntrain:\n  <<: !include steps.yaml\n  max_stps: 2\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(ToyStage, ["--config", str(cfg)])
    assert err.value.problems == [
        f"{lora}:2: lora.alfa: unknown key; did you mean 'lora.alpha'?",
        f"{cfg}:4: train.warm: unknown key; did you mean 'train.warmup'?",
        f"{cfg}:5: train.max_stps: unknown key; did you mean 'train.max_steps'?",
        f"{lora}:3: lora.dropout: expected float, got 'high'",
    ]


def test_values_of_the_wrong_type_are_all_reported_at_once_in_plain_words(tmp_path):
    """draccus stops at the first value it cannot decode and words it its own way ("DecodingError:
    `lora.r`: Couldn't parse ...", a class repr for a list): every such value in the YAML and on the
    command line is one line, `key: expected T, got V`, all at once, beside the unknown keys."""
    cfg = write(
        tmp_path / "c.yaml",
        "lora: {r: sixteen, target_modules: all-linear}\ntrain: {max_steps: 1.5, batch_size: '2'}\n"
        "data: {train: one.jsonl}\ncheckpoint: 5\nmodle: {path: x}\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(ToyStage, ["--config", str(cfg), "--train.seed", "abc", "--train.learning_rate"])
    assert err.value.problems == [
        f"{cfg}:5: modle: unknown key; did you mean 'model'?",
        f"{cfg}:1: lora.r: expected int, got 'sixteen'",
        f"{cfg}:1: lora.target_modules: expected a list of str, got 'all-linear'",
        f"{cfg}:2: train.max_steps: expected int, got 1.5",
        f"{cfg}:3: data.train: expected a list of str, got 'one.jsonl'",
        f"{cfg}:4: checkpoint: expected a mapping of keys, got 5",
        "--train.seed: expected int, got 'abc'",
        "--train.learning_rate: needs a value",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(ToyStage, ["--data.train", "data/*.jsonl"])
    assert err.value.problems == [
        "--data.train: expected a list of str, got 'data/*.jsonl' (a list on the command line: '[data/*.jsonl]')"
    ]
    # what draccus takes stays taken: a quoted number, YAML's and the plain text's forms on the command line
    ok = write(tmp_path / "ok.yaml", "train: {batch_size: '2', learning_rate: 1e-4}\n")
    loaded = load_config(ToyStage, ["--config", str(ok), "--lora.alpha=4", "--data.train", "[a.jsonl, b.jsonl]"])
    assert (loaded.train.batch_size, loaded.lora.alpha, loaded.data.train) == (2, 4, ["a.jsonl", "b.jsonl"])


def test_other_tools_keys_in_a_yaml_get_relays_key_where_the_config_has_it(tmp_path):
    """A MedicalGPT / MFTCoder config's flat keys in a YAML got difflib's nearest names (or none);
    now the same hint the command line gives, without its '--'. A config without the key's section
    (a pipeline's) is not pointed at a key it does not have."""
    from pipeline.tools.chain_config import PipelineConfig

    cfg = write(tmp_path / "c.yaml", "model_name_or_path: x\nlearning_rate: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(ToyStage, ["--config", str(cfg)])
    assert err.value.problems == [
        f"{cfg}:1: model_name_or_path: unknown key; did you mean 'model.path'?",
        f"{cfg}:2: learning_rate: unknown key; did you mean 'train.learning_rate'?",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(PipelineConfig, ["--config", str(cfg), "--learning_rate", "1"])
    assert not any("train.learning_rate" in p for p in err.value.problems), err.value.problems
