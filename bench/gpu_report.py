"""The GPU check's one result file: every GPU-marked test's outcome (from pytest's JUnit XML) and
the benchmarks' figures (bench/gpu.py's JSON), as markdown ready for bench/RESULTS.md.

    python bench/gpu_report.py --junit tests.xml --bench bench.json --log install.log --out gpu_check.md

A test skipped because it needs two GPUs is listed as "not run: needs 2 GPUs", never dropped.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import xml.etree.ElementTree as ET
from pathlib import Path

TWO_GPUS = ("two gpus", "2 gpus", "needs two", "fsdp needs two")


def test_outcomes(junit: Path) -> list[tuple[str, str, float]]:
    """(test id, outcome, seconds) of every test case in a JUnit XML file."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}".replace("tests/", "tests/", 1)
        seconds = float(case.get("time") or 0)
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            message = (failed.get("message") or failed.text or "").strip().splitlines()
            outcome = "FAILED: " + (message[0][:300] if message else "?")
        elif skipped is not None:
            reason = (skipped.get("message") or "").strip()
            outcome = "not run: needs 2 GPUs" if any(k in reason.lower() for k in TWO_GPUS) else f"skipped: {reason[:200]}"
        else:
            outcome = "passed"
        rows.append((test_id, outcome, seconds))
    return rows


def gb(mb) -> str:
    return f"{mb / 1024:.1f}" if isinstance(mb, (int, float)) else "-"


def pct(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-"


def side(cell: dict, key: str, fmt=lambda v: f"{v:,.0f}") -> str:
    if "error" in cell:
        return "error"
    if "not_run" in cell:
        return "not run"
    value = cell.get(key)
    return fmt(value) if isinstance(value, (int, float)) else "-"


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"


def sft_table(bench: dict) -> list[str]:
    lines = ["| mode | Relay tok/s | TRL tok/s | Relay / TRL tok/s | Relay MFU | TRL MFU | Relay peak GiB | TRL peak GiB "
             "| Relay / TRL memory | first loss Relay / TRL |", "|---" * 10 + "|"]
    for row in bench.get("sft", []) if isinstance(bench.get("sft"), list) else []:
        r, t = row.get("relay", {}), row.get("peer", {})
        loss = (f"{r['first_loss']:.4f} / {t['first_loss']:.4f}" + ("" if row.get("equal_work") else " (NOT equal work)")
                if isinstance(r.get("first_loss"), float) and isinstance(t.get("first_loss"), float) else "-")
        lines.append(f"| {row['mode']} | {side(r, 'tokens_per_s')} | {side(t, 'tokens_per_s')} | "
                     f"{ratio(r.get('tokens_per_s'), t.get('tokens_per_s'))} | {pct(r.get('mfu'))} | {pct(t.get('mfu'))} | "
                     f"{gb(r.get('gpu_peak_mb'))} | {gb(t.get('gpu_peak_mb'))} | {ratio(r.get('gpu_peak_mb'), t.get('gpu_peak_mb'))} | {loss} |")
    errors = [f"- {row['mode']} {name}: {row[key]['error']}" for row in bench.get("sft", [])
              for key, name in (("relay", "Relay"), ("peer", "TRL")) if "error" in row.get(key, {})
              ] if isinstance(bench.get("sft"), list) else [f"- SFT: not run ({bench.get('sft', {}).get('not_run', 'no result')})"]
    return lines + ([""] + errors if errors else [])


def bench_section(bench: dict) -> list[str]:
    if not bench:
        return ["No benchmark figures (bench/gpu.py did not run or wrote nothing)."]
    shape = bench.get("shape")
    lines = ["`--tiny` run: a tiny shape on this machine, checking the code paths; the figures mean nothing.", ""] if bench.get("tiny") else []
    lines += [f"Random-init {shape} ({bench.get('n_params', 0) / 1e6:.0f}M parameters), the embedded tokenizer, synthetic "
             f"two-turn conversations of ~500 tokens, 16 a step packed into rows of 2048, bf16, AdamW, sdpa; each side in its "
             f"own process. Peak dense bf16 taken as {bench.get('peak_bf16_tflops')} TFLOP/s. MFU = tokens/s x (6N full, 4N "
             "LoRA/QLoRA, + 12 L d T attention) / peak (bench/gpu.py). Peak memory: torch.cuda.max_memory_allocated.", ""]
    lines += sft_table(bench)
    q = bench.get("qlora_merge", {})
    lines += ["", f"- QLoRA on {q.get('shape', 'the 1.5B shape')}: " + (f"error: {q['error']}" if "error" in q else
              f"not run: {q['not_run']}" if "not_run" in q else
              f"{q.get('steps')} steps, losses {q.get('losses')}, merged: {q.get('merged')}, peak {gb(q.get('gpu_peak_mb'))} GiB, "
              f"{q.get('seconds')} s with load and merge")]
    for algo in ("ppo", "grpo"):
        r = bench.get(algo, {})
        lines.append(f"- {algo.upper()} (LoRA, bf16, {shape}): " + (f"error: {r['error']}" if "error" in r else
                     f"not run: {r['not_run']}" if "not_run" in r else
                     f"{r.get('s_per_step')} s/step, generation {pct(r.get('generation_share'))} of it, peak "
                     f"{gb(r.get('gpu_peak_mb'))} GiB (every step: {r.get('step_seconds')})"))
    g = bench.get("generate", {})
    if "rows" in g:
        lines += ["", f"Decoding ({shape}, {g.get('dtype')}, greedy, every row {g['rows'][0]['new_tokens']} new tokens; tok/s):", "",
                  "| batch | Relay, CUDA graph | Relay, model's own step | generate, dynamic cache | generate, static cache | graph vs dynamic |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['relay-graph']:,.0f} | {r['relay-eager']:,.0f} | {r['generate-dynamic']:,.0f} | "
                  f"{r['generate-static']:,.0f} | {r['relay-graph'] / r['generate-dynamic']:.2f}x |" for r in g["rows"]]
    else:
        lines.append(f"- Decoding: " + (f"error: {g['error']}" if "error" in g else f"not run: {g.get('not_run', 'no result')}"))
    return lines


def report(junits: list, bench_json, log, device: str, not_run=None, collected=None) -> str:
    bench = json.loads(Path(bench_json).read_text()) if bench_json and Path(bench_json).is_file() else {}
    device = bench.get("device") or device
    outcomes = [row for junit in junits or [] if Path(junit).is_file() for row in test_outcomes(Path(junit))]
    seen = {row[0] for row in outcomes}
    if collected and Path(collected).is_file():  # collected, then cut off by a time budget
        ids = dict.fromkeys(line.strip() for line in Path(collected).read_text().splitlines() if line.strip())
        outcomes += [(test_id, "not run: the tests' time budget was spent", 0.0) for test_id in ids if test_id not in seen]
    if not_run and Path(not_run).is_file():  # files the tests' time budget left no time for
        outcomes += [(line.rsplit(": ", 1)[-1], "not run: the tests' time budget was spent", 0.0)
                     for line in Path(not_run).read_text().splitlines() if line.strip()]
    two_gpus, no_time = "not run: needs 2 GPUs", "not run: the tests'"
    counts = {k: sum(1 for _, o, _ in outcomes if o.startswith(k)) for k in ("passed", "FAILED", two_gpus, no_time, "skipped")}
    late = f"; {counts[no_time]} test files not started (time budget)" if counts[no_time] else ""
    lines = [f"## GPU check, {_dt.date.today().isoformat()}, {device}", "",
             "Written by `bash run_scripts/gpu_check.sh` (README: GPU check). Versions: "
             + ", ".join(f"{k} {v}" for k, v in bench.get("versions", {}).items()), ""]
    if log and Path(log).is_file():
        kept = [line.strip() for line in Path(log).read_text().splitlines() if line.startswith(("relay runs on", "error", "install.sh"))]
        lines += ["Install: " + (" / ".join(kept) or "no version line (see install.log)"), ""]
    lines += [f"### GPU-marked tests: {counts['passed']} passed, {counts['FAILED']} failed, {counts[two_gpus]} not run "
              f"(need 2 GPUs), {counts['skipped']} skipped{late}", ""]
    if not outcomes:
        lines.append("No test results (pytest did not run or was stopped before writing its report).")
    else:
        lines += ["| test | result | s |", "|---|---|---|"] + [f"| {t} | {o.replace('|', '/')} | {s:.1f} |" for t, o, s in outcomes]
    return "\n".join(lines + ["", "### GPU benchmarks", ""] + bench_section(bench)) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", action="append", help="pytest's JUnit XML (repeatable)")
    parser.add_argument("--not-run", help="a file of lines 'not run (...): FILE' (test files never started)")
    parser.add_argument("--collected", help="every collected test id, one a line (bench/gpu_collect.py)")
    parser.add_argument("--bench")
    parser.add_argument("--log")
    parser.add_argument("--device", default="unknown device")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    text = report(args.junit, args.bench, args.log, args.device, args.not_run, args.collected)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
