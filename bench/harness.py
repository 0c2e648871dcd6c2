"""The benchmark harness behind `bench/run.py`: one comparison = Relay and a peer doing the same
work, each side in its own subprocess (so peak RSS is that side's alone), run one after the
other on the same machine, checked to do equal work (the same first-batch loss within
`loss_tolerance`) and recorded as one dated row of `bench/RESULTS.md`.

A comparison is a module in `bench/comparisons/` that provides:

    PEER: str                         the peer as the row names it ("TRL 1.16 SFTTrainer")
    PEER_PYTHON: str                  "relay" (the project's .venv) or "trl-1.12" (bench/.venv-trl)
    UNIT: str                         "tok/s" (throughput, higher is better) or "s/step"
    LOSS_TOLERANCE: float | None      None only where the first loss cannot be equal, with WHY_NO_LOSS
    def cases(quick: bool) -> list[dict]     JSON-able settings; "case" names the row
    def relay(case: dict, env: SideEnv) -> SideResult
    def peer(case: dict, env: SideEnv) -> SideResult

Timing: the mean over the timed steps (after `case["warmup"]` warm-up steps, default 1), so
start-up and the first step's allocations are left out on both sides; peak RSS is the process's
VmHWM read at the end of the last timed step (before any export/merge).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pipeline import cpu_isa

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
PYTHONS = {"relay": ROOT / ".venv" / "bin" / "python", "trl-1.12": ROOT / "bench" / ".venv-trl" / "bin" / "python"}
SECTION = "## Harness rows"
HEADER = (
    "| date | comparison | case | Relay | peer | time ratio | Relay RSS MB | peer RSS MB | RSS ratio "
    "| first loss Relay / peer | machine | versions |"
)


class HarnessError(RuntimeError):
    """A comparison could not run or its two sides did not do equal work (one line, no row)."""


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), MB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class SideEnv:
    """What a side gets: the model folder, a scratch folder, the thread count and whether quick."""

    model: str
    workdir: str
    threads: int
    quick: bool


@dataclass
class SideResult:
    """What a side measured. `step_seconds[i]` is optimizer step i's wall time; `step_tokens[i]`
    its real (non-padding) tokens where the unit is tok/s; `peak_rss_mb` at the end of the last
    timed step; `first_loss` the loss of the first batch before any update; `extra` free-form
    figures (phase times, settings) kept in the JSON next to RESULTS.md."""

    first_loss: Optional[float]
    step_seconds: list[float]
    peak_rss_mb: float
    step_tokens: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


class StepClock:
    """Marks step boundaries: `start()` before the first step, `mark(tokens)` after each."""

    def __init__(self) -> None:
        self.last: Optional[float] = None
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self.rss = 0.0
        self.gpu_peak_mb = 0.0

    def start(self) -> None:
        self.last = time.perf_counter()

    def mark(self, tokens: int = 0) -> None:
        torch = sys.modules.get("torch")
        on_gpu = torch is not None and torch.cuda.is_available()
        if on_gpu:  # a step's kernels may still run when the step returns: wait, or time is misplaced
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.last is not None:
            self.seconds.append(now - self.last)
            self.tokens.append(int(tokens))
            self.rss = peak_rss_mb()
            if on_gpu:
                self.gpu_peak_mb = max(self.gpu_peak_mb, torch.cuda.max_memory_allocated() / 2**20)
        self.last = now

    def result(self, first_loss: Optional[float], **extra) -> SideResult:
        if self.gpu_peak_mb:
            extra["gpu_peak_mb"] = round(self.gpu_peak_mb)
        return SideResult(first_loss, self.seconds, self.rss or peak_rss_mb(), self.tokens, extra)


def ensure_trl_112() -> Path:
    """bench/.venv-trl: a virtualenv whose own site-packages hold only trl 1.12.0 (TRL >= 1.13 has
    no PPO) in front of the project's .venv (a .pth line), so torch/transformers/peft are the very
    same on both sides. Created on first use (a few seconds, one small download).

    Raises:
        HarnessError: it could not be created (no package registry reachable, no .venv).
    """
    python = PYTHONS["trl-1.12"]
    check = [str(python), "-c", "import trl, sys; sys.exit(0 if trl.__version__ == '1.12.0' else 1)"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    main = PYTHONS["relay"]
    if not main.exists():
        raise HarnessError(f"{main} does not exist: run bash run_scripts/install.sh first")
    venv = python.parents[1]
    proc = subprocess.run(
        [str(main), "-m", "venv", "--without-pip", "--clear", str(venv)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise HarnessError(f"creating {venv} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    purelib = lambda py: subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib(python), "relay-main.pth").write_text(purelib(main) + "\n")
    proc = subprocess.run(
        [str(main), "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "trl==1.12.0"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or subprocess.run(check, capture_output=True).returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["trl 1.12.0 not importable"]
        raise HarnessError(f"installing trl==1.12.0 into {venv} failed: {tail[0]}")
    return python


TINY_VOCAB = ROOT / "tests" / "data" / "tiny_vocab.json"
"""The ids of the embedded tokenizer's vocabulary the tests' tiny models keep (tests/tinymodels.py)."""


def merges_by_result(model: dict) -> dict[str, list[str]]:
    """A BPE tokenizer.json model's merges by the token each makes (each token is made by one)."""
    return {"".join(m): m for m in model["merges"]}


def cut_tokenizer(listing: Path = TINY_VOCAB) -> Path:
    """A folder with the embedded tokenizer cut to the ids `listing` names ({"ids": [...]}),
    renumbered in their order (the special tokens keep theirs) and with the merges that make them;
    built once beside the embedded model in its cache."""
    import hashlib
    import shutil

    sys.path.insert(0, str(ROOT))
    from pipeline.modeling.embedded import materialize

    source = Path(materialize())
    text = listing.read_bytes()
    folder = source.parent / f"{source.name}-cut-{hashlib.sha256(text).hexdigest()[:12]}"
    if (folder / "tokenizer.json").is_file():
        return folder
    keep = json.loads(text)["ids"]
    tj = json.loads((source / "tokenizer.json").read_text())
    model = tj["model"]
    by_id = {i: t for t, i in model["vocab"].items()}
    new = {by_id[i]: n for n, i in enumerate(sorted(keep))}
    made = merges_by_result(model)
    missing = sorted({part for t in new if t in made for part in made[t] if part not in new})
    specials = [a["id"] for a in tj["added_tokens"]]
    if missing or specials != list(range(len(specials))) or not set(specials) <= set(keep):
        raise HarnessError(f"{listing} does not fit the embedded tokenizer ({len(missing)} parts missing)")
    model["vocab"] = new
    model["merges"] = [m for m in model["merges"] if "".join(m) in new]
    tmp = Path(tempfile.mkdtemp(dir=source.parent))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, tmp / name)
    (tmp / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    try:
        os.rename(tmp, folder)  # another process may have built it first
    except OSError:
        shutil.rmtree(tmp)
    return folder


def quick_model(workdir: Path) -> Path:
    """A tiny random-init Llama (2 layers, d=64) with the tests' tiny tokenizer (`cut_tokenizer`:
    the embedded one cut to the tests' text), for `--quick` (the smoke test checks the row's form,
    never a time)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pipeline.modeling.manifest import write_manifest

    path = workdir / "quick-model"
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(cut_tokenizer())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    write_manifest(path, stage="tiny-random", parent=None, config={"seed": 0})
    return path


def side_env(quick: bool, workdir: str, threads: int, prefix: str) -> SideEnv:
    """The SideEnv of a run: `workdir` (a fresh temporary folder when empty) and the model, the
    quick tiny model or the embedded one."""
    folder = Path(workdir or tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    if quick:
        model = str(quick_model(folder))
    else:
        sys.path.insert(0, str(ROOT))
        from pipeline.modeling.embedded import materialize

        model = str(materialize())
    return SideEnv(model=model, workdir=str(folder), threads=threads, quick=quick)


def relay_train_settings(cfg, optim: dict) -> None:
    """What every Relay side shares: fp32, AdamW with `optim` (lr, beta1, beta2, eps,
    weight_decay, max_grad_norm), a constant schedule without warm-up, no evaluation, no
    checkpoint resumed or saved during the run, no trackers."""
    t = cfg.train
    t.precision, t.learning_rate, t.lr_schedule, t.warmup, t.eval_steps = "fp32", optim["lr"], "constant", 0, 0
    t.beta1, t.beta2, t.epsilon = optim["beta1"], optim["beta2"], optim["eps"]
    t.weight_decay, t.max_grad_norm = optim["weight_decay"], optim["max_grad_norm"]
    cfg.checkpoint.resume, cfg.checkpoint.save_interval = False, "1000h"
    cfg.tracking.trackers = []


@contextlib.contextmanager
def full_length_sampling():
    """While open, Relay's generators (HFGenerator, RelayGenerator) sample exactly max_new_tokens
    tokens (EOS suppressed until then), so both sides of an RL comparison generate the same number of tokens; restored
    after, since `--quick` may run the peer in the same process.

    Raises:
        HarnessError: pipeline/rl/generators.py no longer builds its config with
            `sampling_config` (the benchmarks must follow it).
    """
    from pipeline.rl import generators

    original = getattr(generators, "sampling_config", None)
    if original is None:
        raise HarnessError(
            "pipeline.rl.generators.sampling_config is gone; update bench/harness.py full_length_sampling"
        )

    def fixed_length(max_new_tokens, *args, **kwargs):
        config = original(max_new_tokens, *args, **kwargs)
        config.min_new_tokens = max_new_tokens
        return config

    def relay_fixed_length(self, prompts):
        from pipeline.modeling.decode import generate

        return generate(
            self.model,
            prompts,
            max_new_tokens=self.max_new_tokens,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            temperature=self.temperature,
            min_new_tokens=self.max_new_tokens,
            keep_packed=False,
        ).tokens

    relay_original = generators.RelayGenerator.generate
    generators.sampling_config, generators.RelayGenerator.generate = fixed_length, relay_fixed_length
    try:
        yield
    finally:
        generators.sampling_config, generators.RelayGenerator.generate = original, relay_original


def run_side(name: str, side: str, case: dict, env: SideEnv, python: Path) -> SideResult:
    """Run one side of one case in a fresh process of `python`; its result comes back as JSON."""
    out = Path(env.workdir) / f"{side}-{case['case']}.json"
    out.unlink(missing_ok=True)
    cmd = [
        str(python),
        str(ROOT / "bench" / "run.py"),
        name,
        "--child",
        side,
        "--case",
        json.dumps(case),
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
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    }
    cpu_isa.apply(child_env)  # both sides under the same cap (the peer's process never imports pipeline)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env, cwd=ROOT)
    if proc.returncode != 0 or not out.exists():
        tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()][-3:]
        raise HarnessError(f"{name} {case['case']}: the {side} side exited {proc.returncode}: " + " | ".join(tail))
    return SideResult(**json.loads(out.read_text()))


def timed(result: SideResult, warmup: int) -> tuple[float, float]:
    """(mean seconds per timed step, real tokens per second over the timed steps).

    Raises:
        HarnessError: no step is left after the warm-up.
    """
    seconds = result.step_seconds[warmup:]
    if not seconds:
        raise HarnessError(f"{len(result.step_seconds)} steps ran, none left after {warmup} warm-up step(s)")
    tokens = result.step_tokens[warmup:]
    return sum(seconds) / len(seconds), (sum(tokens) / sum(seconds) if tokens and sum(seconds) > 0 else 0.0)


def machine() -> str:
    """CPU architecture, cores, native bf16/AMX, memory (or the GPU's name), and the ISA cap
    ($RELAY_CPU_ISA, bench/isa.py) where one is set."""
    flags = info = ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    except OSError:
        pass
    extras = [f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()]
    try:
        model = next(line for line in info.splitlines() if line.startswith("model name")).split(":", 1)[1].strip()
    except (NameError, StopIteration):
        model = ""
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        mem = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1]) / 2**20
    except (OSError, StopIteration):
        mem = 0
    cap = os.environ.get("RELAY_CPU_ISA", "")
    capped = f", ISA capped to {cap}" if cap and cap != "native" else ""
    return (
        f"{model + ' ' if model else ''}{platform.machine()} {os.cpu_count()} cores"
        f"{' ' + '+'.join(extras) if extras else ''} {mem:.0f} GiB{capped}"
    )


def versions(python: Path) -> str:
    """torch/transformers/peft/trl versions as `python` sees them."""
    code = (
        "import importlib.metadata as m; print(' '.join(f'{p} {m.version(p)}' "
        "for p in ('torch', 'transformers', 'peft', 'trl')))"
    )
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def format_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in cells) + " |"


def append_row(path: Path, row: str) -> None:
    """Append `row` to the harness table of `path` (created with its header when missing);
    sections after it are kept in place."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION not in text:
        text = text.rstrip("\n") + (
            f"\n\n{SECTION}\nOne row per `python bench/run.py NAME` run (see bench/harness.py). "
            "Time ratio: Relay's seconds per step / the peer's, on equal work (< 1: Relay faster); "
            "RSS ratio: peak resident memory, Relay / peer.\n\n"
            f"{HEADER}\n" + "|---" * (HEADER.count("|") - 1) + "|\n"
        )
    start = text.index(SECTION)
    following = text.find("\n## ", start + len(SECTION))
    end = len(text) if following < 0 else following + 1
    body = text[start:end].rstrip("\n") + "\n" + row + "\n"
    path.write_text(text[:start] + body + ("\n" + text[end:] if following >= 0 else ""))


def today() -> str:
    return _dt.date.today().isoformat()


def stream_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s, STREAM's "copy" kernel: b[:] = a over two arrays far larger than
    any cache, counting the bytes read and written; the best of `repeats` (the machine's figure,
    not its noise). The arrays are filled first: untouched pages all map to one zero page."""
    import torch

    a = torch.rand(megabytes * 2**20 // 4)
    b = torch.rand_like(a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() * a.element_size() / best
