"""lm-evaluation-harness task YAMLs read without the harness (it indexes every task it ships, seconds): the
index of the include paths (`task_index`), what keeps a task from running offline (`task_problems`:
unknown names, data it would download), a group's leaf tasks, a task's headline columns (its first
metric, once per filter when it has several), and the hash of everything the scores depend on
(`tasks_hash`). `relay eval` (pipeline/tools/evaluate.py) runs them."""

from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import yaml

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")
"""`dataset_path` values that name a builder packaged in `datasets`: local when every data file is."""


FIRST_METRIC = {"multiple_choice": "acc", "loglikelihood_rolling": "word_perplexity", "generate_until": "exact_match"}
"""A task's column when its YAML lists no metric (the harness's defaults per output type)."""


class EvalError(RuntimeError):
    """An evaluation that cannot run; the message is one line per problem."""


class _TaskLoader(yaml.SafeLoader):
    """The harness's YAML with its tags kept as text (`!function m.f` -> '!function m.f')."""


_TaskLoader.add_multi_constructor("!", lambda loader, tag, node: f"{tag} {loader.construct_scalar(node)}")


def read_task_yaml(path: Path, depth: int = 0) -> dict:
    """A task YAML as a dict, its `include:` (a path beside it) merged under its own keys.

    Raises:
        EvalError: the file does not parse, or an include is missing or circular.
    """
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskLoader)
    except (OSError, yaml.YAMLError) as err:
        raise EvalError(f"{path}: {' '.join(str(err).split())}") from err
    if not isinstance(data, dict):
        return {}
    included = data.pop("include", None)
    if included is None:
        return data
    base = (path.parent / str(included)).resolve()
    if depth > 8 or not base.is_file():
        raise EvalError(f"{path}: include {included!r} {'is circular' if depth > 8 else 'does not exist'}")
    return {**read_task_yaml(base, depth + 1), **data}


@dataclass
class TaskEntry:
    name: str
    path: Path
    config: dict
    kind: str  # task | group | tag
    members: list[str] = field(default_factory=list)


def task_index(include_paths: Iterable[str | Path]) -> dict[str, TaskEntry]:
    """{name: entry} of every task, group and tag in the YAMLs under `include_paths` (later paths win).

    Raises:
        EvalError: a YAML that does not parse.
    """
    index: dict[str, TaskEntry] = {}
    for root in include_paths:
        for path in sorted(Path(root).rglob("*.yaml")):
            cfg = read_task_yaml(path)
            task = cfg.get("task")
            if isinstance(task, str):
                index[task] = TaskEntry(task, path, cfg, "task")
                tags = cfg.get("tag") or []
                for tag in [tags] if isinstance(tags, str) else tags:
                    entry = index.setdefault(tag, TaskEntry(tag, path, {}, "tag"))
                    entry.members.append(task)
            elif isinstance(task, list) and isinstance(cfg.get("group"), str):
                members = [t if isinstance(t, str) else t.get("task") for t in task if isinstance(t, (str, dict))]
                index[cfg["group"]] = TaskEntry(cfg["group"], path, cfg, "group", [m for m in members if m])
    return index


def _data_files(kwargs: Any) -> list[str]:
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    if isinstance(files, dict):
        files = list(files.values())
    out: list[str] = []
    for item in [files] if isinstance(files, str) else files or []:
        out += [item] if isinstance(item, str) else [f for f in item if isinstance(f, str)]
    return out


def download_reason(cfg: dict) -> Optional[str]:
    """Why a task's data would not come from local files (None: it would), from its YAML alone (pure
    but for checking that paths exist; relative data_files are read from the working directory, as
    `datasets` reads them)."""
    if cfg.get("class"):
        return "is a Python task class, whose data source Relay cannot read from the YAML"
    if cfg.get("custom_dataset"):
        return None
    source = cfg.get("dataset_path")
    if not source:
        return "names no dataset_path and no custom_dataset"
    if source in LOCAL_BUILDERS:
        files = _data_files(cfg.get("dataset_kwargs"))
        if not files:
            return f"dataset_path {source!r} with no dataset_kwargs.data_files"
        remote = [f for f in files if "://" in f]
        if remote:
            return f"reads {remote[0]!r} over the network"
        absent = [f for f in files if not glob.glob(f)]
        return f"data file {absent[0]!r} does not exist (relative to {Path.cwd()})" if absent else None
    if Path(str(source)).is_dir():
        return None
    return f"would download dataset_path {source!r} from the Hub"


def task_problems(names: Sequence[str], include_paths: Sequence[str | Path]) -> list[str]:
    """One line per requested task (or group/tag member) that cannot run offline from local files.
    Loads neither torch nor the harness."""
    missing = [p for p in include_paths if not Path(p).is_dir()]
    if missing:
        return [f"include_path {str(p)!r} is not a folder" for p in missing]
    try:
        index = task_index(include_paths)
    except EvalError as err:
        return [str(err)]
    where = ", ".join(map(str, include_paths))
    out: list[str] = []

    def check(name: str, seen: tuple[str, ...]) -> None:
        entry = index.get(name)
        if entry is None:
            out.append(
                f"task {name!r} is not in {where}: Relay runs harness task YAMLs over local files only "
                "(the harness's own tasks download their data); add its folder with --include_path"
            )
        elif entry.kind == "task":
            reason = download_reason(entry.config)
            if reason:
                out.append(
                    f"task {name!r} ({entry.path}): {reason}; Relay scores local files only "
                    "(dataset_path json|csv|parquet|text with local data_files, a local folder, or custom_dataset)"
                )
        elif name not in seen:
            for member in entry.members:
                check(member, (*seen, name))

    for name in names:
        check(name, ())
    return out


def leaf_tasks(names: Sequence[str], index: dict[str, TaskEntry]) -> list[str]:
    """The tasks `names` stand for (groups and tags expanded), in order, each once (pure)."""
    out: list[str] = []
    for name in names:
        entry = index.get(name)
        for leaf in [name] if entry is None or entry.kind == "task" else leaf_tasks(entry.members, index):
            if leaf not in out:
                out.append(leaf)
    return out


def first_metric(entry: Optional[TaskEntry]) -> Optional[str]:
    """A task's headline metric: the first of its metric_list, else the harness's default for its
    output type (pure)."""
    if entry is None:
        return None
    metrics = entry.config.get("metric_list") or []
    if metrics and isinstance(metrics[0], dict) and metrics[0].get("metric"):
        return str(metrics[0]["metric"])
    return FIRST_METRIC.get(entry.config.get("output_type", ""))


def filter_names(entry: Optional[TaskEntry]) -> list[str]:
    """The names of a task's filters, as the harness suffixes its metrics with them (`acc,none`):
    its filter_list's, else the harness's one default, "none" (pure)."""
    filters = (entry.config.get("filter_list") if entry is not None else None) or []
    names = [str(f["name"]) for f in filters if isinstance(f, dict) and f.get("name") is not None]
    return names or ["none"]


def metric_key(metric: str, filter_name: str, filters: int) -> str:
    """The key of a metric in Relay's scores: the metric alone when its task has one filter, else
    the harness's own `metric,filter`, so that each filter's value stays its own (pure)."""
    return metric if filters == 1 else f"{metric},{filter_name}"


def metric_label(key: str) -> str:
    """A score key as a table shows it: `exact_match,strict-match` -> `exact_match (strict-match)` (pure)."""
    metric, comma, filter_name = key.partition(",")
    return f"{metric} ({filter_name})" if comma else metric


def headline_columns(entry: Optional[TaskEntry]) -> list[str]:
    """A task's score keys in the retention table: its first metric (`first_metric`), once per filter
    when it has several (`metric_key`); [] when no metric is known (pure)."""
    metric = first_metric(entry)
    if metric is None:
        return []
    names = filter_names(entry)
    return [metric_key(metric, name, len(names)) for name in names]


def tasks_hash(names: Sequence[str], include_paths: Sequence[str | Path]) -> str:
    """A hash of every file the tasks read: the include folders' files and the data files they name."""
    digest = hashlib.sha256()
    for root in include_paths:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    index = task_index(include_paths)
    for name in leaf_tasks(names, index):
        for f in _data_files(index[name].config.get("dataset_kwargs")) if name in index else []:
            for path in [Path(p) for p in sorted(glob.glob(f))] or [Path(f)]:
                digest.update(str(path).encode() + b"\0" + (path.read_bytes() if path.is_file() else b""))
    return digest.hexdigest()
