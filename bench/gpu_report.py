"""The GPU check's one result file, OUTDIR/gpu_check.md: each part's status against its budget, the
install (versions, Python headers), every GPU-marked test's outcome (from pytest's JUnit XML) and the
benchmarks' figures, as markdown ready for bench/RESULTS.md. bench/gpu.py keeps the run's state in
OUTDIR/state.json and writes the report again after every change, so a run cut off at any point
leaves the report of what it finished (`State`). Standard library only: it runs before the install.

    python bench/gpu_report.py --dir OUTDIR                # the report again from OUTDIR/state.json
    python bench/gpu_report.py --junit tests.xml --out gpu_check.md   # tests only

A test skipped because it needs two GPUs is listed as "not run: needs 2 GPUs", never dropped; one
a budget cut off (collected, never reported) as "not run: the part's time budget was spent", the
first of those as the one it ran out during.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as metadata
import json
import os
import statistics
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path

TWO_GPUS = ("two gpus", "2 gpus", "needs two", "fsdp needs two")
PACKAGES = ("torch", "transformers", "accelerate", "peft", "trl", "deepspeed", "bitsandbytes", "flash_attn", "vllm")
"""The distributions whose versions the report names (None: not installed)."""


def versions(packages=PACKAGES) -> dict:
    """{distribution: version or None} as this interpreter (and its PYTHONPATH) sees them."""
    out = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def python_headers() -> dict:
    """Whether this Python's C headers are there: DeepSpeed builds its CPU Adam (ZeRO-Offload's
    optimizer) against Python.h at first use, and fails mid-run without them."""
    include = Path(sysconfig.get_paths().get("include") or sysconfig.get_config_var("INCLUDEPY") or "")
    header = include / "Python.h"
    return {"python": sys.version.split()[0], "path": str(header), "found": header.is_file()}


def headers_line(h: dict) -> str:
    if h.get("found"):
        return f"Python {h['python']} headers: found ({h['path']}): DeepSpeed's CPU Adam can build"
    return (
        f"Python {h.get('python')} headers: MISSING "
        f"({h.get('path')} does not exist): DeepSpeed's CPU Adam (ZeRO-Offload) "
        f"cannot build here; install the python{'.'.join(str(h.get('python', '3')).split('.')[:2])}-dev package"
    )


CUT_OFF = "not run: the part's time budget ran out during this test"
SPENT = "not run: the part's time budget was spent"


def test_outcomes(junit: Path) -> list[tuple[str, str, float]]:
    """(test id, outcome, seconds) of every test case in a JUnit XML file. pytest stopped by the
    part's budget writes the test it interrupted as a case without a name: not a test's outcome
    (outcomes_of names that test)."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.get("name") is None:
            continue
        test_id = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}".replace("tests/", "tests/", 1)
        seconds = float(case.get("time") or 0)
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            message = (failed.get("message") or failed.text or "").strip().splitlines()
            outcome = "FAILED: " + (message[0][:300] if message else "?")
        elif skipped is not None:
            reason = (skipped.get("message") or "").strip()
            outcome = (
                "not run: needs 2 GPUs" if any(k in reason.lower() for k in TWO_GPUS) else f"skipped: {reason[:200]}"
            )
        else:
            outcome = "passed"
        rows.append((test_id, outcome, seconds))
    return rows


def outcomes_of(junit: Path, collected=None) -> list[tuple[str, str, float]]:
    """A tests part's outcomes: its JUnit XML where pytest wrote one, plus every collected test it
    never reported (the part's budget cut it off): the first of them was running when it did
    (tests run in the order collected)."""
    rows = test_outcomes(junit) if junit and Path(junit).is_file() else []
    seen = {row[0] for row in rows}
    if collected and Path(collected).is_file():
        ids = dict.fromkeys(line.strip() for line in Path(collected).read_text().splitlines() if line.strip())
        missing = [test_id for test_id in ids if test_id not in seen]
        rows += [(test_id, CUT_OFF if i == 0 else SPENT, 0.0) for i, test_id in enumerate(missing)]
    return rows


def tests_section(outcomes: list, title: str = "GPU-marked tests") -> list[str]:
    two_gpus, no_time = "not run: needs 2 GPUs", "not run: the"
    counts = {
        k: sum(1 for _, o, _ in outcomes if o.startswith(k)) for k in ("passed", "FAILED", two_gpus, no_time, "skipped")
    }
    late = f"; {counts[no_time]} not run (time budget)" if counts[no_time] else ""
    lines = [
        f"### {title}: {counts['passed']} passed, {counts['FAILED']} failed, {counts[two_gpus]} not run "
        f"(need 2 GPUs), {counts['skipped']} skipped{late}",
        "",
    ]
    if not outcomes:
        return lines + ["No test results (pytest did not run or was stopped before writing its report)."]
    return (
        lines
        + ["| test | result | s |", "|---|---|---|"]
        + [f"| {t} | {o.replace('|', '/')} | {s:.1f} |" for t, o, s in outcomes]
    )


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
    lines = [
        "| mode | Relay tok/s | TRL tok/s | Relay / TRL tok/s | Relay MFU | TRL MFU | Relay peak GiB | TRL peak GiB "
        "| Relay / TRL memory | first loss Relay / TRL |",
        "|---" * 10 + "|",
    ]
    for row in bench.get("sft", []) if isinstance(bench.get("sft"), list) else []:
        r, t = row.get("relay", {}), row.get("peer", {})
        loss = (
            f"{r['first_loss']:.4f} / {t['first_loss']:.4f}" + ("" if row.get("equal_work") else " (NOT equal work)")
            if isinstance(r.get("first_loss"), float) and isinstance(t.get("first_loss"), float)
            else "-"
        )
        lines.append(
            f"| {row['mode']} | {side(r, 'tokens_per_s')} | {side(t, 'tokens_per_s')} | "
            f"{ratio(r.get('tokens_per_s'), t.get('tokens_per_s'))} | {pct(r.get('mfu'))} | {pct(t.get('mfu'))} | "
            f"{gb(r.get('gpu_peak_mb'))} | {gb(t.get('gpu_peak_mb'))} | "
            f"{ratio(r.get('gpu_peak_mb'), t.get('gpu_peak_mb'))} | {loss} |"
        )
    errors = (
        [
            f"- {row['mode']} {name}: {row[key]['error']}"
            for row in bench.get("sft", [])
            for key, name in (("relay", "Relay"), ("peer", "TRL"))
            if "error" in row.get(key, {})
        ]
        if isinstance(bench.get("sft"), list)
        else [f"- SFT: not run ({bench.get('sft', {}).get('not_run', 'no result')})"]
    )
    return lines + ([""] + errors if errors else [])


def profile_lines(r: dict) -> list[str]:
    """The Relay-only SFT part: its figures and the profiled step's breakdown."""
    if "tokens_per_s" not in r:
        why = f"error: {r['error']}" if "error" in r else f"cut off {r['cut_off']}" if "cut_off" in r else "no figures"
        return [f"- Relay SFT full fine-tuning (profiled): {why}"]
    lines = [
        f"- Relay SFT full fine-tuning, {r.get('case', {}).get('precision', 'bf16')}, seq "
        f"{r.get('case', {}).get('seq_length')} "
        f"packed, {r.get('case', {}).get('batch_size')} samples a step: {side(r, 'tokens_per_s')} tok/s, "
        f"{r.get('s_per_step', '-')} s/step, MFU {pct(r.get('mfu'))}, peak {gb(r.get('gpu_peak_mb'))} GiB, "
        f"losses {r.get('losses')}" + (f" (cut off {r['cut_off']})" if "cut_off" in r else "")
    ]
    if r.get("step_seconds"):
        warmup = r.get("case", {}).get("warmup", 0)
        lines += [
            f"- Seconds of each step (the first {warmup} not timed): {r['step_seconds']}; median of the timed "
            f"{statistics.median(r['step_seconds'][warmup:] or r['step_seconds']):.3f} s"
        ]
    prof = r.get("profile")
    if prof:
        idle = (
            f", GPU idle {pct(prof['idle_share'])} of the step (host-bound time)"
            if prof.get("idle_share") is not None
            else ""
        )
        lines += [
            "",
            f"One profiled step: {prof['step_ms']:.1f} ms wall, {prof['busy_ms']:.1f} ms of {prof['clock']}{idle}.",
            "",
            "| where | ms | share |",
            "|---|---|---|",
        ]
        lines += [f"| {k} | {v['ms']:.1f} | {pct(v['share'])} |" for k, v in prof["categories"].items()]
        lines += ["", "Costliest: " + "; ".join(f"`{t['name'][:60]}` {t['ms']:.1f} ms" for t in prof["top"][:5])]
    return lines


def status_of(r: dict) -> str:
    return f"error: {r['error']}" if "error" in r else f"not run: {r['not_run']}" if "not_run" in r else ""


def bench_section(bench: dict) -> list[str]:
    """Markdown of the benchmarks present in `bench` (BENCH_KEYS' values); those absent are not this run's."""
    if not any(k in bench for k in BENCH_KEYS.values()):
        return ["No benchmark figures (none ran in this run, or none finished)."]
    shape = bench.get("shape") or "model"
    lines = (
        ["`--tiny` run: a tiny shape on this machine, checking the code paths; the figures mean nothing.", ""]
        if bench.get("tiny")
        else []
    )
    lines += [
        f"Random-init {shape} ({(bench.get('n_params') or 0) / 1e6:.0f}M "
        "parameters), the embedded tokenizer, synthetic "
        "two-turn conversations of ~500 tokens, 16 "
        "a step packed into rows of 2048, bf16, AdamW, sdpa. "
        + (
            f"Peak dense bf16 taken as {peak} TFLOP/s. MFU = tokens/s x (6N full, 4N LoRA/QLoRA, + 12 L d T "
            "attention) / peak (bench/gpu.py)."
            if (peak := bench.get("peak_bf16_tflops"))
            else "No MFU: bench/gpu.py knows no dense bf16 peak for this device."
        )
        + " Peak memory: torch.cuda.max_memory_allocated.",
        "",
    ]
    if "sft_profile" in bench:
        lines += profile_lines(bench["sft_profile"]) + [""]
    if "sft" in bench:
        lines += sft_table(bench) + [""]
    if "qlora_merge" in bench:
        q = bench["qlora_merge"]
        lines.append(
            f"- QLoRA on {q.get('shape', 'the 1.5B shape')}: "
            + (
                status_of(q)
                or f"{q.get('steps')} steps, losses {q.get('losses')}, merged: {q.get('merged')}, "
                f"peak {gb(q.get('gpu_peak_mb'))} GiB, "
                f"{q.get('seconds')} s with load and merge"
            )
        )
    for algo in ("ppo", "grpo"):
        if algo in bench:
            r = bench[algo]
            lines.append(
                f"- {algo.upper()} (LoRA, bf16, {shape}): "
                + (
                    status_of(r)
                    or f"{r.get('s_per_step')} s/step, generation {pct(r.get('generation_share'))} of it, peak "
                    f"{gb(r.get('gpu_peak_mb'))} GiB (every step: {r.get('step_seconds')})"
                )
            )
    if "grpo_vllm" in bench:
        r = bench["grpo_vllm"]
        lines.append(
            f"- GRPO (LoRA, bf16, {shape}) sampling on vLLM, its options the defaults: "
            + (
                status_of(r)
                or f"{(r.get('step_seconds') or ['-'])[0]} s the first step (the server starts in it), then "
                f"{r.get('s_per_step')} s/step, generation {pct(r.get('generation_share'))} of it, peak "
                f"{gb(r.get('gpu_peak_mb'))} GiB in the trainer (every step: {r.get('step_seconds')}; "
                f"{r.get('start_s')} s before the first); the engine's log-probs against the trainer's, "
                f"mean |diff| {r.get('logprob_diff_mean')}, max {r.get('logprob_diff_max')}"
            )
        )
    g, c = bench.get("generate", {}), bench.get("generate_compiled", {})
    static = {r["batch"]: r.get("generate-static") for r in c.get("rows", [])}
    if g.get("rows") or c.get("rows"):
        rows = g.get("rows") or [{"batch": r["batch"], "new_tokens": r["new_tokens"]} for r in c["rows"]]
        num = lambda v: f"{v:,.0f}" if isinstance(v, (int, float)) else "-"
        lines += [
            "",
            f"Decoding ({shape}, {g.get('dtype') or c.get('dtype')}, greedy, every row {rows[0]['new_tokens']} new "
            "tokens; tok/s; each side warmed up on the shapes it is timed on):",
            "",
            "| batch | Relay, CUDA graph | Relay, model's "
            "own step | generate, dynamic cache "
            "| generate, static cache (compiled) | graph vs dynamic |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['batch']} | {num(r.get('relay-graph'))} | {num(r.get('relay-eager'))} | "
            f"{num(r.get('generate-dynamic'))} | "
            f"{num(static.get(r['batch'], r.get('generate-static')))} | "
            f"{ratio(r.get('relay-graph'), r.get('generate-dynamic'))} |"
            for r in rows
        ]
        if c.get("warmup_s"):
            lines += [
                "",
                "Static cache: the warm-up call (compilation) took "
                + ", ".join(f"{k} {v} s" for k, v in c["warmup_s"].items()),
            ]
    for key in ("generate", "generate_compiled"):
        r = bench.get(key, {})
        if key in bench and not r.get("rows"):
            lines.append(
                f"- Decoding{' (compiled)' if key == 'generate_compiled' else ''}: " + (status_of(r) or "no result")
            )
        elif r.get("cut_off") or r.get("error"):
            lines.append(
                f"- Decoding{' (compiled)' if key == 'generate_compiled' else ''}: "
                + (f"cut off {r['cut_off']}" if r.get("cut_off") else f"error: {r['error']}")
            )
    return lines


BENCH_KEYS = {
    "sft-profile": "sft_profile",
    "sft-vs-trl": "sft",
    "qlora-merge": "qlora_merge",
    "ppo": "ppo",
    "grpo": "grpo",
    "grpo-vllm": "grpo_vllm",
    "decode": "generate",
    "decode-compiled": "generate_compiled",
}
"""bench/gpu.py's part -> the key its result has in bench_section."""


def report(junits: list, bench_json, log, device: str, not_run=None, collected=None) -> str:
    """Tests and benchmarks from files (the form before State): JUnit XMLs, a benchmarks JSON, an install log."""
    bench = json.loads(Path(bench_json).read_text()) if bench_json and Path(bench_json).is_file() else {}
    device = bench.get("device") or device
    outcomes = [row for junit in junits or [] for row in outcomes_of(Path(junit), collected)]
    if not_run and Path(not_run).is_file():
        outcomes += [
            (line.rsplit(": ", 1)[-1], SPENT, 0.0) for line in Path(not_run).read_text().splitlines() if line.strip()
        ]
    lines = [
        f"## GPU check, {_dt.date.today().isoformat()}, {device}",
        "",
        "Written by `bash run_scripts/gpu_check.sh` (README: GPU check).",
        "",
    ]
    if log and Path(log).is_file():
        kept = [
            line.strip()
            for line in Path(log).read_text().splitlines()
            if line.startswith(("relay runs on", "error", "install.sh"))
        ]
        lines += ["Install: " + (" / ".join(kept) or "no version line (see install.log)"), ""]
    return "\n".join(lines + tests_section(outcomes) + ["", "### GPU benchmarks", ""] + bench_section(bench)) + "\n"


class State:
    """The run's state in OUTDIR/state.json; every change writes it and OUTDIR/gpu_check.md again
    (each through a file renamed into place: a run killed mid-write keeps the previous version)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        path = self.out / "state.json"
        self.data = json.loads(path.read_text()) if path.is_file() else {"parts": {}, "bench": {}}

    def start(self, device: str, parts: list[str], total_s: float, tiny: bool) -> None:
        self.data.update(
            device=device,
            date=_dt.date.today().isoformat(),
            total_s=round(total_s),
            tiny=tiny,
            parts={name: {"status": "not started", "seconds": 0.0, "budget_s": None} for name in parts},
            bench={},
        )
        self.write()

    def record(self, part: str, status: str, seconds: float, budget_s: float) -> None:
        self.data["parts"][part] = {"status": status, "seconds": round(seconds, 1), "budget_s": budget_s}
        self.write()

    def install(self, log: Path, site=None) -> None:
        """Versions as the parts will see them (the bundle's site first), the headers, the compat line."""
        if site is not None:
            sys.path.insert(0, str(site))
        kept = (
            [
                line.strip()
                for line in Path(log).read_text(errors="replace").splitlines()
                if line.startswith(("relay runs on", "error", "install.sh"))
            ]
            if Path(log).is_file()
            else []
        )
        self.data["install"] = {"versions": versions(), "headers": python_headers(), "log": kept}
        self.write()

    def bench(self, part: str, result: dict) -> None:
        self.data["bench"][part] = result
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (
            ("state.json", json.dumps(self.data, indent=1) + "\n"),
            ("gpu_check.md", render(self.data, self.out)),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)


def render(data: dict, out: Path) -> str:
    """gpu_check.md from a run's state and the test parts' JUnit files under OUTDIR/junit."""
    parts = data.get("parts", {})
    spent = sum(p.get("seconds") or 0 for p in parts.values())
    lines = [
        f"## GPU check, {data.get('date', _dt.date.today().isoformat())}, {data.get('device', 'unknown device')}",
        "",
        f"Written by `bash run_scripts/gpu_check.sh` (README: GPU check) after every part; this run: "
        f"{', '.join(parts) or 'nothing yet'} ({data.get('total_s')} s of budgets, {spent:.0f} s spent so far).",
        "",
        "| part | status | s | budget s |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {p['status'].replace('|', '/')} | {p.get('seconds', 0):.0f} | {p.get('budget_s') or '-'} |"
        for name, p in parts.items()
    ]
    install = data.get("install")
    if install:
        v = install.get("versions", {})
        lines += [
            "",
            "Versions: " + ", ".join(f"{k} {v[k] or 'not installed'}" for k in v) + ".",
            "",
            headers_line(install.get("headers", {})) + ".",
        ]
        if install.get("log"):
            lines += ["", "Install: " + " / ".join(install["log"])]
    for name, p in parts.items():
        junit = out / "junit" / f"{name}.xml"
        collected = out / "junit" / f"{name}.collected"
        if junit.is_file() or collected.is_file():
            lines += [""] + tests_section(outcomes_of(junit, collected), f"Tests, {name}")
    bench = {BENCH_KEYS[k]: v for k, v in data.get("bench", {}).items() if k in BENCH_KEYS}
    notes = []
    if "sft" in bench:  # the part's result holds its rows, and how it ended
        notes = [
            f"- SFT vs TRL: {status_of(bench['sft']) or 'cut off ' + bench['sft']['cut_off']}"
            for _ in [0]
            if status_of(bench["sft"]) or bench["sft"].get("cut_off")
        ]
        bench["sft"] = bench["sft"].get("rows", [])
    if bench:
        first = next(iter(data["bench"].values()))
        bench.update({k: first.get(k) for k in ("shape", "n_params", "peak_bf16_tflops", "tiny")})
        lines += ["", "### GPU benchmarks", ""] + bench_section(bench) + notes
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="a check's OUTDIR: write its gpu_check.md again from state.json")
    parser.add_argument("--junit", action="append", help="pytest's JUnit XML (repeatable)")
    parser.add_argument("--not-run", help="a file of lines 'not run (...): FILE' (test files never started)")
    parser.add_argument("--collected", help="every collected test id, one a line (bench/gpu_collect.py)")
    parser.add_argument("--bench")
    parser.add_argument("--log")
    parser.add_argument("--device", default="unknown device")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.dir:
        State(Path(args.dir)).write()
        print((Path(args.dir) / "gpu_check.md").read_text())
        return 0
    if not args.out:
        parser.error("--out or --dir is required")
    text = report(args.junit, args.bench, args.log, args.device, args.not_run, args.collected)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
