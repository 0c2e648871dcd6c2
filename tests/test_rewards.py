"""GRPO's reward functions (pipeline/algorithms/rewards.py): called by keyword exactly as TRL 1.16's
GRPOTrainer calls them, checked against TRL's own `_calculate_rewards` on the same data (standard
and conversational prompts), with TRL's shipped reward functions and the two signatures users
write (`f(completions, **kwargs)`, `f(completions, solution=None, **kwargs)`); and a user's own
module named by module (working directory, PYTHONPATH) or by file path.

Golden source: trl/trainer/grpo_trainer.py (TRL 1.16.0, installed), GRPOTrainer._calculate_rewards,
run on a stand-in trainer (its profiling context and the cross-process gather made no-ops).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import types

import pytest
import torch

from data_formats.prompt_data import build_prompt_data
from data_formats.render import make_template
from pipeline.algorithms import rewards as rw
from pipeline.config import PromptDataConfig

QUESTIONS = [("Is it 4 or 5? What is 2 + 2?", "4"), ("Is it 6 or 9? What is 3 + 3?", "6")]
ANSWERS = ["<think>\nadd\n</think>\n4", "9 9 9 9 9 9"]  # one per prompt: right and formatted, wrong and repetitive


@pytest.fixture(scope="module")
def tokenizer(embedded_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_path)


def prompt_samples(tmp_path, tokenizer, conversational: bool) -> list[dict]:
    """Relay's prompt samples (build_prompt_data) of the QUESTIONS with a `solution` column."""
    path = tmp_path / ("conv.jsonl" if conversational else "std.jsonl")
    path.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": q}] if conversational else q, "solution": s}) + "\n"
            for q, s in QUESTIONS
        )
    )
    cfg = PromptDataConfig(train=[str(path)], eval=[])
    return build_prompt_data(cfg, tokenizer, make_template(cfg, tokenizer), "train")


def trl_calls(funcs, conversational: bool, completion_ids, monkeypatch) -> tuple[torch.Tensor, list[dict]]:
    """TRL 1.16's GRPOTrainer._calculate_rewards on the TRL dataset rows of QUESTIONS: (rewards per
    function, the keyword arguments each function received)."""
    from transformers import TrainerState
    from trl.trainer import grpo_trainer

    monkeypatch.setattr(grpo_trainer, "profiling_context", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(grpo_trainer, "gather", lambda x: x)
    seen: list[dict] = []

    def spying(func):
        def call(**kwargs):
            seen.append(kwargs)
            return func(**kwargs)

        return call

    inputs = [
        {"prompt": [{"role": "user", "content": q}] if conversational else q, "solution": s} for q, s in QUESTIONS
    ]
    prompts = [x["prompt"] for x in inputs]
    completions = [[{"role": "assistant", "content": a}] for a in ANSWERS] if conversational else list(ANSWERS)
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device="cpu"),
        reward_funcs=[spying(f) for f in funcs],
        reward_processing_classes=[None] * len(funcs),
        reward_func_names=[f"f{i}" for i in range(len(funcs))],
        state=TrainerState(global_step=3, max_steps=10),
        _log_completion_extra=lambda *a: None,
        _log_metric=lambda *a: None,
        environments=None,
    )
    calculate = grpo_trainer.GRPOTrainer._calculate_rewards.__wrapped__  # without its profiling decorator
    out = calculate(trainer, inputs, prompts, completions, completion_ids)
    return out, seen


def relay_calls(funcs, samples, completion_ids) -> tuple[torch.Tensor, list[dict]]:
    """Relay's calls of `funcs` on the same completions: (rewards per function, keyword arguments)."""
    seen: list[dict] = []

    def spying(func):
        def call(**kwargs):
            seen.append(kwargs)
            return func(**kwargs)

        return call

    prompts = [rw.trl_prompt(s) for s in samples]
    completions = rw.trl_completions(samples, ANSWERS)
    columns = [json.loads(s["columns"]) for s in samples]
    state = rw.trainer_state(3, 10)
    values = [rw.call_reward(spying(f), "f", prompts, completions, completion_ids, columns, state) for f in funcs]
    return torch.tensor(values, dtype=torch.float32).T, seen


def completions_only(completions, **kwargs):
    """The idiomatic TRL signature: only the completions named."""
    return [float(len(rw.text_of(c))) for c in completions]


def solution_in_completion(completions, solution=None, **kwargs):
    """The other idiomatic signature: 1.0 where the completion states the solution. Called
    positionally with the prompts first, it would score the prompts (each contains its solution)."""
    return [1.0 if s in rw.text_of(c) else 0.0 for c, s in zip(completions, solution)]


def returns_none_for_the_second(completions, **kwargs):
    return [1.0] + [None] * (len(completions) - 1)


def user_funcs():
    return [completions_only, solution_in_completion, returns_none_for_the_second]


def trl_funcs(conversational: bool):
    from trl.rewards import get_repetition_penalty_reward, get_soft_overlong_punishment, think_format_reward

    funcs = [
        get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=3),
        get_repetition_penalty_reward(ngram_size=2),
    ]
    return funcs + [think_format_reward] if conversational else funcs  # think_format_reward reads message lists


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_reward_functions_get_exactly_trls_keywords_and_values(tmp_path, tokenizer, conversational, monkeypatch):
    samples = prompt_samples(tmp_path, tokenizer, conversational)
    assert [bool(s["standard"]) for s in samples] == [not conversational] * 2
    completion_ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in ANSWERS]
    funcs = user_funcs() + trl_funcs(conversational)
    trl, trl_seen = trl_calls(funcs, conversational, completion_ids, monkeypatch)
    ours, our_seen = relay_calls(funcs, samples, completion_ids)
    assert torch.equal(ours.isnan(), trl.isnan()) and torch.allclose(ours.nan_to_num(), trl.nan_to_num())
    for theirs, mine in zip(trl_seen, our_seen, strict=True):
        assert (
            set(mine)
            == set(theirs)
            == {"prompts", "completions", "completion_ids", "solution", "trainer_state", "log_extra", "log_metric"}
        )
        for key in ("prompts", "completions", "completion_ids", "solution"):
            assert mine[key] == theirs[key], key
        assert (mine["trainer_state"].global_step, mine["trainer_state"].max_steps) == (3, 10)
    # the two user signatures: lengths of the completions, and the solution found in the completion, not the prompt
    assert ours[:, 0].tolist() == [float(len(a)) for a in ANSWERS]
    assert ours[:, 1].tolist() == [1.0, 0.0]
    assert ours[0, 2] == 1.0 and math.isnan(ours[1, 2])
    if conversational:
        assert ours[:, 5].tolist() == [1.0, 0.0]  # think_format_reward on TRL's message lists


def test_the_stage_calls_them_as_trl_does_and_sums_none_as_trl(tmp_path, tokenizer):
    """GRPOStage.rewards, the call site: message lists for conversational prompts, the column, the
    step as trainer_state, what log_metric logged, and a None left out of the sum (TRL's nansum)."""
    from stages.grpo import GRPOConfig, GRPOStage

    logged = []

    def metric_logger(completions, log_metric, trainer_state, **kwargs):
        log_metric("answers", float(len(completions)))
        logged.append(trainer_state.global_step)
        return [None, 2.0]

    samples = prompt_samples(tmp_path, tokenizer, conversational=True)
    cfg = GRPOConfig()
    cfg.grpo.reward_funcs = ["test_rewards:solution_in_completion", "test_rewards:returns_none_for_the_second"]
    cfg.train.max_steps = 10
    stage = GRPOStage.__new__(GRPOStage)
    stage.cfg, stage.tokenizer, stage.reward_path, stage.step = cfg, tokenizer, None, 4
    stage.funcs = [solution_in_completion, metric_logger]
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in ANSWERS]
    rollout = types.SimpleNamespace(
        conversations=None, responses=ids, finished=torch.tensor([True, True]), response_mask=torch.ones(2, 6)
    )
    total, parts, _ = stage.rewards(samples, rollout)
    assert parts["solution_in_completion"].tolist() == [1.0, 0.0]
    assert total.tolist() == [1.0, 2.0]  # 1 + (None: left out), 0 + 2
    assert logged == [4] and stage.reward_log.means() == {"grpo/reward_metric/answers": 2.0}


def test_accuracy_reward_when_math_verify_is_installed(tmp_path, tokenizer, monkeypatch):
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    samples = prompt_samples(tmp_path, tokenizer, conversational=True)
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in ANSWERS]
    assert torch.allclose(
        relay_calls([accuracy_reward], samples, ids)[0], trl_calls([accuracy_reward], True, ids, monkeypatch)[0]
    )


# ---------------------------------------------------------------------------------------------
# A user's own module
# ---------------------------------------------------------------------------------------------

USER_MODULE = "def score(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"


def test_a_users_module_by_file_path_and_from_the_working_directory(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_rewards_by_path.py").write_text(USER_MODULE)
    (folder / "my_rewards_in_cwd.py").write_text(USER_MODULE)
    by_path = f"{folder / 'my_rewards_by_path.py'}:score"
    assert rw.reward_func_problem(by_path) is None
    assert rw.call_reward(rw.load_reward_func(by_path), by_path, ["p"], ["abc"]) == [3.0]
    monkeypatch.chdir(tmp_path)
    assert rw.reward_func_problem("mine/my_rewards_by_path.py:score") is None  # relative to the working directory
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the working directory is appended to a copy
    assert rw.reward_func_problem("my_rewards_in_cwd:score") is None
    assert rw.load_reward_func("my_rewards_in_cwd:score")(completions=["ab"]) == [2.0]


def test_a_module_on_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "pythonpath_rewards.py").write_text(USER_MODULE)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    assert rw.reward_func_problem("pythonpath_rewards:score") is None


def test_missing_or_broken_modules_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = rw.reward_func_problem("no_such_rewards_xyz:score")
    assert missing.startswith(
        "'no_such_rewards_xyz:score': no module 'no_such_rewards_xyz' in the installed packages, PYTHONPATH"
    )
    assert "\n" not in missing
    assert rw.reward_func_problem("rewards/none.py:score") == (
        f"'rewards/none.py:score': no such file 'rewards/none.py' (relative to the working directory {tmp_path})"
    )
    (tmp_path / "broken_rewards.py").write_text("import no_such_dependency_xyz\n")
    assert rw.reward_func_problem(f"{tmp_path / 'broken_rewards.py'}:score").endswith(
        "cannot be imported (ModuleNotFoundError: No module named 'no_such_dependency_xyz')"
    )
    (tmp_path / "exits.py").write_text("raise SystemExit('no')\n")
    assert "cannot be imported (SystemExit: no)" in rw.reward_func_problem(f"{tmp_path / 'exits.py'}:score")
    assert "has no 'nope'" in rw.reward_func_problem("pipeline.algorithms.rewards:nope")
    assert "is not 'module:function'" in rw.reward_func_problem("pipeline.algorithms.rewards")
