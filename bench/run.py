"""Run one side-by-side comparison of Relay and a peer and append a dated row to bench/RESULTS.md.

    .venv/bin/python bench/run.py NAME [--quick] [--threads N] [--results PATH]

NAME is a module of bench/comparisons/ (sft, ppo, dpo, grpo, ...). `--quick` runs a tiny
random-init model for a few steps (the smoke test's mode: it checks the row's form, never a
time). Each side runs in its own process; a comparison whose two sides do not start from the
same first-batch loss (within the module's LOSS_TOLERANCE) records no row and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402


def comparison(name: str):
    """The comparison module `name`.

    Raises:
        harness.HarnessError: no such comparison.
    """
    known = sorted(p.stem for p in (ROOT / "bench" / "comparisons").glob("*.py") if not p.stem.startswith("_"))
    if name not in known:
        raise harness.HarnessError(f"no comparison {name!r}; known: {', '.join(known)}")
    return importlib.import_module(f"bench.comparisons.{name}")


def child(args) -> int:
    module = comparison(args.name)
    case, env = json.loads(args.case), harness.SideEnv(**json.loads(args.env))
    result = (module.relay if args.child == "relay" else module.peer)(case, env)
    Path(args.child_out).write_text(json.dumps(dataclasses.asdict(result)))
    return 0


def side(args, module, name: str, case: dict, env: harness.SideEnv, python) -> harness.SideResult:
    """One side's result: in a fresh process of `python`, or with `--quick` in this process when
    `python` is this environment's interpreter (a quick row's form is what is checked; its RSS is
    not per side)."""
    if args.quick and Path(python).absolute().parents[1].resolve() == Path(sys.prefix).resolve():
        return (module.relay if name == "relay" else module.peer)(case, env)
    return harness.run_side(args.name, name, case, env, python)


def figure(module, seconds: float, rate: float) -> str:
    return f"{rate:,.0f} tok/s" if module.UNIT == "tok/s" else f"{seconds:.2f} s/step"


def compare(args) -> int:
    module = comparison(args.name)
    cases = module.cases(args.quick)
    unknown = sorted(set(args.case or []) - {c["case"] for c in cases})
    if unknown:
        raise harness.HarnessError(
            f"{args.name} has no case {', '.join(unknown)}"
            f"{' in --quick' if args.quick else ''}; its cases: {', '.join(c['case'] for c in cases)}"
        )
    env = harness.side_env(args.quick, args.workdir, args.threads, prefix=f"relay-bench-{args.name}-")
    pythons = {
        "relay": harness.PYTHONS["relay"],
        "peer": harness.ensure_trl_112() if module.PEER_PYTHON == "trl-1.12" else harness.PYTHONS["relay"],
    }
    versions = f"Relay: {harness.versions(pythons['relay'])}; peer: {harness.versions(pythons['peer'])}"
    machine = harness.machine() + f", {args.threads} threads"
    failed = 0
    for case in cases:
        if args.case and case["case"] not in args.case:
            continue
        warmup = case.get("warmup", 1)
        print(f"{args.name} {case['case']}: Relay ...", flush=True)
        ours = side(args, module, "relay", case, env, pythons["relay"])
        print(f"{args.name} {case['case']}: {module.PEER} ...", flush=True)
        theirs = side(args, module, "peer", case, env, pythons["peer"])
        tolerance = module.LOSS_TOLERANCE
        if tolerance is not None:
            if (
                ours.first_loss is None
                or theirs.first_loss is None
                or abs(ours.first_loss - theirs.first_loss) > tolerance
            ):
                print(
                    f"{args.name} {case['case']}: the two sides do not do equal work: first-batch loss Relay "
                    f"{ours.first_loss} vs peer {theirs.first_loss} (tolerance {tolerance}); no row recorded",
                    file=sys.stderr,
                )
                failed += 1
                continue
        (rs, rr), (ps, pr) = harness.timed(ours, warmup), harness.timed(theirs, warmup)
        loss = (
            f"{ours.first_loss:.5f} / {theirs.first_loss:.5f}"
            if tolerance is not None
            else module.note(ours, theirs)
            if hasattr(module, "note")
            else f"n/a ({module.WHY_NO_LOSS})"
        )
        label = case["case"] + (" (quick)" if args.quick else "")
        row = harness.format_row(
            [
                harness.today(),
                args.name,
                label,
                figure(module, rs, rr),
                f"{module.PEER}: {figure(module, ps, pr)}",
                f"{rs / ps:.2f}x",
                f"{ours.peak_rss_mb:.0f}",
                f"{theirs.peak_rss_mb:.0f}",
                f"{ours.peak_rss_mb / theirs.peak_rss_mb:.2f}x",
                loss,
                machine,
                versions,
            ]
        )
        harness.append_row(Path(args.results), row)
        detail = Path(args.results).with_suffix(".jsonl")
        with detail.open("a") as fh:
            fh.write(
                json.dumps(
                    {
                        "date": harness.today(),
                        "comparison": args.name,
                        "case": case,
                        "quick": args.quick,
                        "machine": machine,
                        "versions": versions,
                        "relay": dataclasses.asdict(ours),
                        "peer": dataclasses.asdict(theirs),
                    }
                )
                + "\n"
            )
        print(row, flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--quick", action="store_true", help="tiny random model, few steps: checks the row's form")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--case", action="append", help="run only these cases (repeatable)")
    parser.add_argument("--results", default=str(harness.RESULTS), help="the markdown file the row is appended to")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--child", choices=("relay", "peer"), help=argparse.SUPPRESS)
    parser.add_argument("--env", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", dest="child_out", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    try:
        if args.child:
            args.case = args.case[0] if isinstance(args.case, list) else args.case
            return child(args)
        return compare(args)
    except harness.HarnessError as error:
        print(f"bench/run.py: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
