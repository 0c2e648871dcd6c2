"""One packed SFT micro-batch at seq 2048 before and after per-document attention moved to the
model's side: the batch the collator ships (a [B, 1, T, T] mask built on the host, or [B, T]
segment ids), the time to collate it, one forward + backward through the step's own loss
(`weighted_token_losses`), and the peak resident memory of a step whose micro-batches are all
collated up front (as `LanguageModelStage.micro_batches` does), each variant in a fresh process.
Also the share of attention blocks flex attention skips with the document BlockMask.

    python bench/packing_attention.py [--before REV] [--rows 2] [--docs 4] [--micro 4] [--attn sdpa]

"before" is the collator of git revision REV (default: the parent of the commit that moved the
mask), loaded from git; "after" is this tree's. The model is the tiny test shape (2 layers, d=64,
the embedded tokenizer's 49152-token vocabulary), fp32, on this CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ = 2048


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def collate_module(rev: str | None):
    """data_formats.collate at git revision `rev` (None: this tree's)."""
    if rev is None:
        from data_formats import collate

        return collate
    source = subprocess.run(
        ["git", "show", f"{rev}:data_formats/collate.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType("collate_before")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{rev}:data_formats/collate.py", "exec"), module.__dict__)
    return module


def variant(args) -> dict:
    """One variant in this process: its figures."""
    import torch
    from transformers import LlamaForCausalLM

    from pipeline.engine.steps import weighted_token_losses

    sys.path.insert(0, str(ROOT / "tests"))
    from tinymodels import tiny_config

    torch.manual_seed(0)
    collate = collate_module(args.before if args.variant == "before" else None)
    doc = SEQ // args.docs
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(args.rows * args.micro):
        ids = torch.randint(10, 40000, (SEQ,), generator=g).tolist()
        # SFT-like: each document's last 64 tokens are its answer, the rest its prompt.
        labels = [t if i % doc >= doc - 64 else -100 for i, t in enumerate(ids)]
        rows.append({"input_ids": ids, "labels": labels, "lengths": [doc] * args.docs, "task_ids": [0] * SEQ})
    collator = collate.Collator(0, "pack", SEQ, args.attn)
    model = LlamaForCausalLM(tiny_config(49152, 0)).to(torch.float32)
    model.config._attn_implementation = args.attn
    started = time.perf_counter()
    batches = [collator(rows[i * args.rows : (i + 1) * args.rows]) for i in range(args.micro)]
    collate_ms = (time.perf_counter() - started) * 1000 / args.micro
    shipped = sum(t.numel() * t.element_size() for t in batches[0].values())
    ones = torch.ones(1)
    weighted_token_losses(model, batches[0], ones)[0].backward()  # warm-up
    model.zero_grad(set_to_none=True)
    times = []
    for batch in batches:
        started = time.perf_counter()
        weighted_token_losses(model, batch, ones)[0].backward()
        times.append(time.perf_counter() - started)
    return {
        "variant": args.variant,
        "attn": args.attn,
        "rows": args.rows,
        "docs_per_row": args.docs,
        "micro_batches": args.micro,
        "batch_mib": shipped / 2**20,
        "collate_ms": collate_ms,
        "step_ms_median": sorted(times)[len(times) // 2] * 1000,
        "peak_rss_mib": vm_hwm_mb(),
    }


def block_sparsity(rows: int, docs: int) -> float:
    """Share of the 128 x 128 attention blocks flex attention skips (document BlockMask)."""
    import torch

    from pipeline.modeling.attention import document_block_mask

    segments = torch.arange(docs).repeat_interleave(SEQ // docs).expand(rows, SEQ).contiguous()
    return document_block_mask(segments).sparsity() / 100


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=None, help="git revision of the old collator")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--variant", choices=("before", "after"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.variant:
        print(json.dumps(variant(args)))
        return 0
    if args.before is None:
        found = subprocess.run(
            ["git", "log", "-1", "--format=%H", "-S", 'segment_ids"] = segments', "--", "data_formats/collate.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        args.before = f"{found}^"
    results = []
    for name in ("before", "after"):
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            name,
            "--before",
            args.before,
            "--rows",
            str(args.rows),
            "--docs",
            str(args.docs),
            "--micro",
            str(args.micro),
            "--attn",
            args.attn,
        ]
        results.append(
            json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        )
    results.append({"flex_blocks_skipped": block_sparsity(args.rows, args.docs)})
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
