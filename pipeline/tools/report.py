"""Run report: curves from every stage's TensorBoard events into report.md and PNG plots.

    python -m pipeline.tools.report RUN_DIR        # writes RUN_DIR/report.md and RUN_DIR/plots/*.png

RUN_DIR is a pipeline output root (one folder per registered stage that ran: pt/, sft/, rm/, ppo/,
dpo/, ...) or a single stage's output folder. Each stage's plot is the one its registry entry
declares (stages/__init__.py `StageInfo.plot`), so a new stage brings its own panels. Events are read with tensorboard's
EventAccumulator; a stage that was resumed has
several event folders, whose curves are joined by step (`read_scalars`: a resumed life replaces
what the earlier ones logged from its first step on). A run that started fresh moved the earlier runs' events to
`runs.old-<time>/` (pipeline.engine.resume), which the report does not read: a stage's curves are
the run its summary.json and merged/ come from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import stages as registry
from pipeline.modeling.manifest import read_manifest
from pipeline.tools.evaluate import retention_table
from pipeline.tools.gold import format_table

Curve = list[tuple[int, float]]


class ReportError(RuntimeError):
    """Nothing to report (no stage folder with TensorBoard events)."""


def event_dirs(stage_folder: Path) -> list[Path]:
    """Folders under `stage_folder/runs` holding TensorBoard event files, sorted."""
    runs = stage_folder / "runs"
    return sorted({p.parent for p in runs.rglob("events.out.tfevents.*")}) if runs.is_dir() else []


def read_scalars(stage_folder: Path) -> dict[str, Curve]:
    """Every scalar tag of a stage as a step-sorted curve, joined over all its event folders: one per
    life of the run, taken in the order they were written. A resumed life takes over from its first
    logged step: every point an earlier life logged from that step on (its abandoned steps, also
    those past a lowered `train.max_steps`) is left out, in every tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lives = []
    for folder in event_dirs(stage_folder):
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        events = {tag: acc.Scalars(tag) for tag in acc.Tags().get("scalars", [])}
        if any(events.values()):
            lives.append((min(e.wall_time for found in events.values() for e in found), events))
    points: dict[str, dict[int, float]] = {}
    for _, events in sorted(lives, key=lambda life: life[0]):
        start = min(e.step for found in events.values() for e in found)
        for steps in points.values():
            for step in [s for s in steps if s >= start]:
                del steps[step]
        for tag, found in events.items():
            points.setdefault(tag, {}).update((e.step, e.value) for e in found)
    return {tag: sorted(steps.items()) for tag, steps in points.items() if steps}


def stage_of(folder: Path) -> str:
    """The stage a run folder holds: the one its merged/ manifest names, else the folder's name (a
    run folder may have any name: `--output_dir out/my_ppo`)."""
    try:
        named = (read_manifest(folder / "merged") or {}).get("stage")
    except (OSError, ValueError):
        named = None
    return named if named in registry.STAGES else folder.name


def stage_folders(run_dir: Path) -> dict[str, Path]:
    """{stage name: folder} for a pipeline root, or {its stage (`stage_of`): folder} for one stage's folder.

    Raises:
        ReportError: no folder with TensorBoard events.
    """
    found = {s: run_dir / s for s in registry.STAGES if event_dirs(run_dir / s)}
    if not found and event_dirs(run_dir):
        found = {stage_of(run_dir): run_dir}
    if not found:
        raise ReportError(
            f"{run_dir}: no TensorBoard events in {', '.join(f'{s}/runs' for s in registry.STAGES)} or runs/"
        )
    return found


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


def _plot_panels(path: Path, title: str, panels: list[tuple[str, str, dict[str, Curve]]]) -> Optional[Path]:
    """One row of panels (panel title, y label, {legend label: curve}); None when all are empty."""
    panels = [p for p in panels if any(p[2].values())]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (panel_title, ylabel, curves) in zip(axes[0], panels):
        for label, curve in curves.items():
            if curve:
                steps, values = zip(*curve)
                ax.plot(steps, values, marker="o" if len(curve) < 12 else None, markersize=3, label=label)
        ax.set_title(panel_title)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _prefixed(scalars: dict[str, Curve], prefix: str) -> dict[str, Curve]:
    return {tag[len(prefix) :]: curve for tag, curve in sorted(scalars.items()) if tag.startswith(prefix)}


def panel_curves(panel: registry.Panel, scalars: dict[str, Curve]) -> dict[str, Curve]:
    """{legend label: curve} of one registry panel (pure)."""
    if panel.prefix:
        return _prefixed(scalars, panel.prefix)
    return {label: scalars.get(tag, []) for label, tag in panel.tags.items()}


def make_plots(curves: dict[str, dict[str, Curve]], out: Path) -> dict[str, Path]:
    """Write the loss plot (every stage whose registry entry has `loss_curve`; a folder that is no
    registered stage counts as one) and each stage's own plot; return {name: png path} for those
    that had data."""
    loss_panels = [
        (f"{stage}: loss", "loss", {"train": scalars.get("train/loss", []), "eval": scalars.get("eval/loss", [])})
        for stage, scalars in curves.items()
        if stage not in registry.STAGES or registry.info(stage).loss_curve
    ]
    plots = {"losses": _plot_panels(out / "losses.png", "Training and eval loss per stage", loss_panels)}
    for stage, scalars in curves.items():
        name, title, panels = registry.info(stage).plot if stage in registry.STAGES else ("", "", ())
        if panels:
            plots[name] = _plot_panels(
                out / f"{name}.png", title, [(p.title, p.ylabel, panel_curves(p, scalars)) for p in panels]
            )
    return {name: path for name, path in plots.items() if path is not None}


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _fmt(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def curve_row(stage: str, tag: str, curve: Curve) -> str:
    """A table row: tag, points, first -> last, min (pure)."""
    values = [v for _, v in curve]
    return (
        f"| {stage} | `{tag}` | {len(curve)} | {_fmt(values[0])} "
        f"| {_fmt(values[-1])} | {_fmt(min(values))} | {_fmt(max(values))} |"
    )


def gold_section(gold: Optional[dict]) -> list[str]:
    """The gold table from summary.json's `gold` entry as markdown lines (pure; [] without one)."""
    if not gold or not gold.get("rows"):
        return []
    lines = [
        "## Gold table",
        "",
        f"Greedy answers to the held-out questions in `{gold.get('data')}`, scored against their answer key:",
        "phrase rate = opens with the house phrase, fact accuracy = states the right value and no other.",
        "",
    ]
    lines += format_table(gold["rows"]).splitlines()
    if gold.get("rl"):
        lines += ["", f"The verdict compares the `{gold['rl']}` row with the `{gold['reference']}` row."]
    return lines + [""]


def retention_section(benchmarks: Optional[dict]) -> list[str]:
    """The retention table from summary.json's `benchmarks` entry as markdown lines (pure; [] without one)."""
    if not benchmarks or not benchmarks.get("rows"):
        return []
    lines = [
        "## Retention (lm-evaluation-harness)",
        "",
        f"Each model scored on `{', '.join(benchmarks.get('tasks', []))}` (task YAMLs in "
        f"`{', '.join(benchmarks.get('include_path', []))}`); beside each score its change against the base "
        "model, in bold where it is a loss (the arrow says which way is better).",
        "",
    ]
    return lines + retention_table(benchmarks).splitlines() + [""]


def headline_tags() -> tuple[str, ...]:
    """The loss tags, then every tag a registered stage plots (prefix panels' tags come after them)."""
    plotted = (tag for info in registry.STAGES.values() for panel in info.plot[2] for tag in panel.tags.values())
    return ("train/loss", "eval/loss", *dict.fromkeys(t for t in plotted if t not in ("train/loss", "eval/loss")))


def render_markdown(
    run_dir: Path, curves: dict[str, dict[str, Curve]], plots: dict[str, Path], summary: Optional[dict]
) -> str:
    """report.md's text (pure)."""
    lines = [f"# Relay run report: `{run_dir}`", ""]
    if summary and "verdict" not in summary:  # one stage's folder: its own summary.json, no pipeline verdict
        merged = run_dir / "merged"
        final = (
            f"`{merged.resolve()}`"
            if (merged / "config.json").is_file()
            else "none yet (no merged/: the stage has not finished)"
        )
        lines += [
            "One stage's run: the verdict is a pipeline run's (`relay report OUTPUT_ROOT`).",
            "",
            f"Final model: {final}",
            "",
        ]
        lines += [
            f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}"
            for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ] + [""]
    elif summary:
        lines += [f"Verdict: **{summary.get('verdict', 'n/a')}**"]
        lines += [f"- WARNING: {reason}" for reason in summary.get("verdict_reasons", [])]
        lines += ["", f"Final model: `{summary.get('final_model')}`", ""]
        lines += gold_section(summary.get("gold"))
        lines += retention_section(summary.get("benchmarks"))
    lines += [
        "## Curves (first -> last)",
        "",
        "| stage | tag | points | first | last | min | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for stage, scalars in curves.items():
        prefixes = [p.prefix for p in registry.info(stage).plot[2] if p.prefix] if stage in registry.STAGES else []
        tags = [t for t in headline_tags() if t in scalars] + sorted(
            t for t in scalars if "/loss_task/" in t or any(t.startswith(p) for p in prefixes)
        )
        lines += [curve_row(stage, tag, scalars[tag]) for tag in tags if scalars[tag]]
    lines += ["", "## Plots", ""]
    lines += [f"![{name}]({path.relative_to(run_dir)})" for name, path in plots.items()]
    lines += ["", f"All curves: `tensorboard --logdir {run_dir}`", ""]
    return "\n".join(lines)


def write_report(run_dir: str | Path) -> Path:
    """Read every stage's events, write plots/*.png and report.md; return report.md's path.

    Raises:
        ReportError: no TensorBoard events under run_dir.
    """
    run_dir = Path(run_dir)
    curves = {stage: read_scalars(folder) for stage, folder in stage_folders(run_dir).items()}
    plots = make_plots(curves, run_dir / "plots")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else None
    report = run_dir / "report.md"
    report.write_text(render_markdown(run_dir, curves, plots, summary), encoding="utf-8")
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relay report", description="Write RUN_DIR/report.md and plots from TensorBoard events."
    )
    parser.add_argument(
        "run_dir", help="pipeline output root (one folder per stage: pt/ sft/ ...) or one stage's output folder"
    )
    args = parser.parse_args(argv)
    try:
        print(write_report(args.run_dir))
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
