"""relay eval and the pipeline's retention table (pipeline/tools/evaluate.py).

The outside reference is the harness's own command: `lm_eval --model hf ... --include_path` in its own
process on the same tiny model folder and the shipped tasks gives exactly Relay's scores; two Relay
runs give identical numbers; a task that would download is refused in one line before the harness loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from forkserver import python_for_tests

from pipeline.tools import evaluate
from pipeline.tools.chain_config import GoldConfig
from pipeline.tools.eval_tasks import task_problems
from pipeline.tools.evaluate import BenchmarkConfig, evaluate_models, retention_table
from pipeline.tools.report import render_markdown

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "data" / "general" / "tasks"
SETTINGS = BenchmarkConfig(tasks=list(evaluate.DEFAULT_TASKS), include_path=[str(TASKS)], batch_size=32)


@pytest.fixture(scope="module")
def harness_cli(tiny_model_dir, tmp_path_factory):
    """The plain harness command on the tiny model, started at once in its own process (it indexes the
    harness's whole task collection first, which takes longest); its results file when it ends."""
    out = tmp_path_factory.mktemp("lm_eval_cli")
    command = [
        *(python_for_tests(), "-m", "lm_eval", "--model", "hf"),
        *("--model_args", f"pretrained={tiny_model_dir},dtype=float32"),
        *("--tasks", ",".join(evaluate.DEFAULT_TASKS), "--include_path", str(TASKS)),
        *("--batch_size", "32", "--device", "cpu", "--output_path", str(out)),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def result() -> dict:
        log, _ = process.communicate(timeout=600)
        assert process.returncode == 0, log[-3000:]
        (path,) = out.rglob("results_*.json")
        return json.loads(path.read_text(encoding="utf-8"))

    yield result
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def relay_table(tiny_model_dir, harness_cli, tmp_path_factory):
    """Relay's scores of the tiny model twice in one process (the second run without the cache), then
    once more from the cache file the first wrote."""
    cache = tmp_path_factory.mktemp("bench") / "cache.json"
    first = evaluate_models([("base", str(tiny_model_dir))], SETTINGS, cache)
    second = evaluate_models([("again", str(tiny_model_dir))], SETTINGS)
    cached = evaluate_models([("base", str(tiny_model_dir))], SETTINGS, cache)
    return first, second, cached


def test_scores_equal_the_plain_lm_eval_command(relay_table, harness_cli):
    first, _, _ = relay_table
    cli = evaluate.scores_of(harness_cli()["results"])
    relay = first["rows"][0]["scores"]
    assert set(relay) == set(evaluate.DEFAULT_TASKS)
    assert relay == cli  # every metric of both tasks, bit for bit
    assert set(relay["relay_general_mc"]) == {"acc", "acc_norm"}
    assert set(relay["relay_general_text"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert first["columns"] == [["relay_general_mc", "acc"], ["relay_general_text", "word_perplexity"]]
    assert first["rows"][0]["n"] == {"relay_general_mc": 48, "relay_general_text": 8}


def test_two_runs_give_identical_numbers_and_the_cache_returns_them(relay_table):
    first, second, cached = relay_table
    assert first["rows"][0]["cached"] is False and second["rows"][0]["cached"] is False
    assert first["rows"][0]["scores"] == second["rows"][0]["scores"]
    assert cached["rows"][0]["cached"] is True
    assert cached["rows"][0]["scores"] == first["rows"][0]["scores"]


def _task(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(f"task: {name}\noutput_type: multiple_choice\n{body}", encoding="utf-8")
    return folder


def test_a_task_that_would_download_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "tasks"
    _task(folder, "hub", "dataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\n")
    _task(folder, "url", "dataset_path: json\ndataset_kwargs:\n  data_files: {test: 'https://example.org/t.jsonl'}\n")
    _task(folder, "gone", "dataset_path: json\ndataset_kwargs:\n  data_files: {test: missing.jsonl}\n")
    (tmp_path / "here.jsonl").write_text('{"q": 1}\n', encoding="utf-8")
    _task(folder, "local", "dataset_path: json\ndataset_kwargs:\n  data_files: {test: here.jsonl}\n")
    _task(folder, "absolute", f"dataset_path: json\ndataset_kwargs:\n  data_files: {tmp_path / 'here.jsonl'}\n")
    (folder / "group.yaml").write_text("group: mine\ntask: [local, hub]\n", encoding="utf-8")
    problems = task_problems(["hub", "url", "gone", "local", "absolute", "hellaswag", "mine"], [folder])
    assert len(problems) == 5
    hub, url, gone, builtin, member = problems
    assert "'hub'" in hub and "would download dataset_path 'allenai/ai2_arc' from the Hub" in hub
    assert "over the network" in url and "'missing.jsonl' does not exist" in gone
    assert "'hellaswag' is not in" in builtin and "--include_path" in builtin
    assert member == hub  # a group's member is checked as itself
    assert all("\n" not in p for p in problems)
    # the command: one `error:` line per task, exit 2, no model or harness loaded
    code = evaluate.main(["embedded", "--tasks", "hub,local", "--include_path", str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: task 'hub'")
    # and a pipeline config says it before any stage runs
    gold = GoldConfig(benchmarks=BenchmarkConfig(tasks=["hellaswag"], include_path=[str(folder)]))
    assert [p for p in gold.problems() if p.startswith("gold.benchmarks: task 'hellaswag'")]


def test_the_commands_settings_are_named_as_given_and_checked_before_any_scoring(tmp_path, capsys):
    """`relay eval --limit 0` names its own option (not the pipeline's config keys); a --json file
    that cannot be written is found before the models are scored, not after."""
    code = evaluate.main(["embedded", "--limit", "0", "--batch_size", "-1", "--json", str(tmp_path / "no/x.json")])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --batch_size: must be >= 1, got -1",
        "error: --limit: must be >= 1, got 0",
        f"error: --json: {tmp_path / 'no/x.json'} is a folder, or in a folder that does not exist",
    ]
    assert evaluate.main(["embedded", "--json", str(tmp_path)]) == 2
    said = capsys.readouterr().err.strip()
    assert said == f"error: --json: {tmp_path} is a folder, or in a folder that does not exist"
    gold = GoldConfig(benchmarks=BenchmarkConfig(tasks=list(evaluate.DEFAULT_TASKS), limit=0))
    assert "gold.benchmarks.limit: must be >= 1, got 0" in gold.problems()


def test_the_shipped_tasks_are_local_and_the_default_config_scores_nothing():
    assert task_problems(list(evaluate.DEFAULT_TASKS), [TASKS]) == []
    assert BenchmarkConfig().problems() == []  # no tasks: nothing to check, nothing run
    assert GoldConfig(benchmarks=BenchmarkConfig(tasks=["relay_general_mc"], models=["base", "rm"])).problems() == [
        "gold.benchmarks.models: 'rm' not among base, pt, sft, ppo"
    ]


TABLE = {
    "tasks": ["mc", "text"],
    "include_path": ["data/general/tasks"],
    "columns": [["mc", "acc"], ["text", "word_perplexity"]],
    "rows": [
        {"model": "base", "scores": {"mc": {"acc": 0.5}, "text": {"word_perplexity": 40.0}}},
        {
            "model": "pt",
            "scores": {"mc": {"acc": 0.375}, "text": {"word_perplexity": 55.5}},
            "higher_is_better": {"mc": {"acc": True}, "text": {"word_perplexity": False}},
        },
        {"model": "sft", "scores": {"mc": {"acc": 0.625}, "text": {"word_perplexity": 31.25}}},
    ],
}


def test_retention_table_marks_losses_against_base():
    assert retention_table(TABLE).splitlines() == [
        "| model | mc acc ↑ | text word_perplexity ↓ |",
        "|---|---|---|",
        "| base | 0.500 | 40.00 |",
        "| pt | 0.375 (**-0.125**) | 55.50 (**+15.50**) |",
        "| sft | 0.625 (+0.125) | 31.25 (-8.75) |",
    ]
    report = render_markdown(Path("out"), {}, {}, {"verdict": "PASS", "benchmarks": TABLE})
    assert "## Retention (lm-evaluation-harness)" in report and "| pt | 0.375 (**-0.125**) |" in report


def test_the_general_data_regenerates_byte_identical(tmp_path):
    spec = importlib.util.spec_from_file_location("make_general", REPO / "data" / "general" / "make_general.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path)]) == 0
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.jsonl"))
    assert [str(p) for p in made] == ["tasks/general_mc.jsonl", "tasks/general_text.jsonl", "train.jsonl"]
    for path in made:
        assert (tmp_path / path).read_bytes() == (REPO / "data" / "general" / path).read_bytes(), path


def test_the_pipeline_summary_prints_the_retention_table():
    from pipeline.tools.driver import format_summary

    summary = {"stages": {}, "final_model": None, "tensorboard": "t", "verdict": "PASS", "verdict_reasons": []}
    text = format_summary({**summary, "benchmarks": {**TABLE, "wall_seconds": 12.5}, "benchmarks_wall_seconds": 12.5})
    assert "retention (lm-evaluation-harness, change against base; 12 s):" in text
    assert "| pt | 0.375 (**-0.125**) | 55.50 (**+15.50**) |" in text


def test_the_pipeline_scores_base_and_every_generator_stage_that_ran(tmp_path, tiny_model_dir):
    from pipeline.tools.chain_config import PipelineConfig
    from pipeline.tools.driver import benchmark_models, compute_benchmarks

    cfg = PipelineConfig(output_root=str(tmp_path), base_model=str(tiny_model_dir))
    for stage in ("pt", "rm", "ppo"):  # sft ran but left no merged model; rm is no generator
        (tmp_path / stage / "merged").mkdir(parents=True)
        (tmp_path / stage / "merged" / "manifest.json").write_text("{}", encoding="utf-8")
    rows = benchmark_models(cfg, ["pt", "sft", "rm", "ppo"])
    assert [name for name, _ in rows] == ["base", "pt", "ppo"]
    assert rows[0][1] == str(Path(tiny_model_dir).resolve())
    cfg.gold.benchmarks.models = ["base", "ppo"]
    assert [name for name, _ in benchmark_models(cfg, ["pt", "ppo"])] == ["base", "ppo"]
    assert compute_benchmarks(PipelineConfig(output_root=str(tmp_path)), ["pt"]) is None  # no tasks: nothing scored
