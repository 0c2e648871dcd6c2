"""Weighted source mixing (data.weights, data.mix_stop) and the one line that says why a source
yields nothing."""

import json
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config


def chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sft_cfg(model, train: list[Path], out: Path, *extra: str):
    from stages.sft import SFTConfig

    argv = [
        "--model.path",
        str(model),
        "--data.train",
        "[" + ",".join(map(str, train)) + "]",
        "--output_dir",
        str(out),
        "--train.seq_length",
        "48",
        "--train.batch_size",
        "2",
        "--train.grad_accum",
        "1",
        "--train.learning_rate",
        "5e-3",
        "--train.warmup",
        "1",
        "--train.log_steps",
        "1",
        "--train.eval_steps",
        "0",
        "--checkpoint.save_interval",
        "1000h",
        "--data.eval",
        "[]",
        *extra,
    ]
    return load_config(SFTConfig, argv)


def fill_line(cfg, marker: str = "cannot fill") -> str:
    """The line holding `marker` of the problems validation reports."""
    from stages.sft import SFTStage

    with pytest.raises(ConfigError) as err:
        SFTStage(cfg).validate()
    return next(line for line in err.value.problems if marker in line)


# ------------------------------------------------------------------------------------------
# Why a split yields nothing, in the one line
# ------------------------------------------------------------------------------------------


def test_a_split_of_only_overlong_records_says_why_in_the_one_line(tiny_model_dir, tmp_path):
    long = write_jsonl(tmp_path / "long.jsonl", [chat("tell me " * 40, f"answer {i} " * 20) for i in range(3)])
    line = fill_line(sft_cfg(tiny_model_dir, [long], tmp_path / "o"))
    assert line.startswith(
        "data.train: 0 sample(s) cannot fill one micro-batch of 2 x 1 rank(s): 3 dropped as longer "
        "than train.seq_length 48 (the longest "
    )
    longest = int(line.split("(the longest ")[1].split()[0])
    assert line.endswith(f"; train.seq_length: {longest} keeps them, data.truncation: truncate shortens them to fit")


def test_the_line_names_each_source_when_several_drop(tiny_model_dir, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat("tell me " * 40, "x")])
    b = write_jsonl(tmp_path / "b.jsonl", [chat("say " * 60, "y"), chat("say " * 30, "z")])
    line = fill_line(sft_cfg(tiny_model_dir, [a, b], tmp_path / "o"))
    assert f"{a}: 1 dropped as longer than train.seq_length 48" in line
    assert f"{b}: 2 dropped as longer than train.seq_length 48" in line


# ------------------------------------------------------------------------------------------
# The weighted mix
# ------------------------------------------------------------------------------------------


def three_sources(sizes=(1000, 1000, 1000), stop="all_exhausted", seed=7):
    from data_formats.sampling import SourceMix

    owners = [k for k, n in enumerate(sizes) for _ in range(n)]
    return SourceMix(["general", "domain", "code"], [0.6, 0.3, 0.1], stop, seed, owners)


def test_three_sources_weighted_6_3_1_are_drawn_within_two_percent_over_5000_draws():
    from data_formats.sampling import DataCursor, next_micro_batches

    mix, cursor, drawn = three_sources(), DataCursor(), []
    while len(drawn) < 5000:  # 500 steps of 10, across epochs (the 0.1 source needs ~10,000 draws to run out)
        groups, cursor = next_micro_batches(
            3000, cursor, seed=7, batch_size=5, grad_accum=1, world_size=2, rank=0, order_of=mix.epoch_order
        )
        other, _ = next_micro_batches(
            3000,
            DataCursor(cursor.epoch, cursor.samples - 10),
            seed=7,
            batch_size=5,
            grad_accum=1,
            world_size=2,
            rank=1,
            order_of=mix.epoch_order,
        )
        drawn += groups[0] + other[0]
    fractions = [sum(mix.entry_of[i] == k for i in drawn) / len(drawn) for k in range(3)]
    assert all(abs(got - want) <= 0.02 for got, want in zip(fractions, (0.6, 0.3, 0.1))), fractions
    assert len(set(drawn)) < len(drawn)  # across the 'all_exhausted' restarts, the big sources repeat


def test_first_exhausted_ends_the_epoch_with_the_last_sample_of_one_source_and_repeats_none():
    mix = three_sources((50, 200, 400), "first_exhausted")
    for epoch in range(3):
        order = mix.epoch_order(epoch)
        assert len(set(order)) == len(order)
        counts = [sum(mix.entry_of[i] == k for i in order) for k in range(3)]
        finished = [k for k in range(3) if counts[k] == mix.sizes[k]]
        assert len(finished) == 1 and mix.entry_of[order[-1]] == finished[0]
    assert mix.epoch_order(0) != mix.epoch_order(1)


def test_all_exhausted_ends_once_every_source_gave_all_and_oversamples_the_rest():
    mix = three_sources((50, 30, 10), "all_exhausted")
    order = mix.epoch_order(0)
    assert set(order) == set(range(90))  # every sample of every source
    last = mix.entry_of[order[-1]]
    assert sum(mix.entry_of[i] == last for i in order) == mix.sizes[last]  # the epoch ends on a first pass
    assert len(order) > 90  # the others started over


def test_a_number_of_samples_fixes_each_epochs_length():
    mix = three_sources((5, 5, 5), 37)
    assert [len(mix.epoch_order(e)) for e in range(3)] == [37, 37, 37]
    assert len(set(mix.epoch_order(0))) == 15


def test_the_mix_is_a_pure_function_of_the_seed():
    assert (
        three_sources(seed=1).epoch_order(2)
        == three_sources(seed=1).epoch_order(2)
        != three_sources(seed=2).epoch_order(2)
    )


def test_weights_that_do_not_match_the_entries_are_config_problems(tiny_model_dir, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat("q", "a")] * 4)
    with pytest.raises(ConfigError) as err:
        sft_cfg(tiny_model_dir, [a], tmp_path / "o", "--data.weights", "[0.5, 0.5]", "--data.mix_stop", "sometimes")
    assert (
        "data.weights: 2 weight(s) for 1 data.train entr(ies); give one per entry, in their order" in err.value.problems
    )
    assert any(
        p.startswith("data.mix_stop: must be first_exhausted, all_exhausted or a number") for p in err.value.problems
    )
    with pytest.raises(ConfigError) as err:
        sft_cfg(tiny_model_dir, [a], tmp_path / "o", "--data.weights", "[0]")
    assert err.value.problems == ["data.weights: every weight must be > 0 (leave an entry out instead), got [0.0]"]
    assert (
        sft_cfg(tiny_model_dir, [a], tmp_path / "o", "--data.weights", "[1]", "--data.mix_stop", "5000").data.mix_stop
        == 5000
    )


def test_a_weighted_source_that_yields_nothing_is_named_in_the_one_line(tiny_model_dir, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat(f"q {i}", "a") for i in range(6)])
    b = write_jsonl(tmp_path / "b.jsonl", [chat("tell me " * 40, "x")] * 2)
    line = fill_line(sft_cfg(tiny_model_dir, [a, b], tmp_path / "o", "--data.weights", "[0.7, 0.3]"), "yields 0")
    assert line.startswith(
        f"data.weights: {b} (weight 0.3) yields 0 sample(s): 2 dropped as longer than train.seq_length 48"
    )


def write_sources(folder: Path) -> list[Path]:
    return [
        write_jsonl(folder / f"{name}.jsonl", [chat(f"{name} question {i}", f"{name} answer {i}") for i in range(n)])
        for name, n in (("general", 12), ("domain", 8), ("code", 6))
    ]


def test_a_weighted_sft_run_resumes_mid_epoch_with_the_same_later_batches(tiny_model_dir, tmp_path, monkeypatch):
    from stagerun import recording, run_stage

    from stages.sft import SFTStage

    sources = write_sources(tmp_path / "data")
    # epochs of 10 samples, steps of 2 x 2: the cut at step 3 (12 samples) is 2 samples into epoch 1
    extra = (
        "--data.weights",
        "[0.6, 0.3, 0.1]",
        "--data.mix_stop",
        "10",
        "--train.max_steps",
        "6",
        "--train.grad_accum",
        "2",
        "--lora.dropout",
        "0.1",
    )
    full = run_stage(recording(SFTStage), sft_cfg(tiny_model_dir, sources, tmp_path / "full", *extra))
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "3")
    first = run_stage(recording(SFTStage), sft_cfg(tiny_model_dir, sources, tmp_path / "cut", *extra))
    assert first.step == 3 and (first.cursor.epoch, first.cursor.samples) == (1, 2)
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    second = run_stage(recording(SFTStage), sft_cfg(tiny_model_dir, sources, tmp_path / "cut", *extra))
    assert second.batch_ids == full.batch_ids[3:]
    for want, got in zip(full.history.steps[3:], second.history.steps[3:]):
        assert got == {**want, "train/tokens_per_s": got["train/tokens_per_s"]}
    assert full.cursor.epoch == 2
    # per-source figures: every step's global batch (2 x 2 samples) is split over the entries
    for record in full.history.steps:
        assert sum(record[f"data/samples/{s}"] for s in ("general", "domain", "code")) == 4
        assert sum(record[f"data/tokens/{s}"] for s in ("general", "domain", "code")) > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "full" / "runs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    logged = [e.value for e in events.Scalars("data/samples/general")]
    assert logged == [record["data/samples/general"] for record in full.history.steps]
    assert "data/tokens/code" in events.Tags()["scalars"]
    manifest = json.loads((tmp_path / "cut" / "merged" / "manifest.json").read_text())
    assert manifest["data_mix"] == {
        "sources": [
            {"entry": str(s), "weight": pytest.approx(w), "samples": n}
            for s, w, n in zip(sources, (0.6, 0.3, 0.1), (12, 8, 6))
        ],
        "stop": 10,
        "seed": 42,
    }


# ------------------------------------------------------------------------------------------
# PT: packed rows of one entry each, in memory and streamed
# ------------------------------------------------------------------------------------------


def write_corpora(folder: Path) -> list[Path]:
    return [
        write_jsonl(folder / f"{name}.jsonl", [{"text": f"{word} " * (5 + i % 7)} for i in range(n)])
        for name, word, n in (("general", "apple", 40), ("domain", "zebra", 30))
    ]


def entry_of_row(tokenizer, row: dict) -> int:
    """0 for a row of 'apple' text, 1 for 'zebra' (a row may cut a word: told apart by its letters)."""
    letters = set(tokenizer.decode(row["input_ids"]).replace(tokenizer.eos_token, ""))
    assert not ({"p", "l"} & letters and {"z", "b", "r"} & letters), letters
    return 1 if {"z", "b", "r"} & letters else 0


def pt_cfg(model, train: list[Path], out: Path, *extra: str):
    from stages.pretrain import PTConfig

    argv = [
        "--model.path",
        str(model),
        "--data.train",
        "[" + ",".join(map(str, train)) + "]",
        "--output_dir",
        str(out),
        "--train.seq_length",
        "16",
        "--train.batch_size",
        "2",
        "--data.weights",
        "[0.75, 0.25]",
        *extra,
    ]
    return load_config(PTConfig, argv)


def test_weighted_pt_rows_are_packed_per_entry(tiny_model_dir, tmp_path):
    from stages.pretrain import PTStage

    corpora = write_corpora(tmp_path / "data")
    stage = PTStage(pt_cfg(tiny_model_dir, corpora, tmp_path / "o"))
    stage.validate()
    assert stage.mix is not None and all(stage.mix.sizes)
    for row, k in zip(stage.train_samples, stage.mix.entry_of):
        assert entry_of_row(stage.tokenizer, row) == k


def test_a_weighted_stream_draws_by_weight_and_resumes_exactly(tiny_model_dir, tmp_path):
    from data_formats.streaming import open_stream
    from pipeline.modeling.models import load_tokenizer

    corpora = write_corpora(tmp_path / "data")
    data = pt_cfg(tiny_model_dir, corpora, tmp_path / "o", "--data.streaming", "true").data
    tokenizer = load_tokenizer(str(tiny_model_dir), False, None)
    stream = open_stream(data, tokenizer, 16, seed=3)
    rows = [stream.next_row() for _ in range(60)]
    again = open_stream(data, tokenizer, 16, seed=3)
    for i in range(25):
        again.next_row()
    saved = json.loads(json.dumps(again.state_dict()))
    resumed = open_stream(data, tokenizer, 16, seed=3)
    resumed.load_state_dict(saved)
    assert [resumed.next_row() for _ in range(35)] == rows[25:]
    sources = [stream.source_of(i) for i in range(2000)]
    assert abs(sources.count(0) / 2000 - 0.75) <= 0.02
    assert [entry_of_row(tokenizer, row) for row in rows] == sources[:60]
    # the manifest's data_mix, as an in-memory mix writes it (a weighted stream wrote none)
    mix = stream.describe()
    assert [s["entry"] for s in mix["sources"]] == list(data.train) and mix["seed"] == 3
    assert [s["weight"] for s in mix["sources"]] == [float(w) for w in data.weights]
    assert [s["rows_drawn"] for s in mix["sources"]] == [sources[:60].count(k) for k in range(len(data.train))]
    from stages.pretrain import PTStage

    holder = PTStage.__new__(PTStage)
    holder.stream = stream
    assert holder.manifest_extras() == {"data_mix": mix}
    plain = pt_cfg(tiny_model_dir, corpora, tmp_path / "o2", "--data.streaming", "true").data
    plain.weights = None
    holder.stream = open_stream(plain, tokenizer, 16, seed=3)
    assert holder.manifest_extras() == {}  # one unweighted stream: no mix to record


def test_a_number_of_samples_trains_every_draw_of_every_epoch_for_any_split():
    """mix_stop 20 with a global micro-batch of 8: every epoch's 20 draws train, the third
    micro-batch finishing epoch 0 with epoch 1's first draws, for any split of the batch and
    across a checkpoint's cursor (before, draws 16-19 of each epoch were left out unsaid)."""
    from data_formats.sampling import DataCursor, legacy_cursor, next_micro_batches

    mix = three_sources((5, 5, 5), 20)
    stream = mix.epoch_order(0) + mix.epoch_order(1) + mix.epoch_order(2)

    def trained(plan):
        cursor, out = DataCursor(), []
        for batch, accum, world, steps in plan:
            cursor = legacy_cursor(json.loads(json.dumps(cursor.__dict__)), batch * world)
            for _ in range(steps):
                out.append([])
                for rank in range(world):
                    groups, after = next_micro_batches(
                        15,
                        cursor,
                        seed=7,
                        batch_size=batch,
                        grad_accum=accum,
                        world_size=world,
                        rank=rank,
                        order_of=mix.epoch_order,
                    )
                    out[-1] += [i for g in groups for i in g]
                cursor = after
        return out, cursor

    steps, cursor = trained([(8, 1, 1, 5)])
    assert sum(steps, []) == stream[:40] and cursor == DataCursor(1, 20)
    assert steps[2] == mix.epoch_order(0)[16:] + mix.epoch_order(1)[:4]
    split, cursor = trained([(4, 1, 2, 2), (2, 2, 2, 1), (1, 2, 4, 2)])
    assert sorted(sum(split, [])) == sorted(stream[:40]) and cursor == DataCursor(1, 20)
    assert [sorted(s) for s in split] == [sorted(s) for s in steps]
