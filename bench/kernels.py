"""This machine's CPU kernel choices and the paired micro-benchmark behind them.

    .venv/bin/python bench/kernels.py                  # the cached choice (measured on first use)
    .venv/bin/python bench/kernels.py --remeasure      # measure again and replace the cache
    .venv/bin/python bench/kernels.py --shapes         # GFLOP/s per shape, torch (MKL) vs oneDNN
    .venv/bin/python bench/isa.py avx2 -- .venv/bin/python bench/kernels.py --shapes --remeasure

The choice is pipeline/modeling/cpu_kernels.py's (`decide`: a path is taken where the speedup of
its best runs reaches MARGIN). `--shapes` times each product both ways, interleaved in this one
process (A, B, B, A, ...), and reports each side's best run (what a busy neighbour cannot inflate).
`--append` adds the `--shapes` rows to bench/RESULTS.md's "CPU kernel choices" table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from pipeline.modeling import cpu_kernels as ck  # noqa: E402
from pipeline.modeling.onednn import OneDNNLinear, onednn_linear  # noqa: E402

SECTION = "## CPU kernel choices (issue 33)"
HEADER = "| date | machine | shape | torch (MKL) GFLOP/s | oneDNN GFLOP/s | oneDNN / torch | choice |"


def paired_times(a, b, pairs: int = 9) -> tuple[float, float]:
    """Best seconds of `a` and of `b`, run back to back in alternating order after a warm-up."""
    a(), b()
    ta, tb = [], []
    for i in range(pairs):
        for fn, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return min(ta), min(tb)


def shapes() -> list[tuple[str, str, float, float]]:
    """(shape, path, torch GFLOP/s, oneDNN GFLOP/s) for the products each choice rests on."""
    rows = []
    n, d, f = ck.TRAIN_TOKENS, ck.HIDDEN, ck.MLP
    x = torch.randn(n, d, requires_grad=True)
    w = (torch.randn(f, d) * 0.02).requires_grad_()

    def train(linear):
        return lambda: linear(x, w, None).sum().backward()

    t_mkl, t_dnn = paired_times(train(torch.nn.functional.linear), train(OneDNNLinear.apply))
    flops = 3 * 2 * n * d * f  # forward, input gradient, weight gradient
    rows.append((f"train fwd+bwd {n}x{d} @ {d}x{f}", "train_onednn", flops / t_mkl / 1e9, flops / t_dnn / 1e9))
    with torch.no_grad():
        for name, out in (("decode MLP up", f), ("decode LM head", ck.VOCAB)):
            weight = torch.randn(out, d)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            xs = torch.randn(ck.DECODE_ROWS, d)
            t_mkl, t_dnn = paired_times(
                lambda: torch.nn.functional.linear(xs, weight), lambda: onednn_linear(xs, packed, None)
            )
            flops = 2 * ck.DECODE_ROWS * d * out
            rows.append(
                (
                    f"{name} {ck.DECODE_ROWS}x{d} @ {d}x{out} (packed)",
                    "decode_packed",
                    flops / t_mkl / 1e9,
                    flops / t_dnn / 1e9,
                )
            )
    return rows


def table_rows(record: dict, measured_shapes: list) -> list[str]:
    machine = f"{harness.machine()}, {torch.get_num_threads()} threads, ATen {record['fields']['aten']}"
    out = []
    for shape, path, mkl, dnn in measured_shapes:
        out.append(
            harness.format_row(
                [
                    harness.today(),
                    machine,
                    shape,
                    f"{mkl:.0f}",
                    f"{dnn:.0f}",
                    f"{dnn / mkl:.2f}",
                    f"{path}: {'taken' if record['choices'][path] else 'not taken'}",
                ]
            )
        )
    speedups = ", ".join(f"{k} {v:.2f}x" for k, v in record["speedups"].items())
    out.append(
        harness.format_row([harness.today(), machine, "paired speedups (cpu_kernels.measure)", "", "", "", speedups])
    )
    return out


def append(rows: list[str], path: Path = harness.RESULTS) -> None:
    """Add `rows` at the end of the SECTION table of `path` (the section and its header made on first use)."""
    lines = path.read_text().splitlines()
    if SECTION not in lines:
        lines += [
            "",
            SECTION,
            "",
            "Rows from `bench/kernels.py --append` (see its docstring).",
            "",
            HEADER,
            "|" + "---|" * (HEADER.count("|") - 1),
        ]
    at = lines.index(SECTION)
    end = next((i for i in range(at + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    last = max(i for i in range(at, end) if lines[i].startswith("|"))
    lines[last + 1 : last + 1] = rows
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--remeasure", action="store_true", help="measure again and replace this machine's cached choice"
    )
    parser.add_argument("--shapes", action="store_true", help="also time each shape both ways (GFLOP/s)")
    parser.add_argument("--append", action="store_true", help="append the --shapes rows to bench/RESULTS.md")
    args = parser.parse_args(argv)
    record = ck.measured(remeasure=args.remeasure)
    print(json.dumps(record, indent=1))
    if args.shapes or args.append:
        rows = table_rows(record, shapes())
        print("\n".join([HEADER] + rows))
        if args.append:
            append(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
