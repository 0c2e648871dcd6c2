"""Freed host memory kept in the process (pipeline/host_memory.py): a Relay process re-allocating a
large block touches pages it already has (no minor page faults, counted by the kernel's getrusage),
where glibc's own behaviour faults every page in again; the opt-out, and a bad value in one line."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline import host_memory

ROOT = Path(__file__).resolve().parents[1]
SIZE = 64 << 20
PAGES = SIZE // 4096

# Allocate, touch every page and free a 64 MiB block twice after importing pipeline; print the minor
# page faults of the second round (the kernel's own count). Plain Python, no torch: a cheap process.
ROUNDS = textwrap.dedent(
    f"""
    import resource, pipeline
    def round_():
        block = bytearray({SIZE})
        for i in range(0, {SIZE}, 4096):
            block[i] = 1
        del block
    round_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    round_()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != host_memory.ENV}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60
    )


needs_glibc = pytest.mark.skipif(host_memory.glibc() is None, reason="the C library is not glibc")


@needs_glibc
def test_a_relay_process_reuses_freed_memory_without_faulting_its_pages_in_again():
    kept = run(ROUNDS)
    system = run(ROUNDS, RELAY_HOST_MALLOC="system")
    assert kept.returncode == 0 and system.returncode == 0, kept.stderr + system.stderr
    # glibc's default maps the block afresh: every page faults again; kept, the heap's pages are reused.
    assert int(system.stdout) >= 0.9 * PAGES, system.stdout
    assert int(kept.stdout) <= 0.05 * PAGES, kept.stdout


@needs_glibc
def test_threads_still_get_blocks_larger_than_an_arena_when_large_blocks_come_from_the_heap():
    # A thread's own arena holds at most 64 MiB; glibc must fall back to a mapping of its own there.
    code = textwrap.dedent(
        """
        import threading, pipeline
        sizes = []
        def work():
            for _ in range(2):
                block = bytearray(200 << 20)
                block[-1] = 1
                sizes.append(len(block))
        threads = [threading.Thread(target=work) for _ in range(4)]
        [t.start() for t in threads]
        work()
        [t.join() for t in threads]
        print(len(sizes))
        """
    )
    out = run(code)
    assert out.returncode == 0 and out.stdout.strip() == "10", out.stderr


def test_the_choice_and_its_default():
    assert host_memory.choice({}) == "keep"
    assert host_memory.choice({"RELAY_HOST_MALLOC": " System "}) == "system"
    assert host_memory.apply({"RELAY_HOST_MALLOC": "system"}) is False
    with pytest.raises(ValueError, match="RELAY_HOST_MALLOC='mmap' is not one of: keep, system"):
        host_memory.choice({"RELAY_HOST_MALLOC": "mmap"})


def test_a_bad_value_ends_a_relay_process_in_one_line():
    for env, message in (
        ({"RELAY_HOST_MALLOC": "mmap"}, "relay: RELAY_HOST_MALLOC='mmap' is not one of: keep, system"),
        ({"RELAY_CPU_ISA": "sse4"}, "relay: RELAY_CPU_ISA='sse4' is not a known cap; known: avx2, avx512, native"),
    ):
        out = run("import pipeline", **env)
        assert out.returncode == 1 and out.stderr.strip() == message, out.stderr
