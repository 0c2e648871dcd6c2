"""The pipeline driver's Python half: config, stage plan, done-ness, cross-stage checks, summary.

    bash run_scripts/run_pipeline.sh configs/pipeline.yaml [--from sft] [--only rm] [--dotted.keys v]

The bash script owns the loop and the launches (torchrun per stage); for each stage it asks this
module, through small subcommands, what to do:

    python -m pipeline.tools.driver stages    CONFIG [selection/overrides]   # stage names to visit
    python -m pipeline.tools.driver prepare   CONFIG STAGE [...]             # 'skip' or the stage's argv
    python -m pipeline.tools.driver finish    CONFIG STAGE [...]             # check the new merged folder
    python -m pipeline.tools.driver summarize CONFIG [...]                   # gold table, summary.json, verdict
    python -m pipeline.tools.driver report-dir CONFIG [...]                  # where to write the report

The chain itself (config, plan, done-ness, cross-stage checks, stage commands) is
pipeline/tools/chain.py; this module holds the summary, the verdict and the subcommands.

Verdict: the figures a stage's StageInfo names (the RM's held-out accuracy) for the stages that
ran, and the gold table (pipeline/tools/gold.py; `gold:` section): greedy answers of the base
model, the judged stage (PPO, DPO, GRPO: the chain's last `judged` stage) and its parent to
held-out questions with an answer key. PASS needs the judged model's phrase rate above its
parent's by gold.min_phrase_gain and its fact accuracy within gold.max_fact_drop of its parent's.
Reward curves are reported, not judged.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import stages as registry
from pipeline.config import ConfigError
from pipeline.engine.interrupt import STOP_ENV
from pipeline.engine.launch import CONFIG_PROBLEMS, describe
from pipeline.engine.tracking import quiet_console
from pipeline.modeling.manifest import read_manifest
from pipeline.tools.chain import (
    checks_after,
    checks_before,
    merged_dir,
    parent_path,
    parent_stage,
    plan_problems,
    resolve_base,
    stage_argv,
    stage_dir,
    stage_reward_path,
    stage_status,
)
from pipeline.tools.chain_config import (
    LOG_NAME,
    STAGE_ORDER,
    TIMINGS_NAME,
    DriverError,
    GoldConfig,
    PipelineConfig,
    VerdictConfig,
    entry,
    gold_names,
    load_pipeline,
    planned_stages,
)
from pipeline.tools.eval_tasks import EvalError
from pipeline.tools.evaluate import evaluate_models, retention_table
from pipeline.tools.gold import GoldError, GoldSettings, format_table, gold_table

# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


def read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def verdict(
    figures: dict, cfg: VerdictConfig, gold_reasons: Optional[list[str]] = None, checked: Sequence[str] = ("rm",)
) -> list[str]:
    """Reasons the run did not show learning (empty: PASS). Pure.

    Every stage in `checked` must reach the minimum of each of its registry `verdict_figures`
    (the RM its held-out accuracy); the RL/preference model is judged by the gold table
    (`gold_verdict`, whose reasons come in `gold_reasons`; None: no gold table was configured).
    Reward curves are information only: a noisy curve rises by chance.
    """
    out = []
    for stage in checked:
        for key, limit_field in registry.info(stage).verdict_figures.items():
            value, limit = figures.get(f"{stage}_{key}"), getattr(cfg, limit_field)
            if value is None:
                out.append(f"the {stage.upper()} reported no {key}")
            elif value < limit:
                out.append(f"{stage.upper()} held-out {key.removeprefix('eval_')} {value:.3f} is below {limit}")
    if gold_reasons is None:
        out.append("no gold table (set gold.data): the RL model was not judged on held-out answers")
    else:
        out += gold_reasons
    return out


def gold_verdict(rows: Sequence[dict], rl: str, reference: str, cfg: GoldConfig) -> list[str]:
    """Reasons the RL model's gold row does not show what PPO should do, compared with the row of
    the model it started from (empty: PASS). Pure.

    PASS needs phrase_rate(rl) - phrase_rate(reference) >= cfg.min_phrase_gain (the house style
    the RM rewards was learned) and fact_accuracy(reference) - fact_accuracy(rl) <= cfg.max_fact_drop
    (it was not bought with wrong facts).
    """
    by_name = {r["model"]: r for r in rows}
    missing = [name for name in (rl, reference) if name not in by_name]
    if missing:
        return [f"gold: no row for {', '.join(missing)}"]
    a, b = by_name[rl], by_name[reference]
    out = []
    gain = a["phrase_rate"] - b["phrase_rate"]
    if gain < cfg.min_phrase_gain - 1e-9:
        out.append(
            f"gold: the {rl} model's phrase rate {a['phrase_rate']:.3f} is not above the {reference} model's "
            f"{b['phrase_rate']:.3f} by {cfg.min_phrase_gain} (gain {gain:+.3f})"
        )
    drop = b["fact_accuracy"] - a["fact_accuracy"]
    if drop > cfg.max_fact_drop + 1e-9:
        out.append(
            f"gold: the {rl} model's fact accuracy {a['fact_accuracy']:.3f} fell below the {reference} model's "
            f"{b['fact_accuracy']:.3f} by {drop:.3f}, more than the {cfg.max_fact_drop} allowed"
        )
    return out


def judged_stage(cfg: PipelineConfig, ran: Sequence[str]) -> Optional[str]:
    """The stage the gold verdict judges: the chain's last `judged` stage (PPO, DPO, GRPO) that ran."""
    return next((s for s in reversed(cfg.chain) if s in ran and registry.info(s).judged), None)


def gold_models(cfg: PipelineConfig, ran: Sequence[str]) -> list[tuple[str, str]]:
    """(row name, model path) for the gold table: the configured models that exist, plus the judged
    model's parent (the verdict's reference), in chain order (base first). Without gold.models:
    base, the judged stage's parent and the judged stage (else the chain's last generator)."""
    judged = judged_stage(cfg, ran)
    if cfg.gold.models is not None:
        wanted = set(cfg.gold.models)
    elif judged is not None:
        wanted = {"base", judged}
    else:
        wanted = {"base", *[s for s in gold_names(cfg.chain)[1:] if s in ran][-1:]}
    if judged is not None:
        wanted.add(parent_stage(cfg, judged) or "base")
    out = []
    for name in gold_names(cfg.chain):
        if name not in wanted:
            continue
        if name == "base":
            out.append(("base", str(resolve_base(cfg.base_model))))
        elif name in ran and read_manifest(merged_dir(cfg, name)) is not None:
            out.append((name, str(merged_dir(cfg, name).resolve())))
    return out


def compute_gold(cfg: PipelineConfig, ran: Sequence[str]) -> Optional[dict]:
    """The gold table of this run ({data, rows, reference, rl}), None when gold.data is unset.

    Rows are cached in output_root/gold/cache.json by weights hash (a re-run regenerates nothing);
    answers go to output_root/gold/answers/<model>.jsonl.
    """
    if not cfg.gold.data:
        return None
    root = Path(cfg.output_root) / "gold"
    settings = GoldSettings(cfg.gold.max_new_tokens, cfg.gold.batch_size, cfg.gold.dtype, cfg.gold.backend)
    started = time.time()
    rows = gold_table(
        gold_models(cfg, ran), cfg.gold.data, settings, root / "cache.json", root / "answers", lambda m: log(cfg, m)
    )
    judged = judged_stage(cfg, ran)
    return {
        "data": cfg.gold.data,
        "rows": rows,
        "rl": judged,
        "reference": (parent_stage(cfg, judged) or "base") if judged else None,
        "wall_seconds": round(time.time() - started, 1),
    }


def benchmark_models(cfg: PipelineConfig, ran: Sequence[str]) -> list[tuple[str, str]]:
    """(row name, model folder) of the retention table: base, then each generator stage of the chain
    that ran and left a merged model (gold.benchmarks.models narrows them), in chain order."""
    wanted = cfg.gold.benchmarks.models
    out = []
    for name in gold_names(cfg.chain):
        if wanted is not None and name not in wanted:
            continue
        if name == "base":
            out.append(("base", str(resolve_base(cfg.base_model))))
        elif name in ran and read_manifest(merged_dir(cfg, name)) is not None:
            out.append((name, str(merged_dir(cfg, name).resolve())))
    return out


def compute_benchmarks(cfg: PipelineConfig, ran: Sequence[str]) -> Optional[dict]:
    """The retention table's figures (pipeline/tools/evaluate.py), None when gold.benchmarks.tasks
    is empty. Rows are cached in output_root/benchmarks/cache.json by weights hash and task files."""
    if not cfg.gold.benchmarks.tasks:
        return None
    cache = Path(cfg.output_root) / "benchmarks" / "cache.json"
    return evaluate_models(benchmark_models(cfg, ran), cfg.gold.benchmarks, cache, lambda m: log(cfg, m))


def record_time(cfg: PipelineConfig, stage: str, event: str) -> None:
    """Note when a stage started/finished in output_root/timings.json (the driver's wall clock,
    which, unlike the stage's own wall_seconds, includes process start, loading and merging)."""
    path = Path(cfg.output_root) / TIMINGS_NAME
    timings = read_json(path) or {}
    timings.setdefault(stage, {})[event] = time.time()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Every node's driver writes this file on a shared output_root: write beside it and rename,
    # so a reader never sees it half-written (a plain write truncates it first).
    staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    staging.write_text(json.dumps(timings, indent=2) + "\n", encoding="utf-8")
    os.replace(staging, path)


def wall_seconds(cfg: PipelineConfig, stage: str, summary: dict) -> Optional[float]:
    """Driver-measured seconds for the stage's last run, else the stage's own figure."""
    times = (read_json(Path(cfg.output_root) / TIMINGS_NAME) or {}).get(stage, {})
    if "started" in times and "finished" in times and times["finished"] >= times["started"]:
        return round(times["finished"] - times["started"], 1)
    return summary.get("wall_seconds")


TIMING_NOTE = (
    "<stage>_wall_seconds: the driver's clock for the stage's process (start-up, loading, training, merge); "
    "<stage>_train_seconds (= stages.<stage>.wall_seconds): the stage's own training time (steps, "
    "evaluations, checkpoints), summed over resumed runs"
)


def pipeline_summary(cfg: PipelineConfig) -> dict:
    """Collect every stage's summary.json into output_root/summary.json (flat `<stage>_<key>`
    figures plus each stage's full summary) with a verdict; return it."""
    root = Path(cfg.output_root)
    figures: dict[str, Any] = {}
    stages: dict[str, Any] = {}
    for stage in cfg.chain:
        summary = read_json(stage_dir(cfg, stage) / "summary.json")
        if not entry(cfg, stage).enabled or summary is None:
            continue
        stages[stage] = summary
        figures.update({f"{stage}_{k}": summary[k] for k in registry.info(stage).summary_keys if k in summary})
        figures[f"{stage}_wall_seconds"] = wall_seconds(cfg, stage, summary)
        figures[f"{stage}_train_seconds"] = summary.get("wall_seconds")
    final = next((s for s in reversed(cfg.chain) if registry.info(s).model_kind == "causal" and s in stages), None)
    gold = compute_gold(cfg, list(stages))
    if gold is not None:
        figures["gold_wall_seconds"] = gold["wall_seconds"]
    benchmarks = compute_benchmarks(cfg, list(stages))
    if benchmarks is not None:
        figures["benchmarks_wall_seconds"] = benchmarks["wall_seconds"]
    # The verdict needs every enabled stage it judges (the judged stages, those with verdict figures).
    needed = [
        s for s in cfg.chain if entry(cfg, s).enabled and (registry.info(s).judged or registry.info(s).verdict_figures)
    ]
    missing = [s for s in needed if s not in stages]
    if needed and not missing:
        gold_reasons = None if gold is None else gold_verdict(gold["rows"], gold["rl"], gold["reference"], cfg.gold)
        reasons = verdict(
            figures, cfg.verdict, gold_reasons, checked=[s for s in needed if registry.info(s).verdict_figures]
        )
    elif needed or any(s not in stages for s in cfg.chain[-1:]):
        reasons = [f"{' or '.join(s.upper() for s in (needed or cfg.chain[-1:]))} did not run"]
    else:  # every stage ran, and none of them is one a verdict reads
        judges = [s.upper() for s, i in registry.STAGES.items() if i.judged or i.verdict_figures]
        reasons = [f"nothing to judge: the chain has none of the stages a verdict reads ({', '.join(judges)})"]
    judged = (
        gold["rl"] if gold else next((s for s in reversed(cfg.chain) if s in stages and registry.info(s).judged), None)
    )
    reward = stage_reward_path(cfg, judged) if judged else None
    final_model = str(merged_dir(cfg, final).resolve()) if final else None
    out = {
        **figures,
        "gold": gold,
        "benchmarks": benchmarks,
        "final_model": final_model,
        "compare": shlex.join(["relay", "chat", "--model", cfg.base_model, "--compare", final_model])
        if final_model
        else None,
        "reward_model": str(reward) if reward else None,
        "tensorboard": f"tensorboard --logdir {root}",
        "timing": TIMING_NOTE,
        "verdict": "PASS" if not reasons else "WARNING",
        "verdict_reasons": reasons,
        "stages": stages,
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "summary.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return out


def format_summary(summary: dict) -> str:
    """The human-readable summary the demo prints."""

    def num(value: Any, digits: int = 4) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = ["", "=== Relay pipeline summary ==="]
    # One line per kind of figure a stage reports (losses; pairwise accuracy; RL reward), in
    # stage order, so any chain reads the same way.
    for stage in summary["stages"]:
        g = lambda k: num(summary.get(f"{stage}_{k}"))  # noqa: E731
        seconds = f"  ({num(summary.get(f'{stage}_wall_seconds'), 0)} s)"
        if f"{stage}_train_loss_first" in summary:
            lines.append(
                f"{stage:>3}: train loss {g('train_loss_first')} -> {g('train_loss_last')}, eval loss "
                f"{g('eval_loss_first')} -> {g('eval_loss_last')}{seconds}"
            )
            seconds = ""
        if f"{stage}_eval_accuracy" in summary:
            lines.append(f"{stage:>3}: held-out accuracy {g('eval_accuracy')}, margin {g('eval_margin')}")
        if f"{stage}_kl_first" in summary:
            lines.append(
                f"{stage:>3}: KL to the teacher {g('kl_first')} -> {g('kl_last')}, eval KL "
                f"{g('eval_kl_first')} -> {g('eval_kl_last')}{seconds}"
            )
            seconds = ""
        if f"{stage}_reward_first" in summary:
            lines.append(
                f"{stage:>3}: mean reward {g('reward_first')} -> {g('reward_last')}, eval reward "
                f"{g('eval_reward_first')} -> {g('eval_reward_last')}, final KL {g('kl_last')}{seconds}"
            )
    gold = summary.get("gold")
    if gold:
        lines += [
            f"gold table ({gold['data']}, greedy; {num(gold.get('wall_seconds'), 0)} s):",
            format_table(gold["rows"]),
        ]
        if gold.get("rl"):
            lines.append(f"verdict: the {gold['rl']} model against the {gold['reference']} model")
    benchmarks = summary.get("benchmarks")
    if benchmarks and benchmarks.get("rows"):
        lines += [
            f"retention (lm-evaluation-harness, change against base; {num(benchmarks.get('wall_seconds'), 0)} s):",
            retention_table(benchmarks),
        ]
    total = sum(v for k, v in summary.items() if k.endswith("_wall_seconds") and isinstance(v, (int, float)))
    lines += [
        f"wall time (stages + gold + benchmarks): {total:.0f} s",
        f"final model: {summary['final_model']}",
        f"curves: {summary['tensorboard']}",
    ]
    if summary.get("compare"):
        lines.append(f"compare the base and final models: {summary['compare']}")
    lines.append(f"verdict: {summary['verdict']}" + "".join(f"\nWARNING: {r}" for r in summary["verdict_reasons"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Subcommands (what run_pipeline.sh calls)
# ---------------------------------------------------------------------------------------------


def log(cfg: PipelineConfig, message: str) -> None:
    """To stderr (stdout carries answers to the bash script) and to output_root/driver.log."""
    print(f"[driver] {message}", file=sys.stderr, flush=True)
    record(cfg, message)


def record(cfg: PipelineConfig, message: str) -> None:
    """One entry of output_root/driver.log: the time, then the message (its later lines indented)."""
    root = Path(cfg.output_root)
    root.mkdir(parents=True, exist_ok=True)
    text = message.replace("\n", "\n    ")
    with open(root / LOG_NAME, "a", encoding="utf-8") as fh:
        fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")


def refused(cfg: PipelineConfig, stage: Optional[str], reason: Exception) -> None:
    """driver.log's record of a pipeline the driver stopped itself (a stale or unfinished stage, a
    failed check, a config problem): which stage and why, as the console's error line says it. A
    plan refused before output_root exists writes nothing: it leaves no folder behind."""
    if not Path(cfg.output_root).is_dir():
        return
    where = f"{stage}: the pipeline stopped here" if stage else "pipeline: stopped before any stage ran"
    record(cfg, f"{where}: {reason}")


def cmd_prepare(cfg: PipelineConfig, stage: str) -> list[str]:
    """['skip'] for a finished stage, else the stage's argv after the cross-stage checks pass.

    Raises:
        DriverError: a check failed or the stage's output is stale.
    """
    if stage_status(cfg, stage) == "done":
        log(cfg, f"{stage}: skipped, already complete ({merged_dir(cfg, stage)}/manifest.json)")
        return ["skip"]
    problems = checks_before(cfg, stage)
    if problems:
        raise DriverError(f"{stage}: cross-stage checks failed:\n" + "\n".join(f"  - {p}" for p in problems))
    argv = stage_argv(cfg, stage)
    record_time(cfg, stage, "started")
    log(cfg, f"{stage}: running {' '.join(argv)}")
    return argv


def cmd_finish(cfg: PipelineConfig, stage: str) -> Optional[str]:
    """Check the stage's new merged folder; "stopped" (for the script: end here, exit 0) where the
    stage saved and stopped at RELAY_STOP_AFTER_STEP without merging, as it does by design.

    Raises:
        DriverError: the new merged folder fails its checks.
    """
    if os.environ.get(STOP_ENV, "").strip() and not (merged_dir(cfg, stage) / "manifest.json").is_file():
        log(
            cfg,
            f"{stage}: stopped after step {os.environ[STOP_ENV].strip()} ({STOP_ENV}); {last_checkpoint(cfg, stage)}; "
            "rerun the same command (without it) to continue",
        )
        return "stopped"
    problems = checks_after(cfg, stage)
    if problems:
        raise DriverError(f"{stage}: output checks failed:\n" + "\n".join(f"  - {p}" for p in problems))
    record_time(cfg, stage, "finished")
    log(cfg, f"{stage}: finished, {merged_dir(cfg, stage)} checked against its parent {parent_path(cfg, stage)}")
    return None


def stale_stages(cfg: PipelineConfig) -> list[str]:
    """Why each enabled stage with an output is stale (stage_status's reason), in chain order."""
    out = []
    for stage in cfg.chain:
        if entry(cfg, stage).enabled and (merged_dir(cfg, stage) / "manifest.json").is_file():
            try:
                stage_status(cfg, stage)
            except DriverError as err:
                out.append(str(err))
    return out


def last_checkpoint(cfg: PipelineConfig, stage: str) -> str:
    """Where a rerun of `stage` continues from, in words."""
    folder = merged_dir(cfg, stage).parent / "checkpoints"
    marked = sorted(p.parent for p in folder.glob("step-*/.complete")) if folder.is_dir() else []
    return f"its last checkpoint is {marked[-1]}" if marked else "it has no checkpoint yet"


def cmd_stopped(cfg: PipelineConfig, stage: Optional[str], exit_code: int) -> None:
    """Record in driver.log which stage ended early, why (a signal or an error exit) and the
    checkpoint a rerun continues from; without a stage, a signal that came while none ran (the
    script stops before the next one, or after the summary it was writing)."""
    if stage is None:
        log(cfg, f"pipeline: {describe(exit_code)} between stages; rerun the same command to continue")
        return
    if exit_code == CONFIG_PROBLEMS:
        log(cfg, f"{stage}: its config or data has the problems listed above; fix them and rerun the same command")
        return
    log(cfg, f"{stage}: {describe(exit_code)}; {last_checkpoint(cfg, stage)}; rerun the same command to continue")


@contextlib.contextmanager
def answers_only_on_stdout():
    """Yield a stream for the answers to the bash script; while inside, everything else written
    to file descriptor 1 (libraries that log to stdout, e.g. DeepSpeed's accelerator notice when
    the embedded model is first converted) goes to stderr, so it cannot become part of an argv."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real descriptor (e.g. an embedding host): nothing to protect
        yield sys.stdout
        return
    answer = os.fdopen(os.dup(saved), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        yield answer
    finally:
        sys.stdout.flush()
        answer.flush()
        answer.close()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: Optional[list[str]] = None) -> int:
    if argv is None and not sys.stdout.isatty():
        with answers_only_on_stdout() as answer:
            return run_command(list(sys.argv[1:]), answer)
    return run_command(list(sys.argv[1:] if argv is None else argv), sys.stdout)


def run_command(args: list[str], answer) -> int:
    """One subcommand; what the bash script reads goes to `answer`, everything else to stderr."""
    usage = (
        "usage: python -m pipeline.tools.driver {stages,prepare,finish,stopped,summarize,report-dir} CONFIG [STAGE] "
        "[EXIT_CODE] [--from S|--only S] [--key value ...]"
    )
    if len(args) < 2 or args[0] not in ("stages", "prepare", "finish", "stopped", "summarize", "report-dir"):
        print(usage, file=sys.stderr)
        return 2
    command, config_path, rest = args[0], args[1], args[2:]
    stage, cfg = None, None
    exit_code = 0
    if command == "stopped" and len(rest) >= 2 and rest[1].lstrip("-").isdigit():
        exit_code, rest = int(rest[1]), [rest[0], *rest[2:]]
    if command == "stopped" and rest and rest[0] == "-":  # no stage was running
        rest = rest[1:]
    elif command in ("prepare", "finish", "stopped"):
        if not rest or rest[0] not in STAGE_ORDER:
            print(f"{command}: needs a stage ({', '.join(STAGE_ORDER)})\n{usage}", file=sys.stderr)
            return 2
        stage, rest = rest[0], rest[1:]
    try:
        cfg, selection = load_pipeline(config_path, rest)
        if command == "stages":
            planned = planned_stages(cfg, selection)
            problems = plan_problems(cfg, planned)
            if problems:
                raise ConfigError(problems, config_path)
            print("\n".join(planned), file=answer)
        elif command == "prepare":
            print("\n".join(cmd_prepare(cfg, stage)), file=answer)
        elif command == "finish":
            print(cmd_finish(cfg, stage) or "finished", file=answer)
        elif command == "stopped":
            cmd_stopped(cfg, stage, exit_code)
        elif command == "report-dir":
            print(cfg.output_root if cfg.report else "", file=answer)
        else:
            stale = stale_stages(cfg)
            if stale:  # a --only / --from run rebuilt a stage that later ones were built on
                log(cfg, f"summary: not written, since {stale[0]}; rerun without --from / --only to rebuild it")
                return 0
            quiet_console()  # the gold table loads models: no weight-loading bars between the driver's lines
            summary = pipeline_summary(cfg)
            log(cfg, f"summary written to {Path(cfg.output_root) / 'summary.json'} (verdict {summary['verdict']})")
            print(format_summary(summary), file=answer)
    except (ConfigError, DriverError, GoldError, EvalError) as err:
        print(f"error: {err}", file=sys.stderr)
        if cfg is not None:  # the config loaded: its output_root has the driver.log to say it in
            refused(cfg, "summary" if command == "summarize" else stage, err)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
