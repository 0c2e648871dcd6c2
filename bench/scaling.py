"""How Relay's cost grows: step time and peak memory of SFT against sequence length and of PPO
against response length, the fitted lines, a PNG and a "## How cost grows" section.

    .venv/bin/python bench/scaling.py [--quick] [--threads N] [--results bench/RESULTS.md]

Relay only: the embedded model (`--quick`: the harness's tiny random Llama), LoRA, fp32, sdpa,
each point in its own process (so its peak RSS, VmHWM at the end of its last timed step, is that
point's alone), the mean over the steps after `WARMUP` warm-up step(s).

- SFT at seq_length T in 256, 512, 1024, 2048 with the tokens per step held at 2048 (batch
  8/4/2/1), 4 steps. The bundled SFT conversations are 30-150 tokens, so each point trains on
  conversations synthesised into a temporary file: exchanges of data/sample/sft/train chained
  into one multi-turn conversation until it renders (Relay's own renderer) to T tokens, the
  last answer topped up with words of the next ones and one-token fillers. Not packing: Relay's `pack` mode packs the
  samples of one micro-batch (it does not fill rows from the whole set) and swaps the causal
  mask for a block-causal 4-D one, a different attention path from the one long conversations
  take. Every sample is checked to have exactly T tokens.
- PPO at 16, 64, 256 new tokens: the bench/comparisons/ppo.py setup (one batch of 4
  data/sample/ppo prompts, a random reward head, one PPO epoch), every response exactly N
  tokens long (EOS suppressed until then), 3 steps.

Fits, least squares: SFT time = a + b*T. At a fixed number of tokens per step the projections,
MLP and LM head cost the same at every T (a), and attention, T^2 per sequence times
2048/T sequences, grows as T (b*T); the same form for peak memory. PPO time = a + b*N: each new
token costs one decode step plus its share of the scoring and update forwards (KV-cached
decoding and attention over prompt + response add a small N^2 term that three points cannot
separate; R^2 shows whether the line holds). R^2 with two points (`--quick`) is 1 by
construction.

Writes `scaling.png` and `scaling.json` (the points) next to the results file, and replaces (or
appends) its "## How cost grows" section.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

SECTION = "## How cost grows"
SFT_TOKENS = 2048
WARMUP = 1
SFT_DATA = ROOT / "data" / "sample" / "sft" / "train"
FILLERS = (".", " a", ",", "!")


@dataclasses.dataclass
class Point:
    """One measurement: `kind` sft (x = seq_length, batch = sequences per step) or ppo (x = new
    tokens per response, batch = prompts per step)."""

    kind: str
    x: int
    batch: int
    steps: int
    step_seconds: list = dataclasses.field(default_factory=list)
    step_tokens: list = dataclasses.field(default_factory=list)
    peak_rss_mb: float = 0.0

    @property
    def seconds(self) -> float:
        """Mean seconds per step after the warm-up."""
        timed = self.step_seconds[WARMUP:]
        return sum(timed) / len(timed) if timed else float("nan")

    @property
    def tokens(self) -> float:
        """Mean tokens per timed step (SFT: trained tokens; PPO: sampled tokens)."""
        timed = self.step_tokens[WARMUP:]
        return sum(timed) / len(timed) if timed else float("nan")


def plan(quick: bool) -> list[Point]:
    """The points: SFT seq 256..2048 at 2048 tokens/step and PPO 16/64/256 new tokens; quick:
    two of each on a tiny model (256 tokens/step)."""
    if quick:
        return [Point("sft", t, 256 // t, 2) for t in (64, 128)] + [Point("ppo", n, 2, 2) for n in (8, 16)]
    return [Point("sft", t, SFT_TOKENS // t, 4) for t in (256, 512, 1024, 2048)] + [
        Point("ppo", n, 4, 3) for n in (16, 64, 256)
    ]


# ------------------------------------------------------------------------------------------
# Long conversations for the SFT points
# ------------------------------------------------------------------------------------------


def exchanges(folder: Path = SFT_DATA) -> list[tuple[str, str]]:
    """Every (user, assistant) pair of the bundled SFT conversations, in file order."""
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rounds = json.loads(line)["chat_rounds"]
                out += [
                    (a["content"], b["content"])
                    for a, b in zip(rounds, rounds[1:])
                    if a["role"] == "human" and b["role"] == "bot"
                ]
    return out


def longest_fit(count: int, length, limit: int) -> int:
    """The largest k in 0..count with length(k) <= limit (length non-decreasing in k, length(0)
    <= limit): doubling, then bisection, so long candidates are rarely rendered."""
    lo, hi = 0, 1
    while hi < count and length(hi) <= limit:
        lo, hi = hi, hi * 2
    hi = min(hi, count)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(mid) <= limit else (lo, mid - 1)
    return lo


def long_conversation(
    pairs: Sequence[tuple[str, str]], start: int, seq_length: int, length
) -> tuple[list[tuple[str, str]], int]:
    """Exchanges pairs[start], pairs[start+1], ... (cyclically) whose conversation renders to
    `seq_length` tokens, the last answer topped up with words of the following answers and then
    with one-token fillers (one short only if none fits); and the index of the next unused exchange.
    `length(exchanges)` is the rendered length.

    Raises:
        harness.HarnessError: one exchange is already longer than seq_length.
    """
    at = lambda i: pairs[i % len(pairs)]  # noqa: E731
    n = longest_fit(len(pairs), lambda k: length([at(start + i) for i in range(k)]) if k else 0, seq_length)
    if n == 0:
        raise harness.HarnessError(f"scaling: one exchange of {SFT_DATA} is longer than seq_length {seq_length}")
    chosen = [at(start + i) for i in range(n)]
    words = " ".join(at(start + n + i)[1] for i in range(64)).split()
    topped = lambda k: chosen[:-1] + [(chosen[-1][0], " ".join([chosen[-1][1], *words[:k]]))]  # noqa: E731
    chosen = topped(longest_fit(len(words), lambda k: length(topped(k)), seq_length))
    while length(chosen) < seq_length:  # the last few tokens, one short filler at a time
        grown = [chosen[:-1] + [(chosen[-1][0], chosen[-1][1] + f)] for f in FILLERS]
        fitting = [g for g in grown if length(chosen) < length(g) <= seq_length]
        if not fitting:
            break
        chosen = fitting[0]
    return chosen, start + n


def write_conversations(path: Path, count: int, seq_length: int, tokenizer, template) -> list[int]:
    """`count` conversations of (at most, see long_conversation) seq_length tokens as chat_rounds JSONL at
    `path`; returns their rendered lengths."""
    from data_formats.conversation import Conversation, Turn
    from data_formats.render import render

    def length(chosen) -> int:
        turns = [Turn(role, text) for user, answer in chosen for role, text in (("user", user), ("assistant", answer))]
        return len(render(Conversation(turns), tokenizer, template)[0]) if turns else 0

    pairs, start, lengths, lines = exchanges(), 0, [], []
    for _ in range(count):
        chosen, start = long_conversation(pairs, start, seq_length, length)
        lengths.append(length(chosen))
        rounds = [
            {"role": role, "content": text}
            for user, answer in chosen
            for role, text in (("human", user), ("bot", answer))
        ]
        lines.append(json.dumps({"data_name": "synthetic", "chat_rounds": rounds}))
    path.write_text("\n".join(lines) + "\n")
    return lengths


# ------------------------------------------------------------------------------------------
# One point, in its own process
# ------------------------------------------------------------------------------------------


def timed_stage(stage_class, clock: harness.StepClock, before_first=None):
    """`stage_class` whose clock starts right before its first step (after `before_first(stage)`)."""

    class Timed(stage_class):
        def train_step(self):
            if clock.last is None:
                if before_first is not None:
                    before_first(self)
                clock.start()
            return super().train_step()

    return Timed


def sft_point(point: Point, env: harness.SideEnv) -> Point:
    """Relay's SFT stage on conversations of point.x tokens, point.batch per step.

    Raises:
        harness.HarnessError: the stage did not keep every synthesised conversation whole.
    """
    from data_formats.render import make_template
    from pipeline.modeling.models import load_tokenizer
    from stages import sft

    cfg = sft.SFTConfig(output_dir=str(Path(env.workdir) / f"sft-{point.x}"))
    cfg.model.path, cfg.model.finetuning, cfg.model.dtype, cfg.model.attn_implementation = (
        env.model,
        "lora",
        "fp32",
        "sdpa",
    )
    t = cfg.train
    t.seq_length, t.batch_size, t.max_steps, t.eval_steps, t.precision = point.x, point.batch, point.steps, 0, "fp32"
    t.lr_schedule, t.warmup = "constant", 0
    cfg.checkpoint.resume, cfg.tracking.trackers = False, []
    data = Path(env.workdir) / f"sft-{point.x}.jsonl"
    count = point.batch * point.steps
    tokenizer = load_tokenizer(env.model)
    write_conversations(data, count, point.x, tokenizer, make_template(cfg.data, tokenizer))
    cfg.data.train, cfg.data.eval = [str(data)], []
    clock = harness.StepClock()

    def check(stage) -> None:
        lengths = sorted(len(s["input_ids"]) for s in stage.train_samples)
        if lengths != [point.x] * count:
            found = f"{len(lengths)} of {lengths[0]}..{lengths[-1]} tokens" if lengths else "none"
            raise harness.HarnessError(
                f"scaling: sft {point.x}: the stage kept {found} (want {count} conversations of exactly {point.x})"
            )

    def on_step(stage, record) -> None:
        clock.mark(sum(len(stage.train_samples[i]["input_ids"]) for group in stage.step_indices for i in group))

    timed_stage(sft.SFTStage, clock, check)(cfg).run(on_step=on_step)
    return dataclasses.replace(point, step_seconds=clock.seconds, step_tokens=clock.tokens, peak_rss_mb=clock.rss)


def ppo_point(point: Point, env: harness.SideEnv) -> Point:
    """Relay's PPO stage, LoRA, point.batch prompts x exactly point.x new tokens per step
    (bench/comparisons/ppo.py's setup)."""
    from bench.comparisons import ppo as compared
    from stages import ppo

    case = {
        "case": f"scaling-{point.x}",
        "finetuning": "lora",
        "steps": point.steps,
        "batch": point.batch,
        "new_tokens": point.x,
        "epochs": 1,
    }
    cfg = compared.relay_config(case, env, compared.write_prompts(case, env, "scaling"))
    clock = harness.StepClock()

    def on_step(stage, record) -> None:
        clock.mark(int(stage.last_experience.rollout.response_mask.sum()))

    with harness.full_length_sampling():
        timed_stage(ppo.PPOStage, clock)(cfg).run(on_step=on_step)
    compared.check_generated("scaling", clock.tokens, case)
    return dataclasses.replace(point, step_seconds=clock.seconds, step_tokens=clock.tokens, peak_rss_mb=clock.rss)


def child(args) -> int:
    import torch

    point, env = Point(**json.loads(args.child)), harness.SideEnv(**json.loads(args.env))
    torch.set_num_threads(env.threads)
    measured = (sft_point if point.kind == "sft" else ppo_point)(point, env)
    Path(args.child_out).write_text(json.dumps(dataclasses.asdict(measured)))
    return 0


def run_point(point: Point, env: harness.SideEnv) -> Point:
    """Measure `point` in a fresh process (`--quick`: in this one).

    Raises:
        harness.HarnessError: the process failed (its last lines).
    """
    if env.quick:  # the form is what --quick checks: no process start per point (its RSS is not the point's own)
        import torch

        torch.set_num_threads(env.threads)
        return (sft_point if point.kind == "sft" else ppo_point)(point, env)
    out = Path(env.workdir) / f"point-{point.kind}-{point.x}.json"
    out.unlink(missing_ok=True)
    cmd = [
        str(harness.PYTHONS["relay"]),
        str(Path(__file__).resolve()),
        "--child",
        json.dumps(dataclasses.asdict(point)),
        "--env",
        json.dumps(dataclasses.asdict(env)),
        "--child-out",
        str(out),
    ]
    threads = str(env.threads)
    child_env = {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env, cwd=ROOT)
    if proc.returncode != 0 or not out.exists():
        tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()][-3:]
        raise harness.HarnessError(f"scaling {point.kind} {point.x}: exited {proc.returncode}: " + " | ".join(tail))
    return Point(**json.loads(out.read_text()))


# ------------------------------------------------------------------------------------------
# Fits, figure, section
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Fit:
    """y = a + b*x by least squares, with R^2 (None below two distinct x)."""

    a: float
    b: float
    r2: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Optional[Fit]:
    """Least-squares line through (xs, ys); None with fewer than two distinct xs."""
    import numpy as np

    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(set(xs)) < 2:
        return None
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)
    total = float(((y - y.mean()) ** 2).sum())
    residual = float(((y - (a + b * x)) ** 2).sum())
    return Fit(float(a), float(b), 1.0 - residual / total if total > 0 else 1.0)


def fits(points: Sequence[Point]) -> dict[tuple[str, str], Optional[Fit]]:
    """(kind, 'time' | 'memory') -> the line through that kind's points."""
    out = {}
    for kind in ("sft", "ppo"):
        mine = [p for p in points if p.kind == kind]
        out[(kind, "time")] = fit_line([p.x for p in mine], [p.seconds for p in mine])
        out[(kind, "memory")] = fit_line([p.x for p in mine], [p.peak_rss_mb for p in mine])
    return out


LABELS = {"sft": "SFT: seq_length T (tokens per step held constant)", "ppo": "PPO: new tokens N per response"}


def plot(points: Sequence[Point], lines: dict, path: Path) -> Optional[str]:
    """The 2x2 figure (SFT/PPO x time/memory, points and fitted lines) at `path`; a reason
    string instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed in .venv (pip install matplotlib), so no figure"
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for row, kind in enumerate(("sft", "ppo")):
        mine = sorted((p for p in points if p.kind == kind), key=lambda p: p.x)
        for col, (what, value, unit) in enumerate(
            (("time", lambda p: p.seconds, "s/step"), ("memory", lambda p: p.peak_rss_mb, "peak RSS MB"))
        ):
            ax = axes[row][col]
            ax.plot([p.x for p in mine], [value(p) for p in mine], "o", label="measured")
            line = lines.get((kind, what))
            if line is not None and mine:
                xs = [mine[0].x + (mine[-1].x - mine[0].x) * i / 50 for i in range(51)]
                ax.plot(xs, [line(x) for x in xs], "-", label=f"fit a + b*x (R^2 {line.r2:.3f})")
            ax.set_xlabel(LABELS[kind])
            ax.set_ylabel(unit)
            ax.set_ylim(0, 1.2 * max([value(p) for p in mine] or [1.0]))
            ax.set_xticks([p.x for p in mine], [str(p.x) for p in mine])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Relay: how step time and peak memory grow")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def fit_lines(points: Sequence[Point], lines: dict) -> list[str]:
    """The fits in words, with what part of the step the growing term is."""
    out = []
    for kind, x_name, per in (("sft", "T", "token of seq_length"), ("ppo", "N", "new token")):
        time_fit, memory_fit = lines[(kind, "time")], lines[(kind, "memory")]
        if time_fit is None:
            out.append(f"- {kind.upper()}: fewer than two points, no fit.")
            continue
        xs = sorted(p.x for p in points if p.kind == kind)
        share = ", ".join(f"{100 * time_fit.b * x / time_fit(x):.0f}% at {x_name}={x}" for x in (xs[0], xs[-1]))
        out.append(
            f"- {kind.upper()} step time = a + b*{x_name}: a = {time_fit.a:.3f} s, b = {1000 * time_fit.b:.3f} ms per "
            f"{per}, R^2 = {time_fit.r2:.4f}; the growing term b*{x_name} is {share} of the step."
        )
        out.append(
            f"- {kind.upper()} peak RSS = a + b*{x_name}: a = {memory_fit.a:.0f} MB, b = {memory_fit.b:.3f} MB per "
            f"{per}, R^2 = {memory_fit.r2:.4f}."
        )
    return out


def section(
    points: Sequence[Point], lines: dict, *, quick: bool, threads: int, png: Optional[str], why_no_png: Optional[str]
) -> str:
    """The markdown section (title line included)."""
    model = (
        "the harness's tiny random Llama (--quick: checks the form, not a figure)"
        if quick
        else "the embedded SmolLM2-135M-Instruct"
    )
    rows = ["| stage | x | batch | tokens/step | s/step | tokens/s | peak RSS MB |", "|---|---|---|---|---|---|---|"]
    for p in points:
        rate = p.tokens / p.seconds if p.seconds > 0 else float("nan")
        rows.append(
            f"| {p.kind.upper()} | {'T' if p.kind == 'sft' else 'N'}={p.x} | {p.batch} | {p.tokens:.0f} | "
            f"{p.seconds:.3f} | {rate:,.0f} | {p.peak_rss_mb:.0f} |"
        )
    text = [
        SECTION,
        f"`bench/scaling.py` ({_dt.date.today().isoformat()}; {harness.machine()}, {threads} threads; "
        f"{harness.versions(harness.PYTHONS['relay'])}). Relay only, {model}, LoRA, fp32, sdpa; each point in its own "
        "process; s/step is the mean over the steps after "
        f"{WARMUP} warm-up step(s), peak RSS the process's VmHWM at the end "
        "of its last timed step. SFT: synthesised multi-turn conversations of exactly T tokens (see the script's "
        "docstring for why not packing), tokens per step held constant; tokens/s "
        "counts trained-sequence tokens. PPO: one batch of data/sample/ppo prompts, every response exactly N tokens "
        "(EOS suppressed until then), one PPO epoch; tokens/s counts sampled tokens.",
        "",
    ]
    text += [f"![How cost grows]({png})" if png else f"(No figure: {why_no_png}.)", ""]
    text += rows + ["", "Fits (least squares; see the script's docstring for why these forms):", ""]
    text += fit_lines(points, lines)
    return "\n".join(text) + "\n"


def replace_section(path: Path, text: str) -> None:
    """Put `text` (a whole section) in place of `path`'s "## How cost grows", or append it."""
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    start = current.find(SECTION + "\n")
    if start < 0:
        path.write_text(current.rstrip("\n") + "\n\n" + text)
        return
    following = current.find("\n## ", start + len(SECTION))
    rest = "" if following < 0 else "\n" + current[following + 1 :]
    path.write_text(current[:start] + text + rest)


def select(points: list[Point], wanted: Optional[list[str]]) -> list[Point]:
    """The points named `kind:x` in `wanted` (all when None).

    Raises:
        harness.HarnessError: a name matches no point.
    """
    if not wanted:
        return points
    names = {f"{p.kind}:{p.x}": p for p in points}
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise harness.HarnessError(f"no point {', '.join(unknown)}; the points are {', '.join(names)}")
    return [names[w] for w in wanted]


def measure(args) -> int:
    env = harness.side_env(args.quick, args.workdir, args.threads, prefix="relay-scaling-")
    measured = []
    for point in select(plan(args.quick), args.point):
        print(f"scaling {point.kind} {point.x} ...", flush=True)
        measured.append(run_point(point, env))
        p = measured[-1]
        print(f"  {p.seconds:.3f} s/step, {p.tokens:.0f} tokens/step, peak RSS {p.peak_rss_mb:.0f} MB", flush=True)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    lines = fits(measured)
    png = results.with_name("scaling.png")
    why = plot(measured, lines, png)
    results.with_name("scaling.json").write_text(
        json.dumps(
            {
                "date": _dt.date.today().isoformat(),
                "quick": args.quick,
                "threads": args.threads,
                "machine": harness.machine(),
                "points": [dataclasses.asdict(p) | {"seconds": p.seconds, "tokens": p.tokens} for p in measured],
                "fits": {f"{k}/{w}": dataclasses.asdict(f) if f else None for (k, w), f in lines.items()},
            },
            indent=1,
        )
        + "\n"
    )
    text = section(
        measured, lines, quick=args.quick, threads=args.threads, png=None if why else png.name, why_no_png=why
    )
    replace_section(results, text)
    print(text, flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny random model, two points each: checks the form in seconds"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--results",
        default=str(harness.RESULTS),
        help="markdown file whose '## How cost grows' is replaced; scaling.png and scaling.json go next to it",
    )
    parser.add_argument("--point", action="append", help="measure only this point, e.g. sft:256 or ppo:16 (repeatable)")
    parser.add_argument("--workdir", default="")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--env", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", dest="child_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        return child(args) if args.child else measure(args)
    except harness.HarnessError as error:
        print(f"bench/scaling.py: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
