"""The ISA cap (pipeline/cpu_isa.py, bench/isa.py): the variables of each cap, how they apply, and
a real command run under the avx2 cap, checked against what torch, oneDNN and MKL report."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cpu_isa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import isa  # noqa: E402

# The banners torch 2.13's libraries print (oneDNN 3.12 with ONEDNN_VERBOSE=1, oneMKL 2024.0 with
# MKL_VERBOSE=1), captured on the Xeon of 2026-11-25 under ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2.
BANNERS = """aten: AVX2
MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 architecture Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors, Lnx 2.30GHz lp64 gnu_thread
MKL_VERBOSE SGEMM(N,N,64,64,64,0x7ffdb0113500,0x5601f29d5d00,64,0x5601f29cfe40,64,0x7ffdb0113520,0x5601f29d9d80,64) 114.77us CNR:OFF Dyn:1 FastMM:1 TID:0  NThr:1
onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71049cd69a3df32adcccb623b12cd7baa22)
onednn_verbose,v1,info,cpu,runtime:OpenMP,nthr:1
onednn_verbose,v1,info,cpu,isa:Intel AVX2
onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx2,forward_inference,src:f32::blocked:ab::f0 wei:f32::blocked:ab::f0 bia:undef::undef::: dst:f32::blocked:ab::f0,attr-scratchpad:user,,mb64ic64oc32,0.0310059
"""  # noqa: E501  (the libraries' lines, verbatim)


def test_each_cap_names_the_three_libraries_and_unknown_caps_are_refused():
    for name in ("avx2", "avx512"):
        assert set(cpu_isa.isa_env(name)) == {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"}
    assert cpu_isa.isa_env(" AVX2 ")["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert cpu_isa.isa_env("native") == {}
    with pytest.raises(ValueError, match="'sse4' is not a known cap; known: avx2, avx512, native"):
        cpu_isa.isa_env("sse4")


def test_apply_sets_the_cap_and_keeps_a_variable_set_by_hand():
    env = {"RELAY_CPU_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    assert cpu_isa.apply(env) == cpu_isa.isa_env("avx2")
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    untouched = {"PATH": "/bin"}
    assert cpu_isa.apply(untouched) == {} and untouched == {"PATH": "/bin"}
    # bench/isa.py's own environment: the cap wins over values already there
    capped = isa.capped_env("avx2", {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "HOME": "/h"})
    assert capped == {"HOME": "/h", "RELAY_CPU_ISA": "avx2", **cpu_isa.isa_env("avx2")}


def test_the_probe_reads_each_librarys_banner():
    seen = isa.parse_probe(BANNERS)
    assert seen == {
        "aten": "AVX2",
        "onednn": "Intel AVX2",
        "onednn_kernel": "brg_matmul:avx2",
        "mkl": "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors",
    }
    assert isa.problems("avx2", seen) == []
    wrong = seen | {"aten": "AVX512"}
    assert isa.problems("avx2", wrong) == ["ATen dispatches AVX512, not AVX2 (does this CPU have avx2?)"]
    assert isa.problems("avx512", seen)[1:] == [
        "oneDNN runs Intel AVX2, not AVX512",
        "MKL runs Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors, not AVX512",
    ]


# The same probe on a 2-core AMD EPYC (AVX-512) under the avx2 cap: MKL takes its generic path on a
# CPU it does not take for Intel's and names no instruction set; oneDNN still reports its level.
AMD_BANNERS = BANNERS.replace(
    "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors", "Intel(R) Architecture processors"
)


def test_a_library_that_names_no_isa_is_reported_as_not_checked_not_as_a_failure():
    seen = isa.parse_probe(AMD_BANNERS)
    assert seen["mkl"] == "Intel(R) Architecture processors"
    for cap in ("avx2", "avx512"):
        assert not any(line.startswith("MKL") for line in isa.problems(cap, seen))
        assert isa.unchecked(cap, seen) == [
            "MKL reports 'Intel(R) Architecture processors', no instruction set to "
            "hold the cap against (its generic path on a CPU it does not take for Intel's)"
        ]
    assert isa.problems("avx2", seen) == [] and isa.unchecked("native", seen) == []
    # a build without oneDNN (or MKL) prints no banner: said, not failed
    bare = {"aten": "AVX2"}
    assert isa.problems("avx2", bare) == []
    assert isa.unchecked("avx2", bare) == [
        "oneDNN printed no banner (not in this build, or it never ran)",
        "MKL printed no banner (not in this build, or it never ran)",
    ]
    # a real mismatch still fails, whoever made the CPU
    assert isa.problems(
        "avx2", seen | {"onednn": "Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions"}
    ) == ["oneDNN runs Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions, not AVX2"]
    assert (
        isa.problems("avx2", isa.parse_probe(BANNERS)) == [] and isa.unchecked("avx2", isa.parse_probe(BANNERS)) == []
    )


@pytest.mark.skipif(
    "avx2" not in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else True,
    reason="needs an x86 CPU with AVX2",
)
def test_a_command_under_the_avx2_cap_runs_on_avx2_kernels():
    """The real thing: bench/isa.py checks the cap in a probe, then the command (a fresh interpreter
    that never imports pipeline) sees ATen at AVX2 and oneDNN running no kernel above AVX2. Holds on
    Intel and AMD: MKL's banner names AVX2 on Intel's CPUs, and is said to be unchecked elsewhere."""
    code = (
        "import torch; a = torch.randn(8, 8); torch.ops.mkldnn._linear_pointwise(a, a, None, 'none', [], ''); "
        "print('cap', torch.backends.cpu.get_cpu_capability())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RELAY_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "isa.py"), "avx2", "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env | {"ONEDNN_VERBOSE": "1"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ISA cap avx2: ATen AVX2, oneDNN Intel AVX2 (" in proc.stderr
    assert (
        "MKL Intel(R) Advanced Vector Extensions 2" in proc.stderr or "bench/isa.py: not checked: MKL" in proc.stderr
    ), proc.stderr
    assert "cap AVX2" in proc.stdout
    kernel = re.search(r",inner_product,([^,]+),", proc.stdout).group(1)  # brg_matmul:avx2 on both vendors' CPUs
    assert "avx512" not in kernel and "amx" not in kernel, kernel
