"""The judge's cache keeps replies, not scores (pipeline/algorithms/judge.py): a rerun whose scoring
rules changed (`score_range`, `choices`, `pattern`) rescores the cached replies by the new rules and
asks the endpoint nothing; cache lines of another format are asked again, never read as replies."""

from __future__ import annotations

import json
import logging

import pytest
from judgestub import SERVED, Stub, default_reply
from test_sample_cmd import make, prompt_files, records  # noqa: F401  (a fixture)

from pipeline.algorithms.judge import JudgeReward, render_messages, request_body, request_key
from pipeline.algorithms.judge_config import JudgeConfig
from pipeline.tools.sample import run

YES_NO = {"YES": 1.0, "NO": 0.0}


@pytest.fixture
def stub():
    server = Stub()
    yield server
    server.server.shutdown()
    server.server.server_close()


def judge_cfg(url: str, **kw) -> JudgeConfig:
    return JudgeConfig(**{"base_url": url, "model": SERVED, "retry_backoff": 0.0, "timeout": 5.0, **kw})


def rerun(cfg: JudgeConfig, path, steps_done: int = 1) -> JudgeReward:
    """A later run's judge on the same cache file."""
    judge = JudgeReward(cfg, path)
    judge.open(steps_done)
    return judge


def test_other_scoring_rules_rescore_the_cached_replies_without_asking(stub, tmp_path):
    """The stub replies "6" to "sixsix" and "3" to "thr": 0.6 and 0.3 on [0, 10]; on [0, 20]
    (6 - 0) / (20 - 0) = 0.3 and 0.15; with pattern "(\\d)" on [0, 6], 1.0 and 0.5 (by hand)."""
    path = tmp_path / "cache.jsonl"
    answers = ["sixsix", "thr"]
    assert [default_reply(a) for a in answers] == ["6", "3"]
    first = JudgeReward(judge_cfg(stub.url), path)
    assert first.score(["Q"] * 2, answers) == [0.6, 0.3] and len(stub.bodies) == 2
    wider = rerun(judge_cfg(stub.url, score_range=[0, 20]), path)
    assert wider.score(["Q"] * 2, answers, tag=1) == [0.3, 0.15]
    assert len(stub.bodies) == 2 and wider.take_figures()["judge/cache_hits"] == 2
    patterned = rerun(judge_cfg(stub.url, score_range=[0, 6], pattern=r"(\d)"), path)
    assert patterned.score(["Q"] * 2, answers, tag=1) == [1.0, 0.5] and len(stub.bodies) == 2
    stub.reply = lambda a: "YES" if a == "sixsix" else "NO"
    labelled = JudgeReward(judge_cfg(stub.url, score_range=None, choices=YES_NO), tmp_path / "labels.jsonl")
    assert labelled.score(["Q"] * 2, answers) == [1.0, 0.0] and len(stub.bodies) == 4
    relabelled = rerun(
        judge_cfg(stub.url, score_range=None, choices={"YES": 0.75, "NO": 0.25}), tmp_path / "labels.jsonl"
    )
    assert relabelled.score(["Q"] * 2, answers, tag=1) == [0.75, 0.25] and len(stub.bodies) == 4


def test_other_choices_reweigh_the_cached_top_logprobs_without_asking(stub, tmp_path):
    """First-token probabilities YES 0.5, " yes" 0.1, NO 0.15, no 0.05, "The" 0.1: with {YES: 1, NO: 0}
    0.6 / 0.8 = 0.75; with {YES: 1, NO: 0.5} (0.6 + 0.1) / 0.8 = 0.875 (by hand)."""
    stub.reply = lambda a: [("YES", 0.5), ("The", 0.1), ("NO", 0.15), (" yes", 0.1), ("no", 0.05)]
    path = tmp_path / "cache.jsonl"
    first = JudgeReward(judge_cfg(stub.url, score_range=None, choices=YES_NO, score_from="logprobs"), path)
    assert first.score(["Q"], ["a"]) == [pytest.approx(0.75, abs=1e-12)]
    cfg = judge_cfg(stub.url, score_range=None, choices={"YES": 1.0, "NO": 0.5}, score_from="logprobs")
    assert rerun(cfg, path).score(["Q"], ["a"], tag=1) == [pytest.approx(0.875, abs=1e-12)]
    assert len(stub.bodies) == 1


def test_a_cached_reply_the_new_rules_cannot_score_is_a_counted_failure(stub, tmp_path, caplog):
    """ "15" is 0.75 on [0, 20] and outside [0, 10]: the rerun scores it on_failure, never its old score."""
    stub.reply = lambda a: "15"
    path = tmp_path / "cache.jsonl"
    assert JudgeReward(judge_cfg(stub.url, score_range=[0, 20]), path).score(["Q"], ["a"]) == [0.75]
    narrower = rerun(judge_cfg(stub.url, on_failure=-1.0), path)
    with caplog.at_level(logging.WARNING, logger="relay.judge"):
        assert narrower.score(["Q"], ["a"], tag=1) == [-1.0]
    assert len(stub.bodies) == 1 and narrower.take_figures()["judge/failures"] == 1
    assert "1 of 1 requests failed (first: unparsable reply '15')" in caplog.text


def test_cache_lines_without_a_reply_are_asked_again(stub, tmp_path, caplog):
    """A line as an older Relay wrote it (a score, no reply) is never read as this request's answer."""
    cfg = judge_cfg(stub.url, score_range=[0, 20])
    key = request_key(cfg, request_body(cfg, render_messages(cfg, "Q", "sixsix")))
    path = tmp_path / "cache.jsonl"
    path.write_text(json.dumps({"tag": 0, "key": key, "score": 0.6, "reply": "6"}) + "\n")
    with caplog.at_level(logging.INFO, logger="relay.judge"):
        judge = rerun(cfg, path)
    assert judge.cache == {} and "1 entries" in caplog.text
    assert judge.score(["Q"], ["sixsix"], tag=1) == [0.3] and len(stub.bodies) == 1
    (line,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert line["key"] == key and line["reply"] == {"text": "6"} and "score" not in line


def test_relay_sample_rerun_with_another_score_range_rescores_without_asking(
    stub,
    tmp_path,
    tiny_model_dir,
    prompt_files,  # noqa: F811
):
    """`relay sample` twice on the same prompts, the second with score_range [0, 20]: every score
    halves (the stub's reply n scores n / 10, then n / 20) and the judge is asked nothing new."""
    cfg = make(
        tmp_path,
        tiny_model_dir,
        prompt_files[:1],
        "judged.jsonl",
        mode="sft",
        reward_funcs=[],
        judge=judge_cfg(stub.url, max_concurrency=2),
    )
    first = run(cfg)
    before = records(tmp_path / "judged.jsonl")
    asked = len(stub.bodies)
    cfg.judge = judge_cfg(stub.url, max_concurrency=2, score_range=[0, 20])
    again = run(cfg)
    after = records(tmp_path / "judged.jsonl")
    assert first["requests"] == asked > 0 and again["requests"] == 0 and len(stub.bodies) == asked
    assert [r["messages"] for r in after] == [r["messages"] for r in before]
    for old, new in zip(before, after):
        assert new["scores"] == pytest.approx([s / 2 for s in old["scores"]], abs=1e-12)
        assert new["score"] == int(default_reply(new["messages"][-1]["content"])) / 20
