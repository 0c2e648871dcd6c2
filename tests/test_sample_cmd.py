"""`relay sample` (pipeline/tools/sample.py): scored samples of a tiny model written as DPO and SFT data
that `relay validate` accepts, the same file under the same seed."""

from __future__ import annotations

import json

import pytest

from data_formats.sources import read_entry
from data_formats.validate import iter_parsed
from pipeline.tools import cli
from pipeline.tools.sample import SampleConfig, best_and_worst, best_of_n, run


def answer_length(prompts, completions, **kwargs):
    """A deterministic score of the answer alone: its length in characters / 10."""
    text = lambda c: c if isinstance(c, str) else c[-1]["content"]  # noqa: E731
    return [len(text(c)) / 10 for c in completions]


def short_answer(prompts, completions, **kwargs):
    """The shorter the answer the better: an empty answer would be every prompt's best."""
    return [-score for score in answer_length(prompts, completions)]


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sample_prompts")
    (folder / "plain.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Tell me about island {i}."}) + "\n" for i in range(4))
    )
    (folder / "chat.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": f"Name {i} things."},
                    ]
                }
            )
            + "\n"
            for i in range(3)
        )
    )
    return [str(folder / "plain.jsonl"), str(folder / "chat.jsonl")]


def make(tmp_path, model, prompts, name, **kw) -> SampleConfig:
    cfg = SampleConfig(
        model=str(model),
        out=str(tmp_path / name),
        num_samples=4,
        max_new_tokens=6,
        seq_length=256,
        batch_size=3,
        keep_unfinished=True,
        reward_funcs=["test_sample_cmd:answer_length"],
    )
    cfg.data.train = list(prompts)
    for key, value in kw.items():
        setattr(cfg, key, value)
    assert cfg.problems() == []
    return cfg


def records(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def validates(path, kind: str) -> int:
    """The count of records `relay validate --kind` reads back from `path` without a problem."""
    parsed, problems = [], []
    for item in iter_parsed(read_entry(str(path)), kind):
        (problems if hasattr(item, "reason") else parsed).append(item)
    assert problems == [], problems
    assert cli.main(["validate", "--kind", {"rm": "dpo", "sft": "sft"}[kind], str(path)]) == 0
    return len(parsed)


def test_choosing_is_pure_and_respects_margin_and_threshold():
    assert best_and_worst(["a", "b", "c"], [0.5, 0.9, 0.1], 0.5) == (1, 2)
    assert best_and_worst(["a", "b", "c"], [0.5, 0.9, 0.1], 0.9) is None  # gap 0.8 under the margin
    assert best_and_worst(["a", "b"], [0.3, 0.3], 0.0) is None  # a tie is no preference
    assert best_and_worst(["same", "same"], [0.9, 0.1], 0.0) is None  # nor the same text twice
    assert best_of_n(["a", "b"], [0.2, 0.7], 0.5) == 1 and best_of_n(["a", "b"], [0.2, 0.4], 0.5) is None


def test_dpo_file_pairs_over_the_margin_validates_and_is_seeded(tmp_path, tiny_model_dir, prompt_files):
    counts = run(make(tmp_path, tiny_model_dir, prompt_files, "a.jsonl", mode="dpo", seed=3))
    rows = records(tmp_path / "a.jsonl")
    assert counts["prompts"] == 7 and counts["records"] == len(rows) > 0 and counts["records"] + counts["skipped"] == 7
    for r in rows:
        assert r["chosen_score"] == max(r["scores"]) > r["rejected_score"] == min(r["scores"]) and len(r["scores"]) == 4
        assert r["chosen"] != r["rejected"]
        assert isinstance(r["prompt"], str) == isinstance(r["chosen"], str)  # text prompts stay texts, chats messages
    assert {isinstance(r["prompt"], str) for r in rows} == {True, False}
    assert validates(tmp_path / "a.jsonl", "rm") == len(rows)

    gaps = sorted(r["chosen_score"] - r["rejected_score"] for r in rows)
    margin = gaps[len(gaps) // 2]  # the median gap: some pairs fall under it
    counts = run(make(tmp_path, tiny_model_dir, prompt_files, "m.jsonl", mode="dpo", seed=3, margin=margin))
    kept = records(tmp_path / "m.jsonl")
    assert kept == [r for r in rows if r["chosen_score"] - r["rejected_score"] >= margin] and 0 < len(kept) < len(rows)
    assert all(r["chosen_score"] >= r["rejected_score"] + margin for r in kept)
    assert counts["skipped"] == 7 - len(kept) and validates(tmp_path / "m.jsonl", "rm") == len(kept)

    run(make(tmp_path, tiny_model_dir, prompt_files, "b.jsonl", mode="dpo", seed=3))
    run(make(tmp_path, tiny_model_dir, prompt_files, "c.jsonl", mode="dpo", seed=4))
    same, other = (tmp_path / "b.jsonl").read_bytes(), (tmp_path / "c.jsonl").read_bytes()
    assert same == (tmp_path / "a.jsonl").read_bytes() and other != same


def test_sft_file_keeps_the_best_above_the_threshold(tmp_path, tiny_model_dir, prompt_files):
    run(make(tmp_path, tiny_model_dir, prompt_files, "all.jsonl", mode="sft", seed=1))
    best = sorted(r["score"] for r in records(tmp_path / "all.jsonl"))
    assert len(best) == 7 and all(r["score"] == max(r["scores"]) for r in records(tmp_path / "all.jsonl"))
    threshold = best[3]  # the median best: some prompts fall under it
    counts = run(make(tmp_path, tiny_model_dir, prompt_files, "kept.jsonl", mode="sft", seed=1, threshold=threshold))
    kept = records(tmp_path / "kept.jsonl")
    assert [r["score"] for r in kept] == [
        s for s in (r["score"] for r in records(tmp_path / "all.jsonl")) if s >= threshold
    ]
    assert all(r["score"] >= threshold for r in kept) and counts["skipped"] == 7 - len(kept) > 0
    assert validates(tmp_path / "kept.jsonl", "sft") == len(kept)
    # a random model never ends its answers within 6 tokens: without keep_unfinished nothing is kept, and said why
    counts = run(
        make(tmp_path, tiny_model_dir, prompt_files, "finished.jsonl", mode="sft", seed=1, keep_unfinished=False)
    )
    assert counts["records"] == 0 and counts["skipped"] == counts["too_few"] == 7
    assert all(r["scores"] == [None] * 4 for r in records(tmp_path / "finished.jsonl"))


def test_choosing_never_picks_an_empty_answer_nor_one_left_out():
    assert best_of_n(["", "a long one"], [0.0, -1.0], None) == 1  # "" scores best, and is no answer
    assert best_of_n([" \n", "a"], [0.0, -1.0], None) == 1 and best_of_n(["", " "], [1.0, 2.0], None) is None
    assert best_and_worst(["", "ab", "abc"], [5.0, 1.0, 0.5], 0.0) == (1, 2)
    assert best_and_worst(["abc", "ab", ""], [5.0, 1.0, 0.5], 0.0) == (0, 1)
    assert best_and_worst(["", "a"], [1.0, 0.0], 0.0) is None  # one usable answer is no pair
    assert best_of_n(["a", "b"], [None, 0.1], None) == 1 and best_and_worst(["a", "b", "c"], [9, None, 1], 0) == (0, 2)


N = 5
"""Answers per prompt in the tests below; `shaped_answers` gives each position its kind."""


def shaped_answers(monkeypatch, tokenizer_dir):
    """The sampler patched so that the first prompt's answers are all empty, and every other prompt's
    are, by position: finished, empty (the model ended at once), blank (whitespace, then the end),
    finished, unfinished (cut at max_new_tokens, as the tiny model's answers are)."""
    from transformers import AutoTokenizer

    from pipeline.tools import sample as sample_mod

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos, blank = tok.eos_token_id, tok(" \n ", add_special_tokens=False)["input_ids"]
    real = sample_mod.make_generator

    def make_generator(*args, **kwargs):
        generator = real(*args, **kwargs)
        sampled, calls = generator.generate, []

        def generate(prompts, **kw):
            out = []
            for row, ids in enumerate(sampled(prompts, **kw)):
                ids = [t for t in ids if t != eos][:4]
                position = 1 if not calls and row < N else row % N
                out.append([ids + [eos], [eos], blank + [eos], ids[:2] + [eos], ids][position])
            calls.append(len(prompts))
            return out

        generator.generate = generate
        return generator

    monkeypatch.setattr(sample_mod, "make_generator", make_generator)


@pytest.mark.parametrize("mode", ["sft", "dpo"])
def test_empty_answers_are_never_chosen_and_every_score_is_kept(
    tmp_path, tiny_model_dir, prompt_files, monkeypatch, mode
):
    shaped_answers(monkeypatch, tiny_model_dir)
    kind = {"sft": "sft", "dpo": "rm"}[mode]
    funcs = ["test_sample_cmd:short_answer"]  # an empty answer would win every SFT prompt and lose every pair
    for keep_unfinished in (False, True):
        name = f"{mode}_{keep_unfinished}.jsonl"
        counts = run(
            make(
                tmp_path,
                tiny_model_dir,
                prompt_files,
                name,
                mode=mode,
                num_samples=N,
                reward_funcs=funcs,
                keep_unfinished=keep_unfinished,
            )
        )
        rows = records(tmp_path / name)
        # the first prompt's answers are all empty: skipped and counted, never written
        assert counts["records"] == len(rows) == 6 and counts["skipped"] == counts["too_few"] == 1, counts
        for r in rows:
            assert len(r["scores"]) == N and r["scores"][1] is None and r["scores"][2] is None, r["scores"]
            assert (r["scores"][4] is None) != keep_unfinished
            assert all(isinstance(s, float) for i, s in enumerate(r["scores"]) if i in (0, 3)), r["scores"]
            best = max(s for s in r["scores"] if s is not None)
            if mode == "sft":
                assert r["messages"][-1]["content"].strip() and r["score"] == best
            else:
                answer = lambda side: side if isinstance(side, str) else side[-1]["content"]  # noqa: E731
                assert answer(r["chosen"]).strip() and answer(r["rejected"]).strip()
                assert r["chosen_score"] == best and r["rejected_score"] == min(s for s in r["scores"] if s is not None)
        assert validates(tmp_path / name, kind) == len(rows)


def test_relay_sample_reports_prompts_with_too_few_usable_answers(
    tmp_path, tiny_model_dir, prompt_files, monkeypatch, capsys
):
    shaped_answers(monkeypatch, tiny_model_dir)
    code = cli.main(
        [
            "sample",
            "--model",
            str(tiny_model_dir),
            "--data.train",
            f"[{prompt_files[0]}]",
            "--out",
            str(tmp_path / "s.jsonl"),
            "--mode",
            "sft",
            "--num_samples",
            str(N),
            "--max_new_tokens",
            "6",
            "--seq_length",
            "256",
            "--reward_funcs",
            "[test_sample_cmd:short_answer]",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and len(records(tmp_path / "s.jsonl")) == 3, out
    assert "1 with too few usable answers (left out: empty ones and ones cut at max_new_tokens)" in out, out


def test_dpo_prompts_render_as_the_answers_were_sampled(tmp_path, tiny_model_dir, prompt_files):
    """With data.system_prompt, the DPO stage's prompt ids of every pair are the ids the sampler used."""
    from data_formats.datasets import build_preference_data
    from data_formats.prompt_data import build_prompt_data
    from data_formats.render import make_template
    from pipeline.config import PreferenceDataConfig
    from pipeline.modeling.models import load_tokenizer

    tools = tmp_path / "tools.jsonl"
    tool = {"name": "lookup", "description": "Look a place up.", "parameters": {"type": "object", "properties": {}}}
    tools.write_text(json.dumps({"messages": [{"role": "user", "content": "Find island 9."}], "tools": [tool]}) + "\n")
    for system in ("SYS P", None):
        cfg = make(tmp_path, tiny_model_dir, [*prompt_files, str(tools)], "sys.jsonl", mode="dpo", seed=3)
        cfg.data.system_prompt = system
        counts = run(cfg)
        rows = records(tmp_path / "sys.jsonl")
        tok = load_tokenizer(str(tiny_model_dir))
        limit = min(cfg.data.max_prompt_length, cfg.seq_length - cfg.max_new_tokens)  # as `run` renders them
        sampled = build_prompt_data(cfg.data, tok, make_template(cfg.data, tok), "train", limit)
        dpo_data = PreferenceDataConfig(train=[str(tmp_path / "sys.jsonl")])  # the DPO stage's data, no system_prompt
        pairs = build_preference_data(dpo_data, tok, make_template(dpo_data, tok), cfg.seq_length, "train")
        prompt_ids = {tuple(s["prompt_ids"]) for s in sampled}
        built = [tuple(p["chosen_input_ids"][: -p["chosen_answer_len"]]) for p in pairs]
        assert counts["records"] == len(rows) == len(built) >= 6 and len(set(built)) == len(built)
        assert all(ids in prompt_ids for ids in built), [tok.decode(ids) for ids in built if ids not in prompt_ids]
        assert validates(tmp_path / "sys.jsonl", "rm") == len(rows)
        if system is not None:
            # the plain prompts (and the tool one) were sampled under it; the chats under their own
            assert all(r["prompt"][0]["role"] == "system" for r in rows)
            assert sum(r["prompt"][0]["content"] == system for r in rows) == len(rows) - 3
        else:
            assert {isinstance(r["prompt"], str) for r in rows} == {True, False}
        assert any(r.get("tools") == [tool] for r in rows)


def test_relay_sample_refuses_a_bad_config_in_lines_before_loading(tmp_path, capsys):
    code = cli.main(
        [
            "sample",
            "--model",
            str(tmp_path / "no_such_model"),
            "--out",
            str(tmp_path / "x.jsonl"),
            "--mode",
            "rank",
            "--margin",
            "-1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    for part in ("mode: 'rank'", "margin: must be >= 0", "data.train: no prompt files", "nothing scores the answers"):
        assert part in err, err


def test_a_judge_scores_the_samples(tmp_path, tiny_model_dir, prompt_files):
    from judgestub import SERVED, Stub, default_reply

    from pipeline.algorithms.judge_config import JudgeConfig

    stub = Stub()
    try:
        cfg = make(
            tmp_path,
            tiny_model_dir,
            prompt_files[:1],
            "judged.jsonl",
            mode="sft",
            reward_funcs=[],
            judge=JudgeConfig(base_url=stub.url, model=SERVED, max_concurrency=2, retry_backoff=0.0),
        )
        counts = run(cfg)
        asked = len(stub.bodies)
        again = run(cfg)  # the rerun's replies come from the cache beside the file
    finally:
        stub.server.shutdown()
        stub.server.server_close()
    rows = records(tmp_path / "judged.jsonl")
    assert len(rows) == 4 and counts["requests"] == len(stub.bodies) <= 16 and counts["failures"] == 0
    for r in rows:
        assert r["score"] == int(default_reply(r["messages"][-1]["content"])) / 10 == max(r["scores"])
    assert again["requests"] == 0 and len(stub.bodies) == asked and again["cache_hits"] == 16
    assert (tmp_path / "judge_cache" / "judged.jsonl").is_file()


def test_relay_sample_names_a_missing_model_and_prompt_file(tmp_path, capsys):
    code = cli.main(
        [
            "sample",
            "--model",
            str(tmp_path / "no_such_model"),
            "--out",
            str(tmp_path / "x.jsonl"),
            "--data.train",
            f"[{tmp_path / 'none.jsonl'}]",
            "--reward_funcs",
            "[test_sample_cmd:answer_length]",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not (tmp_path / "x.jsonl").exists()
    assert "no_such_model" in err and "none.jsonl" in err, err
