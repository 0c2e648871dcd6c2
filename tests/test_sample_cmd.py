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
    assert counts["records"] == 0 and counts["skipped"] == counts["unfinished"] == 7


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
