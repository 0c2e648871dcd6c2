"""What a data build reports: every drop and every cut is a warning `relay validate` prints (one rule
for the SFT, preference, KTO and prompt builders), the line of a split that cannot fill a batch names
its drops, and the problems of the train and eval splits are reported together."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from data_formats.datasets import build_sft_data
from data_formats.drops import collect_refusals, overlong_drops
from data_formats.prompt_data import build_prompt_data
from data_formats.render import make_template
from data_formats.sources import DataError
from pipeline.config import ChatDataConfig, ConfigError, PromptDataConfig
from pipeline.engine.stage_checks import fill_problem


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path: Path, records: list) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return str(path)


def chat(*texts: str) -> dict:
    return {"messages": [{"role": ("user", "assistant")[k % 2], "content": t} for k, t in enumerate(texts)]}


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------------------
# Drops and cuts are warnings (finding: a prompt dropped, an SFT sample cut, said at INFO only)
# ------------------------------------------------------------------------------------------


def test_an_overlong_prompt_dropped_is_a_warning_as_every_builders_drop_is(tmp_path, tok, caplog):
    """Seven prompt records gave six prompts with one INFO line: `relay validate` said nothing."""
    records = [{"prompt": f"What is {i}+{i}?"} for i in range(6)] + [{"prompt": "long " * 100}]
    cfg = PromptDataConfig(train=[write_jsonl(tmp_path / "p.jsonl", records)], eval=[])
    with caplog.at_level(logging.WARNING):
        samples = build_prompt_data(cfg, tok, make_template(cfg, tok), "train", 64)
    assert len(samples) == 6
    assert warnings(caplog) == ["prompt train data: 1 prompt(s) dropped overlong"]


def test_a_prompt_cut_to_fit_is_a_warning_as_a_preference_pairs_cut_is(tmp_path, tok, caplog):
    """data.truncation truncate: a multi-turn prompt that loses its oldest exchange is said."""
    history = chat("first question " * 20, "first answer " * 20, "second question")
    cfg = PromptDataConfig(train=[write_jsonl(tmp_path / "p.jsonl", [history])], eval=[], truncation="truncate")
    with caplog.at_level(logging.WARNING):
        (sample,) = build_prompt_data(cfg, tok, make_template(cfg, tok), "train", 40)
    assert "first question" not in sample["text"] and "second question" in sample["text"]
    assert warnings(caplog) == [
        "prompt train data: 1 prompt(s) lost their oldest exchanges to fit 40 tokens (any system turn kept)"
    ]


def test_an_sft_conversation_cut_to_fit_is_a_warning_as_a_preference_pairs_cut_is(tmp_path, tok, caplog):
    """SFT truncation truncate counted truncated=1 at INFO, while RM's and KTO's cuts were warnings."""
    records = [chat(f"q{i}", "a") for i in range(3)] + [chat("q", "a", "q2", "long answer " * 200)]
    cfg = ChatDataConfig(train=[write_jsonl(tmp_path / "mt.jsonl", records)], eval=[], truncation="truncate")
    with caplog.at_level(logging.WARNING):
        built = build_sft_data(cfg, tok, make_template(cfg, tok), 128, "train")
    assert len(built) == 4 and built.stats["truncated"] == 1
    assert warnings(caplog) == [
        "sft train data: 1 sample(s) lost their last turns to fit seq_length 128 (each keeps its longest run of "
        "whole early turns that ends with an assistant turn)"
    ]


def test_the_line_of_a_prompt_split_that_cannot_fill_a_batch_names_its_drops(tmp_path, tok):
    """'0 usable prompt(s) cannot fill one rollout batch' gave no reason where SFT's line gives one;
    the limit's settings are the prompt's own (PolicyStage's limits)."""
    records = [{"prompt": "long " * 20}, {"prompt": "longer " * 40}]
    cfg = PromptDataConfig(train=[write_jsonl(tmp_path / "p.jsonl", records)], eval=[])
    limits = {"data.max_prompt_length": 5, "train.seq_length - generation.max_new_tokens": 30}
    assert build_prompt_data(cfg, tok, make_template(cfg, tok), "train", 5, limits=limits) == []
    (line,) = fill_problem(0, "usable prompt(s)", "rollout batch", 2, 1, overlong_drops("train"))
    longest = int(line.split("(the longest ")[1].split()[0])
    assert longest > 30
    assert line == (
        "data.train: 0 usable prompt(s) cannot fill one rollout batch of 2 x 1 rank(s): 2 dropped as longer than "
        f"data.max_prompt_length 5 (the longest {longest} tokens); data.max_prompt_length and train.seq_length - "
        f"generation.max_new_tokens: {longest} keep them, data.truncation: truncate drops a multi-turn prompt's "
        "oldest exchanges"
    )


def grpo_cfg(model, out: Path, train: list[str], eval_: list[str] = (), max_prompt_length: int = 64):
    from stages.grpo import GRPOConfig

    cfg = GRPOConfig(output_dir=str(out))
    cfg.model.path = str(model)
    cfg.data.train, cfg.data.eval, cfg.data.max_prompt_length = list(train), list(eval_), max_prompt_length
    cfg.train.batch_size, cfg.train.seq_length, cfg.train.eval_steps = 2, 128, 1 if eval_ else 0
    cfg.generation.max_new_tokens = 8
    cfg.grpo.num_generations = 2
    cfg.grpo.reward_funcs, cfg.grpo.reward_weights = ["pipeline.algorithms.rewards:house_phrase"], [1.0]
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    return cfg


def test_grpo_validation_warns_of_a_dropped_prompt_and_its_stop_line_names_them_all(tiny_model_dir, tmp_path, caplog):
    from stages.grpo import GRPOStage

    records = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(6)]
    records.append({"prompt": "long " * 100, "answer": "x"})
    data = write_jsonl(tmp_path / "grpo.jsonl", records)
    stage = GRPOStage(grpo_cfg(tiny_model_dir, tmp_path / "o", [data]))
    with caplog.at_level(logging.WARNING):
        stage.validate()
    assert len(stage.train_samples) == 6
    assert "prompt train data: 1 prompt(s) dropped overlong" in warnings(caplog)
    with pytest.raises(ConfigError) as err:
        GRPOStage(grpo_cfg(tiny_model_dir, tmp_path / "o2", [data], max_prompt_length=5)).validate()
    (line,) = err.value.problems
    assert line.startswith(
        "data.train: 0 usable prompt(s) cannot fill one rollout batch of 2 x 1 rank(s): 7 dropped as longer than "
        "data.max_prompt_length 5 (the longest "
    )


# ------------------------------------------------------------------------------------------
# The train and eval splits' problems together (finding: eval's appeared once train was clean)
# ------------------------------------------------------------------------------------------

BAD_TRAIN = [chat("a", "b"), chat("a", "b"), {"messages": [{"role": "assistant", "content": "first"}]}]
BAD_EVAL = ['{"messages":[{"role":"user","content":5},{"role":"assistant","content":"y"}]}']


def sft_stage(model, out: Path, train: list[str], eval_: list[str], **data):
    from stages.sft import SFTConfig, SFTStage

    cfg = SFTConfig(output_dir=str(out))
    cfg.model.path = str(model)
    cfg.data.train, cfg.data.eval = train, eval_
    for key, value in data.items():
        setattr(cfg.data, key, value)
    cfg.train.batch_size, cfg.train.seq_length, cfg.train.eval_steps = 1, 64, 0
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    return SFTStage(cfg)


def rm_stage(model, out: Path, train: list[str], eval_: list[str]):
    from stages.reward import RMConfig, RMStage

    cfg = RMConfig(output_dir=str(out))
    cfg.model.path = str(model)
    cfg.data.train, cfg.data.eval = train, eval_
    cfg.train.batch_size, cfg.train.seq_length, cfg.train.eval_steps = 1, 64, 0
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    return RMStage(cfg)


def refused_files(err: ConfigError) -> list[str]:
    """The files the one data problem lists, in its order."""
    (problem,) = err.problems
    return [line.strip().split(":")[0] for line in problem.splitlines()[1:]]


def pt_stage(model, out: Path, train: list[str], eval_: list[str]):
    from stages.pretrain import PTConfig, PTStage

    cfg = PTConfig(output_dir=str(out))
    cfg.model.path = str(model)
    cfg.data.train, cfg.data.eval, cfg.data.streaming = train, eval_, True
    cfg.train.batch_size, cfg.train.seq_length, cfg.train.eval_steps = 1, 16, 0
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    return PTStage(cfg)


@pytest.mark.parametrize("kind", ["sft", "rm", "grpo", "pt_streamed"])
def test_the_train_and_eval_splits_problems_are_reported_together(tiny_model_dir, tmp_path, kind):
    """Validation stopped at the train split's bad records; the eval split's came only once those
    were fixed. Now one list holds both, train's first."""
    if kind == "sft":
        train = write_jsonl(tmp_path / "train.jsonl", BAD_TRAIN)
        evaluation = write_jsonl(tmp_path / "eval.jsonl", BAD_EVAL)
        stage = sft_stage(tiny_model_dir, tmp_path / "o", [train], [evaluation])
    elif kind == "rm":
        pair = {"prompt": "q", "chosen": "yes", "rejected": "no"}
        train = write_jsonl(tmp_path / "train.jsonl", [pair, pair, {"prompt": "q", "chosen": "yes"}])
        evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "q", "chosen": 5, "rejected": "no"}])
        stage = rm_stage(tiny_model_dir, tmp_path / "o", [train], [evaluation])
    elif kind == "pt_streamed":
        train = write_jsonl(tmp_path / "train.jsonl", [{"text": "a document"}, {"body": "no text"}])
        evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"text": 3}])
        stage = pt_stage(tiny_model_dir, tmp_path / "o", [train], [evaluation])
    else:
        from stages.grpo import GRPOStage

        train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "q1"}, {"prompt": "q2"}, {"prompt": 5}])
        evaluation = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": ""}])
        stage = GRPOStage(grpo_cfg(tiny_model_dir, tmp_path / "o", [train], [evaluation]))
    with pytest.raises(ConfigError) as err:
        stage.validate()
    assert refused_files(err.value) == [train, evaluation]


def test_a_carved_eval_split_lists_the_training_files_problems_once(tiny_model_dir, tmp_path):
    """data.eval_fraction reads the training files for the eval split too: a bad record is one problem."""
    train = write_jsonl(tmp_path / "train.jsonl", [chat(f"q{i}", "a") for i in range(8)] + BAD_TRAIN[2:])
    stage = sft_stage(tiny_model_dir, tmp_path / "o", [train], [], eval_fraction=0.5)
    with pytest.raises(ConfigError) as err:
        stage.validate()
    (problem,) = err.value.problems
    assert problem.startswith("1 data problem(s)") and refused_files(err.value) == [train]


def test_a_split_refused_while_collecting_is_built_from_its_good_records_and_never_cached(tmp_path, tok, monkeypatch):
    """Inside collect_refusals a strict split is built from its good records; a cached copy of that
    build would let the next plain build pass the bad records unsaid."""
    monkeypatch.setenv("RELAY_TOKEN_CACHE", str(tmp_path / "cache"))
    cfg = ChatDataConfig(train=[write_jsonl(tmp_path / "t.jsonl", BAD_TRAIN)], eval=[])
    template = make_template(cfg, tok)
    with collect_refusals() as refused:
        assert len(build_sft_data(cfg, tok, template, 64, "train")) == 2
    assert [(Path(p.file).name, p.line) for p in refused] == [("t.jsonl", 3)]
    with pytest.raises(DataError, match="t.jsonl:3"):
        build_sft_data(cfg, tok, template, 64, "train")
    assert not list((tmp_path / "cache").glob("*.npz"))
