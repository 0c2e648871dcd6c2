"""A harness task with two filters (a strict and a lenient answer extraction, as gsm8k's
strict-match and flexible-extract): `relay eval` (pipeline/tools/evaluate.py) keeps one score per
filter, each equal to the harness's own `results[task]["metric,filter"]` from its Python API, whatever
order the YAML lists the filters in; a task with one filter keeps the metric's plain name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.tools.eval_tasks import headline_columns, metric_label, task_index
from pipeline.tools.evaluate import BenchmarkConfig, evaluate_models, retention_table, scores_of

ANSWERS = ["7", "7", "7", "3"]
STRICT = {
    "name": "strict-match",
    "filter": [{"function": "regex", "regex_pattern": r"^(\d+)$"}, {"function": "take_first"}],
}
SEVEN = {"name": "always-seven", "filter": [{"function": "map", "default_value": "7"}, {"function": "take_first"}]}
"""Every answer becomes "7": exact_match 3 / 4 = 0.75 under this filter whatever the model says."""


def write_task(folder: Path, data: Path, filters: list[dict]) -> Path:
    folder.mkdir(parents=True)
    task = {
        "task": "two_filters",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "output_type": "generate_until",
        "test_split": "test",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": 4},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "filter_list": filters,
    }
    (folder / "two_filters.yaml").write_text(json.dumps(task), encoding="utf-8")  # JSON is YAML
    return folder


@pytest.fixture(autouse=True)
def environment_kept():
    """The harness runs in this process, and importing it sets variables (HF_XET_HIGH_PERFORMANCE):
    left set, every later child of this pytest worker would differ from its fork server's import-time
    environment and run on a fresh interpreter (tests/forkserver.py)."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(scope="module")
def task_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("filters")
    data = root / "sums.jsonl"
    rows = [{"question": f"What is {i} + {int(a) - i}?", "answer": a} for i, a in enumerate(ANSWERS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return write_task(root / "tasks", data, [STRICT, SEVEN]), write_task(root / "swapped", data, [SEVEN, STRICT])


def harness_results(model: Path, tasks: Path) -> dict:
    """The harness's own results dict through its Python API, as its command runs it."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(model), "dtype": "float32"},
        tasks=["two_filters"],
        device="cpu",
        batch_size=4,
        bootstrap_iters=0,
        task_manager=TaskManager(include_path=[str(tasks)], include_defaults=False),
    )
    return out["results"]["two_filters"]


def test_each_filter_keeps_its_own_score_equal_to_the_harness(tiny_model_dir, task_folders):
    tasks, swapped = task_folders
    theirs = harness_results(tiny_model_dir, tasks)
    assert theirs["exact_match,always-seven"] == 0.75  # by hand: 3 of the 4 answers are "7"
    for folder in (tasks, swapped):
        table = evaluate_models(
            [("base", str(tiny_model_dir))], BenchmarkConfig(tasks=["two_filters"], include_path=[str(folder)])
        )
        (row,) = table["rows"]
        assert row["scores"] == {
            "two_filters": {
                "exact_match,strict-match": theirs["exact_match,strict-match"],
                "exact_match,always-seven": theirs["exact_match,always-seven"],
            }
        }
        names = ["strict-match", "always-seven"] if folder == tasks else ["always-seven", "strict-match"]
        assert table["columns"] == [["two_filters", f"exact_match,{name}"] for name in names]
        header = retention_table(table).splitlines()[0]
        assert header == "| model | " + " | ".join(f"two_filters exact_match ({name}) ↑" for name in names) + " |"


def test_one_filter_keeps_the_plain_metric_name():
    results = {
        "mc": {"alias": "mc", "acc,none": 0.5, "acc_stderr,none": "N/A", "acc_norm,none": 0.25},
        "gen": {
            "exact_match,strict-match": 0.0,
            "exact_match,flexible-extract": 0.1667,
            "exact_match_stderr,strict-match": 0.1,
        },
        "one": {"exact_match,get-answer": 0.4},
    }
    assert scores_of(results) == {
        "mc": {"acc": 0.5, "acc_norm": 0.25},
        "gen": {"exact_match,strict-match": 0.0, "exact_match,flexible-extract": 0.1667},
        "one": {"exact_match": 0.4},
    }
    assert metric_label("exact_match,strict-match") == "exact_match (strict-match)" and metric_label("acc") == "acc"
    index = task_index([Path(__file__).resolve().parents[1] / "data" / "general" / "tasks"])
    assert headline_columns(index["relay_general_mc"]) == ["acc"]
