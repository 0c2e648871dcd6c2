"""`relay serve` batching: 8 concurrent short requests vs one, through HTTP with the openai client.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/bench_serve.py \\
        [--model embedded] [--rounds 3] [--tokens 32]

`relay serve` runs in its own process (127.0.0.1, a free port) on the given model. Each round
times one request alone, then 8 identical-length requests sent at once from 8 threads (greedy,
`max_tokens` fixed, EOS ignored by asking for a long story and checking completion_tokens); the
two sides are interleaved round by round so both see the same machine load. The figure is the
median time of 8 concurrent / median time of 1 (the issue's goal: <= 1.5 with batching; without
batching it would be about 8). On a shared CPU keep OMP_NUM_THREADS at or below the free cores:
oversubscribed OpenMP threads spin against the server's event-loop thread and make every figure
meaningless (measured here: one tiny-model request 1.5 s with 2 threads on a loaded 2-core machine,
0.12 s with 1).

Measured on the shared 2-core development machine (load average ~7 from other jobs; to be
re-measured on an idle machine or a GPU), OMP_NUM_THREADS=1, 32 new tokens each, medians of 3
interleaved rounds: embedded SmolLM2-135M 8 concurrent / 1 = 6.92 / 3.24 s = 2.14x, and in a later
run (slices of 32 tokens, less load) 4.62 / 2.07 s = 2.23x (one at a time would be ~8x); tiny
2-layer model 0.29 / 0.12 s = 2.34x. On CPU the 8 prompts' prefill and the 8
rows' matmuls are compute-bound; the issue's <= 1.5x is a GPU figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

PROMPTS = [
    f"Write a long story about a {animal} who learns to sail."
    for animal in ("cat", "dog", "fox", "owl", "bear", "wolf", "hare", "crow")
]


def start(model: str, max_batch: int, port: int) -> tuple[object, subprocess.Popen]:
    """(openai client, server process): `relay serve` in its own process, as users run it."""
    import openai

    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.tools.serve",
            model,
            "--name",
            "bench",
            "--backend",
            "transformers",
            "--port",
            str(port),
            "--max-batch",
            str(max_batch),
            "--dtype",
            "fp32",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    for _ in range(600):
        try:
            client.models.list()
            return client, server
        except openai.APIConnectionError:
            assert server.poll() is None, "relay serve exited"
            time.sleep(0.2)
    raise TimeoutError("relay serve did not start in 120 s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed(client, prompts: list[str], tokens: int) -> tuple[float, list[int]]:
    """(wall seconds, completion tokens of each) for `prompts` sent at once."""

    def one(prompt: str) -> int:
        answer = client.chat.completions.create(
            model="bench", messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0
        )
        return answer.usage.completion_tokens

    begin = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        counts = list(pool.map(one, prompts))
    return time.perf_counter() - begin, counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    args = parser.parse_args()
    client, server = start(args.model, args.max_batch, free_port())
    timed(client, PROMPTS[:1], 4)  # warm-up
    single, batch = [], []
    for _ in range(args.rounds):
        seconds, counts = timed(client, PROMPTS[:1], args.tokens)
        single.append(seconds)
        seconds, counts8 = timed(client, PROMPTS, args.tokens)
        batch.append(seconds)
        print(
            f"1 request: {single[-1]:.2f} s ({counts[0]} tokens); 8 concurrent: {batch[-1]:.2f} s ({counts8} tokens)",
            flush=True,
        )
    server.terminate()
    server.wait(timeout=30)
    ratio = statistics.median(batch) / statistics.median(single)
    print(
        f"model {args.model}, {args.tokens} new tokens each, torch threads {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {platform.processor() or platform.machine()}: "
        f"8 concurrent / 1 = {statistics.median(batch):.2f} / {statistics.median(single):.2f} s = {ratio:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
