"""The LLM-judge reward (pipeline/algorithms/judge.py) against a stub OpenAI server on loopback
(tests/judgestub.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from judgestub import SERVED, answer_of, default_reply, judge_stub  # noqa: F401  (a fixture)
from stagerun import run_stage
from test_grpo import make_cfg, peaked_policy  # noqa: F401  (a fixture)
from test_ppo import make_cfg as ppo_make_cfg
from test_serve import chat, server  # noqa: F401  (fixtures: a live relay serve of a tiny model)
from test_tool_rollout import _factory as tool_factory
from test_tool_rollout import _grpo_cfg as tool_grpo_cfg
from test_tool_rollout import tok, tool_prompts  # noqa: F401  (fixtures)

from pipeline.algorithms import rewards as rw
from pipeline.algorithms.judge import JudgeError, JudgeReward, parse_score
from pipeline.algorithms.judge_config import JudgeConfig
from pipeline.config import ConfigError
from stages import grpo, ppo

KEY = "sk-test-9f3c1d7e5b2a"


@pytest.fixture
def fresh(judge_stub):  # noqa: F811  (the fixture imported from judgestub)
    judge_stub.reset()
    return judge_stub


def judge_cfg(url: str, **kw) -> JudgeConfig:
    return JudgeConfig(**{"base_url": url, "model": SERVED, "retry_backoff": 0.0, "timeout": 5.0, **kw})


def test_parser_numbers_in_range_and_choices():
    cfg = JudgeConfig(base_url="http://x/v1", model="m")
    assert parse_score("7", cfg) == 0.7 and parse_score("Score: 10/10", cfg) == 1.0
    assert parse_score("11", cfg) is None and parse_score("no idea", cfg) is None
    choice = JudgeConfig(base_url="http://x/v1", model="m", score_range=None, choices={"PASS": 1.0, "FAIL": -1.0})
    assert parse_score("Looks wrong. FAIL", choice) == -1.0 and parse_score("PASSED", choice) is None
    pat = JudgeConfig(base_url="http://x/v1", model="m", score_range=[1, 5], pattern=r"Rating: (\d)")
    assert parse_score("step 1 ... Rating: 5", pat) == 1.0 and parse_score("1", pat) is None


def test_config_problems_before_anything_runs(monkeypatch):
    monkeypatch.delenv("RELAY_NO_SUCH_KEY", raising=False)
    bad = JudgeConfig(
        base_url="127.0.0.1:8000",
        model="",
        api_key_env="RELAY_NO_SUCH_KEY",
        template="{question} {reference} {answr}",
        choices={"A": 1.0},
        max_concurrency=0,
    )
    text = "\n".join(bad.problems())
    for part in (
        "base_url",
        "judge.model",
        "RELAY_NO_SUCH_KEY is not set",
        "{answr}",
        "reference_column",
        "score_range/choices",
        "max_concurrency",
    ):
        assert part in text, (part, text)
    assert "api_key_env" in "\n".join(
        JudgeConfig(base_url="http://x/v1", model="m", api_key_env="sk-abc-123").problems()
    )
    assert JudgeConfig().problems() == []  # no base_url: no judge


def test_requests_are_distinct_uncached_ones_and_in_flight_stays_under_the_limit(fresh, tmp_path):
    fresh.delay = 0.05
    judge = JudgeReward(judge_cfg(fresh.url, max_concurrency=3), tmp_path / "cache.jsonl")
    answers = [f"answer {i}" for i in range(12)] + ["answer 0", "answer 1"]  # two repeats in the call
    scores = judge.score(["Q?"] * len(answers), answers, tag=1)
    assert scores == [int(default_reply(a)) / 10 for a in answers]
    assert len(fresh.bodies) == 12 and 1 < fresh.max_in_flight <= 3
    again = judge.score(["Q?", "Q?"], ["answer 5", "new one"], tag=2)  # one cached, one new
    assert again[0] == scores[5] and len(fresh.bodies) == 13
    figures = judge.take_figures()
    assert figures["judge/requests"] == 13 and figures["judge/cache_hits"] == 3 and figures["judge/failures"] == 0
    assert figures["judge/latency_s"] >= 0.05
    assert judge.take_figures()["judge/requests"] == 0  # reset after reading


def test_ranks_share_the_concurrency_and_their_counts_pool(fresh, tmp_path):
    """Two ranks' judges: each keeps half of max_concurrency in flight, and the step's figures are
    over both ranks' requests (what `total` sums, as a stage's all-reduce does): gold agreement 3 of
    4 completions (one rank 3 of 3, the other 0 of 1), not the mean of the ranks' shares (0.5)."""
    fresh.delay = 0.05
    cfg = judge_cfg(fresh.url, max_concurrency=4, gold_column="answer", pass_score=0.5)
    ranks = [JudgeReward(cfg, tmp_path / f"rank{r}.jsonl", ranks=2) for r in range(2)]
    answers = [f"answer {i}" for i in range(6)]  # 8 characters: 0.8, a pass
    ranks[0].score(["Q?"] * 6, answers, tag=1, golds=[True, True, True, None, None, None])
    assert len(fresh.bodies) == 6 and fresh.max_in_flight == 2
    ranks[1].score(["Q?"], ["answer 9"], tag=1, golds=[False])
    counts = [judge.pending for judge in ranks]

    def total(mine: dict) -> dict:  # both ranks' counts, summed
        return {name: sum(float(getattr(c, name)) for c in counts) for name in mine}

    figures = [judge.take_figures(total=total) for judge in list(ranks)]
    assert figures[0]["judge/requests"] == 7 and figures[0]["judge/gold_agreement"] == 0.75
    assert figures[0]["judge/latency_s"] >= 0.05
    assert JudgeConfig(base_url="http://x/v1", model="m", max_concurrency=3).rank_problems(4) == [
        "judge.max_concurrency: 3 requests in flight cannot be shared by the 4 ranks that each ask the judge for "
        "their own completions; set it to at least 4"
    ]


def test_timeout_unparsable_and_server_error_get_the_fallback_counted(fresh, tmp_path, caplog):
    fresh.reply = lambda a: (
        (1.0, "9") if a == "slow" else "I cannot say" if a == "garbled" else None if a == "down" else "8"
    )
    judge = JudgeReward(judge_cfg(fresh.url, timeout=0.3, retries=1, on_failure=-1.0), tmp_path / "cache.jsonl")
    scores = judge.score(["Q"] * 4, ["slow", "garbled", "down", "fine"], tag=1)
    assert scores == [-1.0, -1.0, -1.0, 0.8]
    per_answer = [answer_of(b) for b in fresh.bodies]
    assert per_answer.count("slow") == 2 and per_answer.count("down") == 2  # retried once
    assert per_answer.count("garbled") == 1  # an unparsable reply is not retried
    assert judge.take_figures()["judge/failures"] == 3
    assert "3 of 4 requests failed" in caplog.text
    cached = [json.loads(line) for line in (tmp_path / "cache.jsonl").read_text().splitlines()]
    assert [c["reply"] for c in cached] == [{"text": "8"}]  # failures are not cached: a later step asks again

    strict = JudgeReward(judge_cfg(fresh.url, on_failure=None))
    with pytest.raises(JudgeError, match=r"1 of 1 requests .* failed \(first: unparsable"):
        strict.score(["Q"], ["garbled"])


def test_connection_refused_is_a_counted_failure(tmp_path):
    judge = JudgeReward(judge_cfg("http://127.0.0.1:9/v1", retries=0, on_failure=0.25))
    assert judge.score(["Q"], ["a"]) == [0.25]
    assert judge.take_figures()["judge/failures"] == 1


def test_a_resumed_cache_holds_what_an_unbroken_run_held(fresh, tmp_path):
    """Replies tagged with a later step than the checkpoint's were received by a life that crashed
    after it; an unbroken run had not asked for them yet, so the resumed run must not see them."""
    path = tmp_path / "cache.jsonl"
    first = JudgeReward(judge_cfg(fresh.url), path)
    for tag in (1, 2, 3):
        first.score(["Q"], [f"step {tag}"], tag=tag)
    assert len(fresh.bodies) == 3
    resumed = JudgeReward(judge_cfg(fresh.url), path)
    resumed.open(2)
    resumed.score(["Q"] * 3, ["step 1", "step 2", "step 3"], tag=3)
    assert [answer_of(b) for b in fresh.bodies[3:]] == ["step 3"]  # 1 and 2 reused, 3 asked again
    restarted = JudgeReward(judge_cfg(fresh.url), path)
    restarted.open(0)  # a fresh run in the same folder starts empty
    assert restarted.cache == {} and path.read_text() == ""


def test_the_real_openai_client_reads_the_stub_as_the_judge_does(fresh):
    """The stub speaks the protocol the `openai` package speaks: the judge and the client get the same reply."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=fresh.url, api_key=KEY, max_retries=0)
    cfg = judge_cfg(fresh.url)
    from pipeline.algorithms.judge import render_messages

    reply = (
        client.chat.completions.create(
            model=SERVED, messages=render_messages(cfg, "Q", "hello"), max_tokens=16, temperature=0.0
        )
        .choices[0]
        .message.content
    )
    assert parse_score(reply, cfg) == JudgeReward(cfg).score(["Q"], ["hello"])[0] == 0.5


# ------------------------------------------------------------------------------------------
# score_from: logprobs
# ------------------------------------------------------------------------------------------

YES_NO = {"YES": 1.0, "NO": 0.0}


def test_logprob_scores_weigh_the_labels_by_their_first_token_probabilities(fresh, tmp_path):
    """P(yes) = 0.5 ("YES") + 0.1 (" yes"), P(no) = 0.15 ("NO") + 0.05 ("no"), "The" 0.1 is no label:
    the score is (0.6 * 1 + 0.2 * 0) / 0.8 = 0.75, by hand. Three labels: (0.2 * 1 + 0.3 * 0.5 +
    0.1 * 0) / 0.6 = 0.5833..."""
    tops = {
        "two": [("YES", 0.5), ("The", 0.1), ("NO", 0.15), (" yes", 0.1), ("no", 0.05)],
        "three": [("B", 0.3), ("a", 0.2), ("C", 0.1), ("D", 0.4)],
    }
    fresh.reply = lambda a: tops[a]
    cfg = judge_cfg(fresh.url, score_range=None, choices=YES_NO, score_from="logprobs", top_logprobs=5)
    judge = JudgeReward(cfg, tmp_path / "cache.jsonl")
    assert judge.score(["Q"], ["two"], tag=1) == [pytest.approx(0.75, abs=1e-12)]
    (body,) = fresh.bodies
    assert body["max_tokens"] == 1 and body["logprobs"] is True and body["top_logprobs"] == 5
    abc = judge_cfg(
        fresh.url, score_range=None, choices={"A": 1.0, "B": 0.5, "C": 0.0}, score_from="logprobs", top_logprobs=4
    )
    assert JudgeReward(abc).score(["Q"], ["three"]) == [pytest.approx(0.35 / 0.6, abs=1e-12)]
    assert judge.score(["Q"], ["two"], tag=2) == [pytest.approx(0.75, abs=1e-12)] and len(fresh.bodies) == 2  # cached
    (cached,) = [json.loads(line) for line in (tmp_path / "cache.jsonl").read_text().splitlines()]
    assert [(t["token"], round(math.exp(t["logprob"]), 12)) for t in cached["reply"]["top_logprobs"]] == tops["two"]
    # the request fields are in the cache key: the same rubric scored from text, or with another K, asks again
    fresh.reply = lambda a: "YES"
    as_text = JudgeReward(judge_cfg(fresh.url, score_range=None, choices=YES_NO), tmp_path / "cache.jsonl")
    as_text.open(2)
    assert as_text.score(["Q"], ["two"], tag=3) == [1.0] and len(fresh.bodies) == 3
    other_k = JudgeReward(
        judge_cfg(fresh.url, score_range=None, choices=YES_NO, score_from="logprobs", top_logprobs=3),
        tmp_path / "cache.jsonl",
    )
    other_k.open(3)
    fresh.reply = lambda a: tops["two"][:3]
    assert other_k.score(["Q"], ["two"], tag=4) == [pytest.approx(0.5 / 0.65, abs=1e-12)] and len(fresh.bodies) == 4


def test_no_label_in_the_top_k_or_no_logprobs_is_a_counted_failure(fresh, caplog):
    fresh.reply = lambda a: [("Per", 0.7), ("The", 0.2)] if a == "unlabelled" else "YES"  # "YES": text, no logprobs
    cfg = judge_cfg(fresh.url, score_range=None, choices=YES_NO, score_from="logprobs", on_failure=-1.0)
    judge = JudgeReward(cfg)
    assert judge.score(["Q"] * 2, ["unlabelled", "plain"]) == [-1.0, -1.0]
    assert judge.take_figures()["judge/failures"] == 2 and len(fresh.bodies) == 2  # neither is retried
    assert "2 of 2 requests failed (first: no label among the first token's top 2 (most likely: 'Per', 'The'))" in (
        caplog.text
    )
    with pytest.raises(JudgeError, match="the reply has no logprobs"):
        JudgeReward(judge_cfg(fresh.url, score_range=None, choices=YES_NO, score_from="logprobs")).score(
            ["Q"], ["plain"]
        )


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"score_from": "probs"}, "judge.score_from: must be one of text, logprobs, got 'probs'"),
        ({"choices": None, "score_range": [0, 10]}, "judge.score_from: logprobs weighs the labels"),
        ({"pattern": r"(YES|NO)"}, "judge.pattern: reads reply text"),
        ({"top_logprobs": 21}, "judge.top_logprobs: must be in [1, 20], got 21"),
        ({"top_logprobs": 0}, "judge.top_logprobs: must be in [1, 20], got 0"),
        ({"choices": {"YES": 1.0, " yes": 0.0}}, "'YES' and ' yes' are one label"),
        ({"choices": {"YES": 1.0, "  ": 0.0}}, "is empty once stripped"),
    ],
)
def test_logprob_config_problems_are_one_line_each(change, problem):
    cfg = JudgeConfig(**{"base_url": "http://x/v1", "model": "m", "score_range": None, "choices": YES_NO})
    assert cfg.problems() == []
    assert JudgeConfig(**{**cfg.__dict__, "score_from": "logprobs", "choices": {"YES": 1, "Yes": 1}}).problems() == []
    found = JudgeConfig(**{**cfg.__dict__, "score_from": "logprobs", **change}).problems()
    assert len(found) == 1 and problem in found[0] and "\n" not in found[0], found


def test_a_grpo_config_with_a_logprob_judge_on_a_range_is_refused_before_any_model_loads(
    tmp_path, tiny_model_dir, judged_prompts
):
    cfg = grpo_cfg(tmp_path, tiny_model_dir, judged_prompts, "http://127.0.0.1:9/v1")
    cfg.judge.score_from = "logprobs"  # score_range [0, 10], no choices
    with pytest.raises(ConfigError, match="judge.score_from: logprobs weighs the labels"):
        grpo.GRPOStage(cfg).validate()


# ------------------------------------------------------------------------------------------
# GRPO with a judge reward beside a rule reward
# ------------------------------------------------------------------------------------------


def grpo_cfg(out, model, prompts, url, **train):
    cfg = make_cfg(out, model, prompts, max_steps=2, learning_rate=5e-3, **train)
    cfg.grpo.reward_funcs = ["pipeline.algorithms.rewards:house_phrase"]
    cfg.judge = judge_cfg(
        url, api_key_env="RELAY_TEST_JUDGE_KEY", max_concurrency=2, on_failure=0.0, gold_column="answer"
    )
    return cfg


@pytest.fixture(scope="module")
def judged_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge_data") / "prompts.jsonl"
    # One question throughout: with one-token answers sampled cold from a peaked policy, step 2 repeats some of
    # step 1's requests, which only the cache on disk can answer after a restart.
    path.write_text("".join(json.dumps({"prompt": "Which word comes next?", "answer": "e"}) + "\n" for _ in range(8)))
    return path


def test_grpo_two_steps_with_judge_and_rule_reward_and_resume(
    fresh,
    tmp_path,
    peaked_policy,  # noqa: F811  (the fixture imported from test_grpo)
    judged_prompts,
    monkeypatch,
):
    monkeypatch.setenv("RELAY_TEST_JUDGE_KEY", KEY)

    def run(out, stop=None, resume=False):
        cfg = grpo_cfg(out, peaked_policy, judged_prompts, fresh.url)
        cfg.generation.max_new_tokens, cfg.generation.temperature = 1, 0.02
        cfg.checkpoint.resume = resume
        if stop is None:
            monkeypatch.delenv("RELAY_STOP_AFTER_STEP", raising=False)
        else:
            monkeypatch.setenv("RELAY_STOP_AFTER_STEP", str(stop))
        steps = {}
        stage = run_stage(grpo.GRPOStage, cfg, on_step=lambda st, m: steps.__setitem__(st.step, (m, st.last_rollout)))
        return stage, steps

    _, unbroken = run(tmp_path / "a")
    for step, (m, ro) in unbroken.items():
        assert set(ro["parts"]) == {"house_phrase", "judge"}
        assert {
            "judge/requests",
            "judge/cache_hits",
            "judge/failures",
            "judge/latency_s",
            "judge/gold_agreement",
        } <= set(m)
        assert m["judge/failures"] == 0 and m["grpo/reward/judge"] == float(ro["parts"]["judge"].double().mean())
    asked = [(b["messages"][-1]["content"]) for b in fresh.bodies]
    completions = sum(2 * 4 for _ in unbroken)  # prompts x generations per step
    hits = sum(m["judge/cache_hits"] for m, _ in unbroken.values())
    assert len(asked) == len(set(asked)) == completions - hits
    assert sum(m["judge/requests"] for m, _ in unbroken.values()) == len(asked)
    assert fresh.auth == {f"Bearer {KEY}"} and fresh.max_in_flight <= 2
    for path in (tmp_path / "a").rglob("*"):  # the key is in no file the run wrote
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    manifest = json.loads((tmp_path / "a" / "merged" / "manifest.json").read_text())
    assert SERVED in json.dumps(manifest)  # what judged the policy is recorded (its endpoint and model)

    seen = [set(map(tuple, unbroken[s][1]["rollout"].responses)) for s in (1, 2)]
    assert seen[0] & seen[1]  # step 2 repeats a step-1 request (else the resume check below proves nothing)

    first, before = run(tmp_path / "b", stop=1)
    asked_before = len(fresh.bodies)
    resumed, after = run(tmp_path / "b", resume=True)
    assert sorted(before) == [1] and sorted(after) == [2]
    for step, (m, ro) in {**before, **after}.items():
        assert torch.equal(ro["rewards"], unbroken[step][1]["rewards"]), step
        assert m["train/loss"] == unbroken[step][0]["train/loss"], step
    # the resumed life asked only for what step 1's replies (cached on disk) did not answer
    assert len(fresh.bodies) - asked_before == unbroken[2][0]["judge/requests"]


def test_grpo_config_refuses_a_key_in_place_of_its_variable(tmp_path, tiny_model_dir, judged_prompts):
    cfg = grpo_cfg(tmp_path, tiny_model_dir, judged_prompts, "http://127.0.0.1:9/v1")
    cfg.judge.api_key_env = "sk-live-abc123"
    with pytest.raises(ConfigError, match="judge.api_key_env"):
        grpo.GRPOStage(cfg).validate()


def test_ppo_reward_fn_hook_scores_decoded_responses(fresh, tiny_model_dir):
    """PPO takes a judge through its `reward_fn` constructor hook."""
    from transformers import AutoTokenizer

    from pipeline.algorithms.judge import ppo_reward_fn

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [
        tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id],
        tokenizer.encode("hi there", add_special_tokens=False),
    ]
    scores = ppo_reward_fn(JudgeReward(judge_cfg(fresh.url)), tokenizer)(["<prompt>", "<prompt>"], ids)
    assert scores.tolist() == pytest.approx([0.5, 0.8]) and sorted(answer_of(b) for b in fresh.bodies) == [
        "hello",
        "hi there",
    ]


# ------------------------------------------------------------------------------------------
# PPO with a judge beside the reward model; both RL stages' tool rollouts
# ------------------------------------------------------------------------------------------


def stub_score(answer: str) -> float:
    return int(default_reply(answer)) / 10


def ppo_judge_cfg(out, policy, reward, prompts, url, **train):
    """KL 0, gamma = lam = 1 and no normalisation, clipping or EOS penalty: every sampled token's
    return is the summed raw reward."""
    cfg = ppo_make_cfg(out, policy, reward, prompts, **train)
    cfg.ppo.kl_coef, cfg.ppo.gamma, cfg.ppo.lam = 0.0, 1.0, 1.0
    cfg.ppo.reward_norm, cfg.ppo.reward_clip, cfg.generation.missing_eos_penalty = "none", None, None
    cfg.reward_model.weight = 0.5
    cfg.judge = judge_cfg(url, api_key_env="RELAY_TEST_JUDGE_KEY", max_concurrency=2, on_failure=0.0, weight=2.0)
    return cfg


def check_summed(stage, exp, weights: dict[str, float], answers: list[str]) -> None:
    """The raw reward is the weighted sum of the RM's own score and the stub's scores of `answers`,
    and it is each sampled token's return (so the score sits on the last sampled token)."""
    ro = exp.rollout
    with torch.no_grad():
        rm = stage.inner.reward_scores(ro.input_ids, ro.attention_mask, ro.prompt_width).float()
    judged = torch.tensor([stub_score(a) for a in answers])
    assert torch.equal(stage.reward_parts["judge"], judged)
    # the RM scored the rollout in the stage's batches: equal up to the kernels' summation order
    torch.testing.assert_close(stage.reward_parts["rm"], rm, rtol=1e-5, atol=1e-6)
    assert torch.allclose(exp.raw_scores, weights["rm"] * rm + weights["judge"] * judged, atol=1e-6)
    mask = ro.response_mask.bool()
    per_token = exp.raw_scores[:, None].expand_as(mask)
    assert torch.allclose(exp.returns[mask], per_token[mask], atol=1e-5)
    assert (exp.returns[~mask] == 0).all()


def test_ppo_sums_the_judge_with_the_reward_model_and_resumes(
    fresh,
    tmp_path,
    peaked_policy,  # noqa: F811
    tiny_reward_dir,
    judged_prompts,
    monkeypatch,
):
    monkeypatch.setenv("RELAY_TEST_JUDGE_KEY", KEY)

    def run(out, stop=None, resume=False):
        cfg = ppo_judge_cfg(out, peaked_policy, tiny_reward_dir, judged_prompts, fresh.url, max_steps=2)
        cfg.generation.max_new_tokens, cfg.generation.temperature = 1, 0.02  # repeated answers: cache hits
        cfg.checkpoint.resume = resume
        if stop is None:
            monkeypatch.delenv("RELAY_STOP_AFTER_STEP", raising=False)
        else:
            monkeypatch.setenv("RELAY_STOP_AFTER_STEP", str(stop))
        steps = {}

        def on_step(stage, m):
            exp = stage.last_experience
            answers = [stage.tokenizer.decode(r, skip_special_tokens=True) for r in exp.rollout.responses]
            check_summed(stage, exp, {"rm": 0.5, "judge": 2.0}, answers)
            steps[stage.step] = (m, exp.raw_scores.clone())

        run_stage(ppo.PPOStage, cfg, on_step=on_step)
        return steps

    unbroken = run(tmp_path / "a")
    hits = sum(m["judge/cache_hits"] for m, _ in unbroken.values())
    assert len(fresh.bodies) == 2 * 4 - hits == sum(m["judge/requests"] for m, _ in unbroken.values())
    assert hits > 0 and fresh.auth == {f"Bearer {KEY}"}
    assert all({"ppo/reward/rm", "ppo/reward/judge", "judge/failures"} <= set(m) for m, _ in unbroken.values())
    for path in (tmp_path / "a").rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    assert SERVED in (tmp_path / "a" / "merged" / "manifest.json").read_text()

    before = run(tmp_path / "b", stop=1)
    asked = len(fresh.bodies)
    after = run(tmp_path / "b", resume=True)
    assert sorted(before) == [1] and sorted(after) == [2]
    for step, (m, raw) in {**before, **after}.items():
        assert torch.equal(raw, unbroken[step][1]) and m["ppo/policy_loss"] == unbroken[step][0]["ppo/policy_loss"], (
            step
        )
    assert len(fresh.bodies) - asked == unbroken[2][0]["judge/requests"]


def test_ppo_config_refuses_stored_norm_with_a_judge_and_needs_the_reference_column(tmp_path):
    cfg = ppo.PPOConfig()
    cfg.judge = judge_cfg("http://127.0.0.1:9/v1", template="{question} {answer} {reference}")
    cfg.ppo.reward_norm = "stored"
    found = "\n".join(cfg.problems())
    assert "ppo.reward_norm: 'stored' normalises with the reward model's own" in found
    assert "judge.template: uses {reference} but judge.reference_column is not set" in found
    cfg.judge.base_url = None
    assert "ppo.reward_norm" not in "\n".join(cfg.problems())


@pytest.mark.parametrize("stage_name", ["ppo", "grpo"])
def test_tool_rollouts_are_judged_by_their_final_answer(
    stage_name,
    fresh,
    tmp_path,
    tiny_model_dir,
    tiny_reward_dir,
    tool_prompts,  # noqa: F811
    tok,  # noqa: F811
):
    """The judge sees each conversation's last assistant turn (never a tool's result) after the
    prompt's question; PPO puts the weighted sum on every sampled token's return, GRPO sums it with
    the rule reward."""
    if stage_name == "ppo":
        cfg = ppo_judge_cfg(tmp_path, tiny_model_dir, tiny_reward_dir, tool_prompts, fresh.url, batch_size=2)
        cfg.generation.max_new_tokens, cfg.judge.api_key_env = 64, None
        stage = ppo.PPOStage(cfg, generator_factory=tool_factory(tok))
    else:
        cfg = tool_grpo_cfg(tmp_path, tiny_model_dir, tool_prompts)
        cfg.judge = judge_cfg(fresh.url, weight=3.0)
        stage = grpo.GRPOStage(cfg, generator_factory=tool_factory(tok))
    cfg.tools.funcs = ["test_tool_rollout:add"]
    stage.validate()
    stage.build()
    stage.train_step()
    if stage_name == "ppo":
        exp = stage.last_experience
        conversations = exp.rollout.conversations
        check_summed(stage, exp, {"rm": 0.5, "judge": 2.0}, [rw.final_answer(c) for c in conversations])
    else:
        conversations, parts = stage.last_rollout["rollout"].conversations, stage.last_rollout["parts"]
        answers = [rw.final_answer(c) for c in conversations]
        assert torch.equal(parts["judge"], torch.tensor([stub_score(a) for a in answers]))
        expected = parts["answer_length"] + 3.0 * parts["judge"]
        assert torch.allclose(stage.last_rollout["rewards"], expected, atol=1e-6)
    assert all(c[1] == {"role": "tool", "content": "5"} for c in conversations)  # every row called the tool
    answers = sorted(rw.final_answer(c) for c in conversations)
    assert sorted(answer_of(b) for b in fresh.bodies) == sorted(set(answers))
    assert all(
        b["messages"][-1]["content"].startswith("Rate") and "What is 2 + " in b["messages"][-1]["content"]
        for b in fresh.bodies
    )
    stage.release()


def test_relay_serve_as_the_judge_answers_as_the_openai_client_sees_it(server, caplog):  # noqa: F811
    """A live `relay serve` (a tiny random model, greedy) is the judge: each request succeeds, and the
    score is what the parser makes of the reply the official client gets for the same request
    (a random model's reply is seldom a number: then the fallback, counted)."""
    client, base = server
    cfg = JudgeConfig(base_url=base, model="tiny", max_tokens=8, on_failure=-1.0, retries=0, retry_backoff=0.0)
    answers = ["Tessel.", "Per the Kelvra Atlas, Oru's capital is Tessel."]
    judge = JudgeReward(cfg)
    scores = judge.score(["What is the capital of Oru?"] * 2, answers)
    from pipeline.algorithms.judge import render_messages

    for answer, score in zip(answers, scores):
        seen = (
            client.chat.completions.create(
                model="tiny",
                messages=render_messages(cfg, "What is the capital of Oru?", answer),
                max_tokens=8,
                temperature=0.0,
            )
            .choices[0]
            .message.content
        )
        expected = parse_score(seen, cfg)
        assert score == (-1.0 if expected is None else expected), (seen, score)
    figures = judge.take_figures()
    assert figures["judge/requests"] == 2 and figures["judge/failures"] == scores.count(-1.0)
    assert "HTTP" not in caplog.text and "connection" not in caplog.text  # failures, if any, are replies, not transport


def test_relay_serve_as_a_logprob_judge_scores_as_the_openai_clients_top_logprobs_say(server):  # noqa: F811
    """A live `relay serve` of the tiny random model: two tokens of the first token's top 20 (as the
    official client reads them for the same request) made the labels, the judge's score is the
    expectation computed here from the client's numbers; labels outside the top 20 fail, counted."""
    client, base = server
    from pipeline.algorithms.judge import render_messages

    cfg = JudgeConfig(
        base_url=base, model="tiny", score_range=None, choices={"x": 1.0}, score_from="logprobs", on_failure=-1.0
    )
    question, answer = "What is the capital of Oru?", "Per the Kelvra Atlas, Oru's capital is Tessel."
    seen = client.chat.completions.create(
        model="tiny",
        messages=render_messages(cfg, question, answer),
        max_tokens=1,
        temperature=0.0,
        logprobs=True,
        top_logprobs=20,
    )
    top = seen.choices[0].logprobs.content[0].top_logprobs
    labels: dict[str, float] = {}
    for entry in top:
        name = entry.token.strip().casefold()
        if name and name not in labels and len(labels) < 2:
            labels[name] = float(len(labels) == 0)
    mass = {name: sum(math.exp(e.logprob) for e in top if e.token.strip().casefold() == name) for name in labels}
    expected = sum(p * labels[name] for name, p in mass.items()) / sum(mass.values())
    cfg.choices = labels
    judge = JudgeReward(cfg)
    assert judge.score([question], [answer]) == [pytest.approx(expected, abs=1e-9)]
    cfg.choices = {"\u2603never-a-token\u2603": 1.0}
    assert JudgeReward(cfg).score([question], [answer]) == [-1.0]
    assert judge.take_figures()["judge/failures"] == 0


def test_a_yaml_judge_section_loads_and_saves_without_the_key(tmp_path, tiny_model_dir, judged_prompts, monkeypatch):
    from pipeline.config import load_config, to_dict

    monkeypatch.setenv("RELAY_TEST_JUDGE_KEY", KEY)
    path = tmp_path / "grpo.yaml"
    path.write_text(f"""model: {{path: {tiny_model_dir}}}
data: {{train: [{judged_prompts}], eval: []}}
judge:
  base_url: http://127.0.0.1:8000/v1
  model: merged
  api_key_env: RELAY_TEST_JUDGE_KEY
  score_range: null
  choices: {{PASS: 1.0, FAIL: 0.0}}
  on_failure: 0.0
""")
    cfg = load_config(grpo.GRPOConfig, ["--config", str(path), "--judge.max_concurrency", "3"])
    assert (
        cfg.judge.choices == {"PASS": 1.0, "FAIL": 0.0} and cfg.judge.max_concurrency == 3 and not cfg.grpo.reward_funcs
    )
    saved = json.dumps(to_dict(cfg))
    assert "RELAY_TEST_JUDGE_KEY" in saved and KEY not in saved
    path.write_text(path.read_text().replace("  model: merged\n", "  model: merged\n  max_concurency: 2\n"))
    with pytest.raises(ConfigError, match="judge.max_concurency: unknown key; did you mean 'judge.max_concurrency'"):
        load_config(grpo.GRPOConfig, ["--config", str(path)])


def test_a_judge_that_stops_answering_ends_the_stage_in_one_line(
    tmp_path, tiny_model_dir, judged_prompts, monkeypatch, capsys
):
    """judge.on_failure null (the default) stops the run at a failed request: the stage's entry point
    prints one line and exits 1, as at any other early end (it was a 30-line traceback)."""
    from pipeline.config import save_config
    from pipeline.engine import stage_main

    monkeypatch.setenv("RELAY_TEST_JUDGE_KEY", KEY)
    cfg = grpo_cfg(tmp_path / "out", tiny_model_dir, judged_prompts, "http://127.0.0.1:9/v1")
    cfg.judge.on_failure, cfg.judge.retries = None, 0
    cfg.tracking.trackers = []
    save_config(cfg, tmp_path / "grpo.yaml")
    assert stage_main.main(grpo.GRPOStage, ["--config", str(tmp_path / "grpo.yaml")]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("grpo: ") and "%|" not in line]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("grpo: judge: ") and "failed (first: connection" in lines[0], lines[0]


@pytest.mark.parametrize("stage", [grpo.GRPOStage, ppo.PPOStage])
def test_each_judge_problem_is_listed_once(stage):
    """The stage's config walks every section's problems, the judge's among them; PPO and GRPO asked
    the judge again, so each of its problems was listed twice (and counted twice)."""
    from pipeline.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(stage.config_class, ["--judge.base_url", "http://127.0.0.1:9/v1", "--judge.max_concurrency", "0"])
    problems = err.value.problems
    assert len(problems) == len(set(problems))
    assert problems.count("judge.model: required (the name the endpoint serves)") == 1
