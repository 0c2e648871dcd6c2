"""Run any command with the CPU instruction set capped, after checking the cap took effect.

    .venv/bin/python bench/isa.py avx2                                    # check and report only
    .venv/bin/python bench/isa.py avx2 -- bash run_scripts/demo.sh        # the demo as on an AVX2 CPU
    .venv/bin/python bench/isa.py avx2 -- bash run_scripts/test.sh        # the suite
    .venv/bin/python bench/isa.py avx2 -- .venv/bin/python bench/run.py sft   # a harness case
    .venv/bin/python bench/isa.py avx2 -- .venv/bin/python bench/kernels.py   # the kernel micro-bench

CAP is a key of pipeline.cpu_isa.ISA_ENV (avx2, avx512, native). The command inherits
RELAY_CPU_ISA=CAP and the three variables that cap ATen, oneDNN and MKL (they win over values
already set). Before it runs, a fresh interpreter reports what each library really uses (ATen's
dispatch level, oneDNN's and MKL's verbose banners); a cap that did not take (a CPU without that
ISA, a library that ignores it) ends with status 2 and one line, the command not run. A library
whose level cannot be read is named on a "not checked" line and does not stop the command: MKL on
a CPU it does not take for Intel's (AMD's) runs its generic path, reports "Intel(R) Architecture
processors" whatever the cap, and does not read MKL_ENABLE_INSTRUCTIONS; a build without oneDNN or
MKL prints no banner at all.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.cpu_isa import isa_env  # noqa: E402

PROBE = """
import torch
print("aten:", torch.backends.cpu.get_cpu_capability(), flush=True)
a = torch.randn(32, 32)
torch.mm(a, a)
if torch.backends.mkldnn.is_available():
    torch.ops.mkldnn._linear_pointwise(a, a, None, "none", [], "")
"""


def parse_probe(text: str) -> dict[str, str]:
    """What each library reported in the probe's output: {'aten': 'AVX2', 'onednn': 'Intel AVX2',
    'mkl': 'Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors', 'onednn_kernel':
    'brg_matmul:avx2'}; a library that said nothing is absent."""
    found = {}
    patterns = {
        "aten": r"^aten: (\S+)",
        "onednn": r"onednn_verbose,[^\n]*?,cpu,isa:([^\n]+)",
        "mkl": r"MKL_VERBOSE oneMKL[^\n]*? architecture ([^\n]*?), Lnx",
        "onednn_kernel": r",inner_product,([^,]+),",
    }
    for key, pattern in patterns.items():
        match = re.search(pattern, text, re.MULTILINE)
        if match:
            found[key] = match.group(1).strip()
    return found


def expected_aten(cap: str) -> str:
    """ATen's dispatch level a cap should give (`torch.backends.cpu.get_cpu_capability()`)."""
    return isa_env(cap).get("ATEN_CPU_CAPABILITY", "").upper()


def names_an_isa(banner: str) -> bool:
    """Whether a library's banner names an instruction set (MKL's generic path names none)."""
    return re.search(r"AVX|SSE|AMX|NEON|SVE", banner.upper()) is not None


def unchecked(cap: str, seen: dict[str, str]) -> list[str]:
    """What the probe could not check under `cap`, one line each; nothing under `native` (no cap)."""
    if not expected_aten(cap):
        return []
    out = []
    for key, name in (("onednn", "oneDNN"), ("mkl", "MKL")):
        if key not in seen:
            out.append(f"{name} printed no banner (not in this build, or it never ran)")
        elif not names_an_isa(seen[key]):
            out.append(
                f"{name} reports {seen[key]!r}, no instruction set to hold the cap against "
                f"(its generic path on a CPU it does not take for Intel's)"
            )
    return out


def problems(cap: str, seen: dict[str, str]) -> list[str]:
    """Why the cap did not take, one line each (nothing when it did); a library whose banner names no
    instruction set is not a problem but `unchecked`."""
    want = expected_aten(cap)
    out = []
    if want and seen.get("aten") != want:
        out.append(f"ATen dispatches {seen.get('aten', 'nothing')}, not {want} (does this CPU have {cap}?)")
    if (
        want
        and "onednn" in seen
        and names_an_isa(seen["onednn"])
        and want not in seen["onednn"].upper().replace(" ", "")
    ):
        if not (want == "AVX512" and "AVX512" in seen["onednn"].upper().replace(" ", "").replace("-", "")):
            out.append(f"oneDNN runs {seen['onednn']}, not {want}")
    if (
        want
        and "mkl" in seen
        and names_an_isa(seen["mkl"])
        and want.replace("AVX512", "AVX-512") not in seen["mkl"].upper()
    ):
        out.append(f"MKL runs {seen['mkl']}, not {want}")
    return out


def capped_env(cap: str, base: dict[str, str]) -> dict[str, str]:
    """`base` with RELAY_CPU_ISA=cap and the cap's variables set (replacing any already there)."""
    env = dict(base)
    for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(key, None)
    env.update(isa_env(cap), RELAY_CPU_ISA=cap)
    return env


def probe(env: dict[str, str]) -> dict[str, str]:
    """Run PROBE in a fresh interpreter under `env` with oneDNN's and MKL's verbose on."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=env | {"ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1", "OMP_NUM_THREADS": "1"},
    )
    return parse_probe(proc.stdout + proc.stderr)


def main(argv: list[str]) -> int:
    command = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="bench/isa.py CAP [-- COMMAND ...]")
    parser.add_argument("cap", help="avx2, avx512 or native")
    args = parser.parse_args(argv)
    try:
        env = capped_env(args.cap, dict(os.environ))
    except ValueError as err:
        print(f"bench/isa.py: {err}", file=sys.stderr)
        return 2
    seen = probe(env)
    print(
        f"ISA cap {args.cap}: ATen {seen.get('aten', '?')}, oneDNN {seen.get('onednn', '?')} "
        f"({seen.get('onednn_kernel', '?')}), MKL {seen.get('mkl', '?')}",
        file=sys.stderr,
        flush=True,
    )
    for line in unchecked(args.cap, seen):
        print(f"bench/isa.py: not checked: {line}", file=sys.stderr, flush=True)
    bad = problems(args.cap, seen)
    if bad:
        print(f"bench/isa.py: the {args.cap} cap did not take: {'; '.join(bad)}", file=sys.stderr)
        return 2
    if not command:
        return 0
    os.execvpe(command[0], command, env)
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
