"""Benchmark scores through lm-evaluation-harness (the `lm-eval` package), over local files only.

    relay eval MODEL [MODEL ...] [--tasks T1,T2] [--include_path DIR ...] [--batch_size N] [--limit N] [--json F]

Each MODEL (a model folder, a stage's output folder holding merged/, or 'embedded') is scored by the
harness itself: `lm_eval.simple_evaluate(model="hf", model_args={pretrained: FOLDER, dtype: ...})`
with a task manager over the include paths, which is what the plain command

    lm_eval --model hf --model_args pretrained=FOLDER,dtype=float32 --tasks T --include_path DIR --batch_size N

computes (tests/test_eval.py runs both). Several models print a retention table: one row per model,
one column per task's first metric, the change against the first model (the base) beside each score,
in bold where it is a loss. A task with several filters (a strict and a flexible answer extraction)
has a score per filter, each its own column named with its filter (`exact_match (strict-match)`);
with one filter the column is the metric alone. The pipeline scores every generator stage's merged model the same way
(`gold.benchmarks` in a pipeline config) and `relay report` shows that table.

Tasks are the harness's own YAML task format. Relay ships `data/general/tasks/` (made here:
data/general/make_general.py): `relay_general_mc`, everyday multiple-choice questions, and
`relay_general_text`, the perplexity on held-out general prose. Any folder of task YAMLs a user
points at with --include_path is read the same way. Nothing downloads: before the harness is
imported, every task's data source is read from its YAML (`task_problems`) and a task whose data
would come from the Hub (a `dataset_path` that is neither a packaged builder over local
`data_files` nor a local folder, nor a `custom_dataset` function) is refused in one line. The
harness's own task collection is not indexed (it reads Hub datasets, and indexing it costs tens of
seconds), so its task names are refused the same way.

This module imports neither torch nor the harness at its top (the pipeline's config checks and the
report read it); the harness loads in `evaluate_models`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from pipeline.modeling.embedded import is_embedded, materialize
from pipeline.modeling.manifest import weights_hash
from pipeline.modeling.preflight import folder_problems
from pipeline.tools.eval_tasks import (
    EvalError,
    headline_columns,
    leaf_tasks,
    metric_key,
    metric_label,
    task_index,
    task_problems,
    tasks_hash,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED_TASKS = REPO / "data" / "general" / "tasks"
DEFAULT_TASKS = ("relay_general_mc", "relay_general_text")
CACHE_VERSION = 2


@dataclass
class BenchmarkConfig:
    """Benchmark scores of every generator stage's merged model through lm-evaluation-harness
    (pipeline/tools/evaluate.py), shown by `relay report` as a retention table against the base."""

    tasks: list[str] = field(default_factory=list)
    """Harness task (or group) names found under include_path; [] scores nothing. Relay ships
    relay_general_mc (everyday multiple choice) and relay_general_text (held-out general prose:
    perplexity) in data/general/tasks."""
    include_path: list[str] = field(default_factory=lambda: ["data/general/tasks"])
    """Folders of harness task YAMLs (searched recursively). Only tasks over local files run."""
    models: Optional[list[str]] = None
    """Rows: 'base' and generator stages of the chain. None: base and every generator stage that ran."""
    batch_size: int = 32
    """Requests per forward pass (the harness's --batch_size)."""
    limit: Optional[int] = None
    """Score only the first N documents of each task (None: all)."""
    dtype: str = "float32"
    """Weights dtype while scoring (the harness's model_args dtype: float32 | bfloat16 | float16 | auto)."""

    def problems(self, key: str = "gold.benchmarks.") -> list[str]:
        """What would stop the scoring, found before any stage runs (loads neither torch nor the harness).
        A setting is named as `key` + its name (`relay eval` passes "--")."""
        if not self.tasks:
            return []
        out = [
            f"{key}{name}: must be >= 1, got {value}"
            for name, value in (("batch_size", self.batch_size), ("limit", self.limit))
            if value is not None and value < 1
        ]
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            out.append(f"{key}dtype: {self.dtype!r} is not one of float32, bfloat16, float16, auto")
        missing = harness_missing()
        if missing:
            out.append(f"gold.benchmarks: {missing}")
        return out + [f"gold.benchmarks: {p}" for p in task_problems(self.tasks, self.include_path)]


def harness_missing() -> Optional[str]:
    """Why the harness cannot run here, or None."""
    if importlib.util.find_spec("lm_eval") is None:
        return "lm-evaluation-harness is not installed (pip install 'relay[eval]', or bash run_scripts/install.sh)"
    return None


# ---------------------------------------------------------------------------------------------
# Scoring (loads the harness and the models)
# ---------------------------------------------------------------------------------------------


def harness_args(folder: str | Path, settings: BenchmarkConfig, device: str) -> dict:
    """The keyword arguments of `lm_eval.simple_evaluate` that the plain `lm_eval --model hf` command
    with the same options passes (the task manager aside)."""
    return {
        "model": "hf",
        "model_args": {"pretrained": str(folder), "dtype": settings.dtype},
        "tasks": list(settings.tasks),
        "device": device,
        "batch_size": settings.batch_size,
        "limit": settings.limit,
        "bootstrap_iters": 0,  # standard errors are not shown; the point scores do not depend on them
        "log_samples": False,
    }


def scores_of(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from the harness's `results` (`metric,filter` keys), standard errors
    dropped. A task's metrics are keyed by the metric alone when all its values come through one
    filter, else by `metric,filter` (`metric_key`): no filter's value replaces another's (pure)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        kept = []
        for key, value in values.items():
            metric, comma, filter_name = key.partition(",")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if comma and number and not metric.endswith("_stderr"):
                kept.append((metric, filter_name, float(value)))
        filters = len({filter_name for _, filter_name, _ in kept})
        for metric, filter_name, value in kept:
            out.setdefault(task, {})[metric_key(metric, filter_name, filters)] = value
    return out


def evaluate_folder(folder: str | Path, settings: BenchmarkConfig, task_manager=None) -> dict:
    """{scores: {task: {metric: value}}, higher_is_better: {task: {metric: bool}}, n: {task: docs}}
    of the model folder, scored by the harness.

    Raises:
        EvalError: a task that cannot run offline, or the harness is missing.
    """
    problems = task_problems(settings.tasks, settings.include_path)
    missing = harness_missing()
    if missing or problems:
        raise EvalError("\n".join(([missing] if missing else []) + problems))
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    manager = task_manager or TaskManager(include_path=[str(p) for p in settings.include_path], include_defaults=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the harness's default is cuda, present or not
    out = lm_eval.simple_evaluate(**harness_args(folder, settings, device), task_manager=manager)
    return {
        "scores": scores_of(out["results"]),
        "higher_is_better": {t: dict(v) for t, v in out.get("higher_is_better", {}).items()},
        "n": {t: v.get("effective", v.get("original")) for t, v in out.get("n-samples", {}).items()},
    }


def cache_key(folder: Path, settings: BenchmarkConfig) -> str:
    """What a cached row depends on: the weights, the task files, the settings."""
    parts = {
        "version": CACHE_VERSION,
        "weights_hash": weights_hash(folder),
        "tasks_hash": tasks_hash(settings.tasks, settings.include_path),
        "tasks": list(settings.tasks),
        "batch_size": settings.batch_size,
        "limit": settings.limit,
        "dtype": settings.dtype,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def evaluate_models(
    models: Sequence[tuple[str, str]],
    settings: BenchmarkConfig,
    cache_file: Optional[Path] = None,
    log=lambda message: None,
) -> dict:
    """Score every (row name, folder) in one process: {tasks, columns, rows, wall_seconds}.

    Rows computed before (same weights, task files and settings) come from `cache_file`.

    Raises:
        EvalError: a task that cannot run offline, or the harness is missing.
    """
    problems = task_problems(settings.tasks, settings.include_path)
    missing = harness_missing()
    if missing or problems:
        raise EvalError("\n".join(([missing] if missing else []) + problems))
    started = time.time()
    index = task_index(settings.include_path)
    columns = [(task, key) for task in leaf_tasks(settings.tasks, index) for key in headline_columns(index.get(task))]
    cache = json.loads(cache_file.read_text(encoding="utf-8")) if cache_file and cache_file.is_file() else {}
    manager, rows = None, []
    for name, path in models:
        folder = Path(path).resolve()
        key = cache_key(folder, settings)
        if key in cache:
            log(f"benchmarks: {name}: cached ({folder})")
            rows.append({**cache[key], "model": name, "path": str(folder), "cached": True})
            continue
        log(f"benchmarks: {name}: scoring {', '.join(settings.tasks)} ({folder})")
        if manager is None:
            from lm_eval.tasks import TaskManager

            manager = TaskManager(include_path=[str(p) for p in settings.include_path], include_defaults=False)
        row = evaluate_folder(folder, settings, manager)
        rows.append({**row, "model": name, "path": str(folder), "cached": False})
        if cache_file is not None:
            cache[key] = row
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(cache, indent=2) + "\n", encoding="utf-8")
            tmp.replace(cache_file)
    return {
        "tasks": list(settings.tasks),
        "include_path": [str(p) for p in settings.include_path],
        "columns": [list(c) for c in columns],
        "rows": rows,
        "wall_seconds": round(time.time() - started, 1),
    }


# ---------------------------------------------------------------------------------------------
# The retention table (pure)
# ---------------------------------------------------------------------------------------------


def _cell(value: Optional[float], base: Optional[float], higher_is_better: bool, first: bool) -> str:
    if value is None:
        return "n/a"
    digits = 3 if abs(value) < 10 else 2
    text = f"{value:.{digits}f}"
    if first or base is None:
        return text
    change = value - base
    worse = change < 0 if higher_is_better else change > 0
    delta = f"{change:+.{digits}f}"
    return f"{text} (**{delta}**)" if worse and abs(change) > 0 else f"{text} ({delta})"


def retention_table(table: dict) -> str:
    """Markdown: one row per model, one column per task's headline metric (per filter when the task has
    several; an arrow says which way is better), each score with its change against the first row (the
    base); a loss is in bold."""
    columns = [tuple(c) for c in table.get("columns", [])]
    rows = table.get("rows", [])
    header = ["model"] + [
        f"{task} {metric_label(metric)} {'↑' if _higher(rows, task, metric) else '↓'}" for task, metric in columns
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    base = rows[0] if rows else {}
    for i, row in enumerate(rows):
        cells = [row["model"]]
        for task, metric in columns:
            value = row.get("scores", {}).get(task, {}).get(metric)
            reference = base.get("scores", {}).get(task, {}).get(metric)
            cells.append(_cell(value, reference, _higher(rows, task, metric), i == 0))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _higher(rows: Sequence[dict], task: str, key: str) -> bool:
    metric = key.partition(",")[0]  # the harness says which way is better per metric, not per filter
    for row in rows:
        flag = row.get("higher_is_better", {}).get(task, {}).get(metric)
        if flag is not None:
            return bool(flag)
    return "perplexity" not in metric and metric != "bits_per_byte"


# ---------------------------------------------------------------------------------------------
# relay eval
# ---------------------------------------------------------------------------------------------


def model_folder(path: str) -> Path:
    """A model argument as a folder: 'embedded' (converted once), a causal LM's folder, or a stage's
    output folder holding merged/. The folder passes the checks `relay chat` and `relay serve` make
    (pipeline.modeling.preflight: a reward model, an adapter, an unfinished run are refused; the
    harness would score a reward model as a causal LM without its score head).

    Raises:
        EvalError: none of those, one line per problem.
    """
    if is_embedded(path):
        return Path(materialize())
    folder = Path(path)
    if not (folder / "config.json").is_file() and (folder / "merged" / "config.json").is_file():
        folder = folder / "merged"
    if not folder.is_dir():
        raise EvalError(f"{path}: not a model folder (no config.json), a stage output with merged/, nor 'embedded'")
    problems = folder_problems(folder, "model", need="causal", allow_pickle=True)
    if problems:
        raise EvalError("\n".join(problems))
    return folder


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relay eval",
        description="Score model folders on lm-evaluation-harness tasks over local files; several models "
        "print a retention table against the first.",
    )
    parser.add_argument("models", nargs="+", help="model folders, stage output folders (merged/) or 'embedded'")
    parser.add_argument(
        "--tasks",
        default=",".join(DEFAULT_TASKS),
        help="comma-separated harness task or group names (default: %(default)s)",
    )
    parser.add_argument(
        "--include_path",
        action="append",
        help=f"a folder of harness task YAMLs (repeatable; default: {SHIPPED_TASKS.relative_to(REPO)})",
    )
    parser.add_argument("--batch_size", type=int, default=BenchmarkConfig.batch_size)
    parser.add_argument("--limit", type=int, default=None, help="score only the first N documents of each task")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"))
    parser.add_argument("--json", help="also write the table's figures to this JSON file")
    args = parser.parse_args(argv)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notices about defaults it filled in
    settings = BenchmarkConfig(
        tasks=[t for t in args.tasks.split(",") if t],
        include_path=args.include_path or [str(SHIPPED_TASKS)],
        batch_size=args.batch_size,
        limit=args.limit,
        dtype=args.dtype,
    )
    problems = settings.problems(key="--") if settings.tasks else ["--tasks: names no task"]
    if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        # found now, not after the scoring
        problems.append(f"--json: {args.json} is a folder, or in a folder that does not exist")
    try:
        folders = [(m, str(model_folder(m))) for m in args.models] if not problems else []
        if problems:
            raise EvalError("\n".join(p.removeprefix("gold.benchmarks: ") for p in problems))
        table = evaluate_models(folders, settings, log=lambda m: print(m, file=sys.stderr))
    except EvalError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    print(retention_table(table))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
        except OSError as err:
            print(f"error: --json: {args.json}: {err.strerror}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
