"""Which CPU fast paths pay on this CPU: chosen by a one-time paired micro-measurement, cached per
machine.

    choice("train_onednn")    # Stage.fast_linears: oneDNN's kernel for training linears
    choice("decode_packed")   # decode: prepacked weights (and the engine's FastStep)
    choice("decode_fused")    # decode: q/k/v and gate/up as one product each

Whether oneDNN's fp32 kernel beats torch's default GEMM (MKL) depends on the CPU, not on Relay.
On an AVX-512 CPU it can be about twice as fast at training shapes and faster still at decode
shapes; on an AVX2-only CPU it may gain nothing at training shapes and still win at decode shapes
(bench/RESULTS.md). So each
path is timed against the plain one on the shapes of the embedded model (SmolLM2-135M: d=576,
MLP 1536, k/v 192, vocab 49152), A and B interleaved in one process so a busy machine slows both
alike, and taken where the speedup of the best runs reaches `MARGIN` (`decide`, pure).

The measurement (~1-3 s) runs once per machine key (CPU model and flags, torch version, the
dispatch level and ISA caps in force, threads) and is kept in $RELAY_CACHE/cpu_kernels/KEY.json
(a lock makes concurrent ranks measure once and agree). A record is only as good as the quiet it was
taken in: each keeps the load per core at its measurement, and one taken on a busy machine
(`BUSY`) is measured again by the first process that finds the machine quiet; one with an
implausible speedup (outside `PLAUSIBLE`: a neighbour's burst hit one side of a pair) is measured
again by the next process, up to `RETRIES` times (`stale`, pure). `bench/kernels.py` prints the
record, and `--remeasure` replaces it.
RELAY_CPU_ONEDNN, RELAY_DECODE_PACKED and RELAY_DECODE_FUSED override a path: 1 always, 0 never,
unset or `auto` by measurement.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from data_formats.cache import cache_root, exclusive
from pipeline.modeling.onednn_ops import OneDNNLinear, onednn_linear

PATHS = {
    "train_onednn": "RELAY_CPU_ONEDNN",
    "decode_packed": "RELAY_DECODE_PACKED",
    "decode_fused": "RELAY_DECODE_FUSED",
}
"""Each fast path and the variable that overrides its choice."""

MARGIN = 1.10
"""A path is taken where it is at least this much faster than the plain one (best runs, see
`paired_speedup`): below it the gain is within a busy machine's noise and not worth another summation order."""

BUSY = 0.5
"""Load per core (1-minute load average / cores) above which a measurement is provisional."""

PLAUSIBLE = (0.25, 4.0)
"""The speedups a kernel choice can really show here (oneDNN vs MKL measured 0.78x-3.3x on the CPUs
of bench/RESULTS.md); a value outside says the measurement was disturbed (a 24.5x was seen on a
busy machine), not that the path is that fast."""

RETRIES = 3
"""How many measurements in a row may come out implausible before the last one is kept as it is."""

HIDDEN, MLP, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
TRAIN_TOKENS, DECODE_ROWS = 256, 8


def decide(speedups: Mapping[str, float], margin: float = MARGIN) -> dict[str, bool]:
    """Per path, whether its measured speedup (plain time / fast time) pays. Fused siblings only
    matter on prepacked weights: without packing they are not taken."""
    out = {path: speedups.get(path, 0.0) >= margin for path in PATHS}
    out["decode_fused"] = out["decode_fused"] and out["decode_packed"]
    return out


def plausible(speedups: Mapping[str, float]) -> bool:
    """Whether every speedup lies in `PLAUSIBLE` (0.0, oneDNN missing, is plausible too)."""
    low, high = PLAUSIBLE
    return all(v == 0.0 or low <= v <= high for v in speedups.values())


def stale(record: Mapping, load_now: float) -> bool:
    """Whether a cached record should be measured again now: its speedups are implausible (fewer
    than `RETRIES` tries so far), or it was taken on a busy machine (or its load is unknown: a
    record from before loads were kept) and the machine is quiet now."""
    if not plausible(record["speedups"]):
        return record.get("tries", 1) < RETRIES
    return record.get("load", float("inf")) > BUSY and load_now <= BUSY


def load_per_core() -> float:
    """The 1-minute load average per core (0.0 where the OS does not tell)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return 0.0


def override(path: str, environ: Mapping[str, str] = os.environ) -> Optional[bool]:
    """The forced choice of `path` from its variable (1 on, 0 off), or None (measure).

    Raises:
        ValueError: a value other than 0, 1, auto or empty.
    """
    name = PATHS[path]
    value = environ.get(name, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 1 (always), 0 (never) or auto (by measurement)")
    return value == "1"


def machine_fields() -> dict:
    """What a measurement holds for: the same CPU, torch, dispatch level, ISA caps and threads."""
    model = flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "flags": hashlib.sha1(" ".join(sorted(flags.split())).encode()).hexdigest()[:12],
        "torch": torch.__version__,
        "aten": torch.backends.cpu.get_cpu_capability(),
        "caps": {k: os.environ.get(k, "") for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")},
        "threads": torch.get_num_threads(),
    }


def cache_file(fields: dict) -> Path:
    key = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "cpu_kernels" / f"{key}.json"


def paired_speedup(plain: Callable[[], object], fast: Callable[[], object], pairs: int = 7) -> float:
    """plain's best time / fast's best time over `pairs` runs of each, the two back to back in
    alternating order (after one warm-up each). The best of several runs is what a neighbour's
    burst of load cannot inflate (a median of paired ratios swung 0.76x-1.65x on a busy machine)."""
    plain(), fast()
    times: dict[str, list[float]] = {"plain": [], "fast": []}
    for i in range(pairs):
        for name, fn in (("plain", plain), ("fast", fast)) if i % 2 == 0 else (("fast", fast), ("plain", plain)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return min(times["plain"]) / max(min(times["fast"]), 1e-9)


def train_case() -> tuple[Callable, Callable]:
    """One MLP's up and down products forward and backward (both gradients), MKL vs oneDNN."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TRAIN_TOKENS, HIDDEN, generator=gen, requires_grad=True)
    up = torch.randn(MLP, HIDDEN, generator=gen).mul_(0.02).requires_grad_()
    down = torch.randn(HIDDEN, MLP, generator=gen).mul_(0.02).requires_grad_()

    def run(linear):
        def step():
            linear(linear(x, up, None), down, None).sum().backward()

        return step

    return run(torch.nn.functional.linear), run(OneDNNLinear.apply)


def decode_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)  # (the inputs below: same reason)
    shapes = {
        "q": (HIDDEN, HIDDEN),
        "k": (KV, HIDDEN),
        "v": (KV, HIDDEN),
        "o": (HIDDEN, HIDDEN),
        "gate": (MLP, HIDDEN),
        "up": (MLP, HIDDEN),
        "down": (HIDDEN, MLP),
        "head": (VOCAB, HIDDEN),
    }
    return {n: torch.randn(*s, generator=gen) for n, s in shapes.items()}


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's inputs to the products reading the hidden state and the MLP's activation."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(DECODE_ROWS, HIDDEN, generator=gen), torch.randn(DECODE_ROWS, MLP, generator=gen)


def decode_case(w: dict[str, torch.Tensor], fused: bool) -> Callable:
    """One decode step's products at DECODE_ROWS rows on prepacked weights: a layer's seven
    (LAYERS times) and the head, q/k/v and gate/up as one product each when `fused`."""
    pack = torch.ops.mkldnn._reorder_linear_weight
    groups = (
        [["q", "k", "v"], ["o"], ["gate", "up"], ["down"]]
        if fused
        else [[n] for n in ("q", "k", "v", "o", "gate", "up", "down")]
    )
    layer = [pack(torch.cat([w[n] for n in g])) for g in groups]
    head = pack(w["head"])
    x, wide = inputs()

    def step():
        with torch.no_grad():
            for _ in range(LAYERS):
                for packed in layer:
                    onednn_linear(wide if packed.shape[-1] == MLP else x, packed, None)
            onednn_linear(x, head, None)

    return step


def plain_decode_case(w: dict[str, torch.Tensor]) -> Callable:
    """The same step's products through torch's default GEMM on plain weights."""
    x, wide = inputs()
    layer = [w[n] for n in ("q", "k", "v", "o", "gate", "up", "down")]

    def step():
        with torch.no_grad():
            for _ in range(LAYERS):
                for weight in layer:
                    torch.nn.functional.linear(wide if weight.shape[-1] == MLP else x, weight)
            torch.nn.functional.linear(x, w["head"])

    return step


def measure() -> dict[str, float]:
    """Each path's paired speedup on this machine (see the module docstring); 0 where oneDNN is missing."""
    if not torch.backends.mkldnn.is_available():
        return {path: 0.0 for path in PATHS}
    # Whatever context asked (a generate under no_grad or inference_mode), the training case needs
    # autograd; every tensor comes from a private generator, so the caller's random stream is the
    # same whether this machine measured now or read its cache.
    with torch.inference_mode(False), torch.enable_grad():
        w = decode_weights()
        separate = decode_case(w, fused=False)
        return {
            "train_onednn": paired_speedup(*train_case()),
            "decode_packed": paired_speedup(plain_decode_case(w), separate),
            "decode_fused": paired_speedup(separate, decode_case(w, fused=True)),
        }


def measured(remeasure: bool = False) -> dict:
    """This machine's record {fields, speedups, choices, margin, measured_at}: read from its cache
    file, else (or with `remeasure`) measured and written, under a lock shared by concurrent ranks."""
    fields = machine_fields()
    path = cache_file(fields)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return _measured_in(path, fields, remeasure)
    except OSError:  # a read-only or full cache folder: measure for this process alone
        return _record(fields, measure(), load_per_core())


def _record(fields: dict, speedups: dict[str, float], load: float, tries: int = 1) -> dict:
    return {
        "fields": fields,
        "speedups": speedups,
        "choices": decide(speedups),
        "margin": MARGIN,
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load": round(load, 2),
        "tries": tries,
    }


def _measured_in(path: Path, fields: dict, remeasure: bool) -> dict:
    with exclusive(path.with_suffix(".lock")):
        load, tries = load_per_core(), 1
        if path.exists() and not remeasure:
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(path.read_text())
                if record["fields"] == fields:
                    if not stale(record, load):
                        return record
                    if not plausible(record["speedups"]):
                        tries = record.get("tries", 1) + 1
        record = _record(fields, measure(), load, tries)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
        return record


_CHOICES: dict[str, bool] = {}


def choice(path: str) -> bool:
    """Whether to take `path` here: its override, else this machine's measured choice (read once a
    process)."""
    forced = override(path)
    if forced is not None:
        return forced
    if not _CHOICES:
        _CHOICES.update(measured()["choices"])
    return _CHOICES[path]
