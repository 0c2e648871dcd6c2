"""The GPU check's parts (run_scripts/gpu_check.sh): install, benchmarks on random-init models of
Qwen2.5's real shapes (no download, the embedded model's tokenizer, synthetic multi-turn SFT data)
and the GPU-marked tests, each under a time budget of its own, most informative first.

    python bench/gpu.py check --out OUTDIR [--bundle DIR] [--parts first] [--tiny]   # what gpu_check.sh runs
    python bench/gpu.py plan [--bundle DIR]                                           # the dry run

A run is one device window (10 minutes): RUNS name the parts of each, the first being what says most
about how Relay trains on that GPU, every run's budgets summing to at most RUN_LIMIT_S. After each
part OUTDIR/gpu_check.md is written again (bench/gpu_report.py), so a run cut off at any point
leaves a report of everything finished; the part that was cut off says so.

- sft-profile: Relay's SFT stage alone, full fine-tuning in bf16 on the 0.5B shape, seq 2048, packed:
  tokens/s, MFU, peak GPU memory, and torch.profiler's breakdown of one step (GEMMs, attention,
  optimizer, ...; the share of the step the GPU sat idle, i.e. host-bound).
- sft-vs-trl: Relay's SFT stage and TRL's SFTTrainer on the very same packs (bench/comparisons/sft.py,
  equal first loss within GPU_LOSS_TOLERANCE), full / LoRA / QLoRA, each side in its own process.
- qlora-merge: QLoRA on the 1.5B shape trains a few steps and merges (the stage's own export).
- ppo, grpo: LoRA, bf16 on the 0.5B shape: seconds per step and the share spent generating.
- grpo-vllm: the same GRPO sampling on a vLLM server (generation.backend vllm, its other options
  the defaults; where vLLM is installed: run_scripts/install_vllm.sh): the first step (the server
  starts in it), seconds per step, the share spent generating, the engine's log-probs against the
  trainer's.
- decode: batch 1/8/32 x 128 new tokens, greedy, nothing compiled: Relay's engine with its CUDA graph
  and with the model's own step, transformers' `generate` with its dynamic cache. decode-compiled:
  `generate` with its static cache, which transformers compiles: warmed up on the very shapes it
  is timed on, the compile's seconds reported apart.

MFU = tokens/s x FLOPs per token / the GPU's dense bf16 peak (PEAK_BF16_TFLOPS, by device name).
FLOPs per token = 6N (full: forward 2N, backward 4N) or 4N (LoRA/QLoRA: frozen weights get no
weight gradient) + 12 L d T attention (scores and values, forward and backward, L layers, width d,
T = seq_length as if every position attended to a full row: packing's block-diagonal mask makes
the real attention work smaller, so the figure is the common upper convention). N counts every
parameter once (the tied 152k head is a real matmul). `--tiny` runs the same code on a tiny shape,
on whatever device is there (the CPU test of this file's code paths; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_report, harness  # noqa: E402
from pipeline.modeling.vllm_server import vllm_python  # noqa: E402


@dataclass(frozen=True)
class Part:
    """One part of the GPU check: `tests` (pytest arguments) for a tests part, else a benchmark or
    the install. `gpus`: a part that only skips below that many GPUs is not started there."""

    name: str
    run: str
    budget_s: int
    what: str
    tests: str = ""
    gpus: int = 1
    vllm: bool = False
    """Runs on a vLLM server: not started where vLLM is absent (pipeline/modeling/vllm_server.py `vllm_python`)."""


VLLM_ABSENT = "vLLM is absent (bash run_scripts/install_vllm.sh)"
RUN_LIMIT_S = 480
"""A run's budgets (with STARTUP_S) add up to at most this: 8 of a device window's 10 minutes, the
rest for the machine's start, the copy of the tree and the report coming back."""
STARTUP_S = 10
"""The check's own start before its first part (the CUDA probe, the device line)."""
RUNS = ("first", "second", "third", "fourth")
"""GPU_CHECK_PARTS=first (the default), second, third or fourth runs that run's parts; part names also work."""
PARTS = [
    Part(
        "install",
        "every",
        50,
        "install from the bundle (or the environment as it is); versions of torch, "
        "transformers, accelerate, peft, trl, deepspeed, "
        "bitsandbytes, flash-attn; Python headers for DeepSpeed's CPU Adam",
    ),
    Part(
        "sft-profile",
        "first",
        90,
        "Relay SFT alone, full fine-tuning bf16 on the Qwen2.5-0.5B shape, seq 2048 packed: "
        "tokens/s, MFU, peak GPU memory, a profiler breakdown of one step",
    ),
    Part(
        "gpu-tests",
        "first",
        130,
        "packed == unpacked on CUDA sdpa (fp32, bf16); PPO (fp32, bf16) and GRPO (bf16) on CUDA; "
        "the decode engine's CUDA graph == the model's own step (fp32, bf16); "
        "FSDP on one rank: checkpoint gather/scatter, stopped + resumed == unbroken == plain one GPU",
        tests="tests/test_gpu.py",
    ),
    Part(
        "fsdp-tests",
        "first",
        110,
        "FSDP2 on one rank on CUDA (nccl), the code path CPU ranks run over gloo: every stage == "
        "one process == DDP, stopped + resumed == unbroken, the data cursor across batch splits",
        tests="tests/test_fsdp.py",
    ),
    Part(
        "decode",
        "first",
        80,
        "decoding on the 0.5B shape in bf16, batch 1/8/32 x 128 tokens, nothing compiled: the "
        "engine's CUDA graph, the engine on the model's own step, transformers' generate (dynamic cache)",
    ),
    Part(
        "zero-tests",
        "second",
        230,
        "ZeRO-2, ZeRO-2 offload, ZeRO-3, ZeRO-3 offload == one GPU (SFT, RM, grad_accum 1 and 4); PPO "
        "under ZeRO-3 == one GPU; QLoRA under ZeRO-2 tracks one GPU; bf16 tracks fp32; resuming "
        "ZeRO refused up front (two launches: the references, then every DeepSpeed run)",
        tests="tests/test_distributed_gpu.py",
    ),
    Part(
        "qlora-tests",
        "second",
        60,
        "QLoRA: nf4 double-quant base on CUDA, only LoRA trains, the adapter merges into the full-precision base",
        tests="tests/test_qlora.py",
    ),
    Part(
        "vllm-tests",
        "second",
        60,
        "vLLM (where installed: bash run_scripts/install_vllm.sh): sleep mode frees the engine's "
        "GPU memory during the update and it wakes following the LoRA policy; tensor_parallel_size 2 on two GPUs",
        tests="tests/test_vllm_gpu.py",
    ),
    Part(
        "fsdp-2gpu-tests",
        "second",
        60,
        "FSDP on two ranks == one process; stopped and resumed == unbroken",
        tests="tests/test_distributed_stages.py -k fsdp",
        gpus=2,
    ),
    Part(
        "sft-vs-trl",
        "third",
        180,
        "SFT full/LoRA/QLoRA bf16 packed seq 2048 on the 0.5B shape, Relay vs TRL SFTTrainer on "
        "the same packs with equal first loss: tokens/s, MFU, peak GPU memory",
    ),
    Part(
        "qlora-merge",
        "third",
        100,
        "QLoRA on the Qwen2.5-1.5B shape trains 3 steps and merges (the stage's own export)",
    ),
    Part("ppo", "third", 60, "PPO (LoRA, bf16, 0.5B shape): seconds per step, generation share"),
    Part("grpo", "third", 60, "GRPO (LoRA, bf16, 0.5B shape): seconds per step, generation share"),
    Part(
        "decode-compiled",
        "fourth",
        150,
        "transformers' generate with its static cache (compiled), warmed up on the shapes it "
        "is timed on, batch 1/8/32 x 128 tokens; the compile's seconds apart",
    ),
    Part(
        "grpo-vllm",
        "fourth",
        180,
        "GRPO (LoRA, bf16, 0.5B shape) sampling on a vLLM server, its options the defaults (where "
        "vLLM is installed): the first step (the server starts in it), seconds per step, generation "
        "share, the engine's log-probs against the trainer's",
        vllm=True,
    ),
]
"""Every part, in the order a run takes them (the most informative first)."""
GPU_TESTS = [(part.tests, part.what) for part in PARTS if part.tests]
"""(pytest arguments, what it proves): every GPU-marked test file or selection, in the check's order."""
SHAPES = {
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
}
"""Qwen2.5-0.5B and -1.5B's published configs (architecture only; weights random); `tiny` for --tiny runs,
with heads of 32 (the smallest vLLM's CPU attention runs: grpo-vllm)."""
PEAK_BF16_TFLOPS = [
    ("H200", 989.0),
    ("GH200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("L4", 121.0),
]
"""Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, matched in order against
the device name (so "H100 PCIe" wins over "H100", the SXM part)."""
GPU_LOSS_TOLERANCE = 2e-2
"""bf16 on both sides: first-batch losses (~ln 151936 = 11.9 on a random model) agree to ~1e-3; 2e-2 is the bound."""
SFT_MODES = ("full", "lora", "qlora")


def peak_tflops(device: str):
    """The dense bf16 peak of `device` in TFLOP/s, or None when unknown."""
    return next((peak for name, peak in PEAK_BF16_TFLOPS if name.lower() in device.lower()), None)


def flops_per_token(shape: dict, n_params: int, seq: int, mode: str) -> float:
    """Model FLOPs per trained token (module docstring)."""
    weights = (6 if mode == "full" else 4) * n_params
    return weights + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq


def make_model(shape_name: str, folder: Path, tokenizer_dir: Path) -> tuple[Path, int]:
    """A random-init Qwen2 of `shape_name` in bf16 with the embedded tokenizer; (folder, parameters)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(
        **SHAPES[shape_name],
        max_position_embeddings=32768,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = (
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
    )
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    from pipeline.modeling.manifest import write_manifest

    write_manifest(folder, stage="random-init", parent=None, config={"shape": shape_name, "seed": 0})
    del model
    return folder, n_params


WORDS = (
    "atlas river harbour lantern market granite orchard signal copper meadow winter quarry beacon tide ledger "
    "compass ember willow canyon falcon garnet meridian pylon thistle"
).split()


def write_sft_data(path: Path, samples: int, words: int, seed: int = 0) -> Path:
    """`samples` two-turn conversations of about `words` words each (seeded), Relay's SFT format."""
    rng = random.Random(seed)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n)) + "."
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for i in range(samples):
            rounds = [
                {"role": "human", "content": text(words // 4)},
                {"role": "bot", "content": text(words // 4)},
                {"role": "human", "content": text(words // 8)},
                {"role": "bot", "content": text(3 * words // 8)},
            ]
            fh.write(json.dumps({"id": i, "data_name": "synthetic", "chat_rounds": rounds}) + "\n")
    return path


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (no CUDA device)"


class Budget:
    """Seconds left of a part's time budget; parts past it are listed as not run."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class _Stop(Exception):
    """Raised after the last measured step: the stage's final save and merge are not measured."""


def sft_case(mode: str, tiny: bool, data: Path, cuda: bool) -> dict:
    """One SFT case of bench/comparisons/sft.py at the GPU settings: 16 samples of ~500 tokens a
    step packed into rows of 2048 (about 4 rows, 8k tokens a step)."""
    steps, warmup = (3, 1) if tiny else (10, 2)
    return {
        "case": f"{mode}-packing-gpu",
        "finetuning": mode,
        "padding": "packing",
        "steps": steps,
        "warmup": warmup,
        "batch_size": 4 if tiny else 16,
        "seq_length": 256 if tiny else 2048,
        "seed": 42,
        "gc": False,
        "precision": "bf16" if cuda else "fp32",
        "data": str(data),
    }


def side_figures(result: harness.SideResult, case: dict, shape: dict, n_params: int, peak) -> dict:
    """tokens/s, s/step, MFU, peak GPU memory and first loss of one side."""
    seconds, rate = harness.timed(result, case["warmup"])
    flops = flops_per_token(shape, n_params, case["seq_length"], case["finetuning"])
    return {
        "tokens_per_s": round(rate, 1),
        "s_per_step": round(seconds, 4),
        "first_loss": result.first_loss,
        "mfu": round(rate * flops / (peak * 1e12), 4) if peak else None,
        "gpu_peak_mb": result.extra.get("gpu_peak_mb"),
        "flops_per_token": flops,
    }


def bench_sft(
    model: Path,
    n_params: int,
    shape: dict,
    data: Path,
    workdir: Path,
    budget: Budget,
    tiny: bool,
    save=lambda rows: None,
) -> list[dict]:
    """Relay vs TRL, each in its own process, for every SFT mode while the budget lasts; `save(rows)`
    after each mode, so a part cut off keeps the modes it measured."""
    import torch

    cuda, peak = torch.cuda.is_available(), peak_tflops(device_name())
    env = harness.SideEnv(model=str(model), workdir=str(workdir), threads=os.cpu_count() or 1, quick=False)
    rows = []
    for mode in SFT_MODES:
        case, row = sft_case(mode, tiny, data, cuda), {"mode": mode}
        for side, name in (("relay", "Relay SFT"), ("peer", "TRL SFTTrainer")):
            if budget.left() < (0 if tiny else 25):
                row[side] = {"not_run": "the part's time budget was spent"}
                continue
            try:
                result = harness.run_side("sft", side, case, env, Path(sys.executable))
                row[side] = side_figures(result, case, shape, n_params, peak)
            except harness.HarnessError as err:
                row[side] = {"error": str(err)[-600:]}
            print(f"sft {mode} {name}: {row[side]}", flush=True)
        ours, theirs = row["relay"].get("first_loss"), row["peer"].get("first_loss")
        row["equal_work"] = None if ours is None or theirs is None else abs(ours - theirs) <= GPU_LOSS_TOLERANCE
        rows.append(row)
        save(rows)
    return rows


CATEGORIES = [
    (
        "matmul (GEMM)",
        ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "linear"),
    ),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "lerp", "_amp_")),
    ("softmax / cross-entropy", ("softmax", "cross_entropy", "nll", "logsumexp")),
    ("copies / casts / fills", ("copy", "memcpy", "memset", "fill", "cast", "cat", "to_copy", "clone")),
    ("norms / activations / elementwise", ()),
]
"""Kernel (or CPU op) name fragments of each line of the profiler breakdown; the last takes the rest.
cuBLAS's GEMMs on Hopper with CUDA 13 are `nvjet_sm90_*` kernels (bench/RESULTS.md, the first GPU check)."""


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), CATEGORIES[-1][0])


def breakdown(events: list[tuple[str, float]], step_ms: float, on_gpu: bool) -> dict:
    """One profiled step: `events` as (kernel name, self device ms) on a GPU, (CPU op, self CPU ms)
    elsewhere. Per category ms and share of the busy time, the ten costliest names, and on a GPU the
    share of the step's wall time it sat idle (launches, host syncs, Python: host-bound work)."""
    busy = sum(ms for _, ms in events)
    per: dict[str, float] = {}
    for name, ms in events:
        per[category(name)] = per.get(category(name), 0.0) + ms
    top = sorted(events, key=lambda e: -e[1])[:10]
    return {
        "step_ms": round(step_ms, 2),
        "busy_ms": round(busy, 2),
        "clock": "GPU kernels" if on_gpu else "CPU ops (self time)",
        "idle_share": round(max(0.0, 1 - busy / step_ms), 3) if on_gpu and step_ms > 0 else None,
        "categories": {
            k: {"ms": round(v, 2), "share": round(v / busy, 3) if busy else 0.0}
            for k, v in sorted(per.items(), key=lambda kv: -kv[1])
        },
        "top": [{"name": n[:120], "ms": round(ms, 2)} for n, ms in top],
    }


ANNOTATIONS = ("ProfilerStep#", "Optimizer.step#", "Optimizer.zero_grad#")
"""Names of the profiler's own spans (torch.profiler.record_function): not work of their own."""


def profiled_events(prof, on_gpu: bool) -> list[tuple[str, float]]:
    """(name, self ms) of every kernel (GPU) or operator (CPU) of a finished torch.profiler run. A
    kernel's row is its own (device type CUDA): CPU operators carry their kernels' time too, so
    counting both would count it twice."""
    import torch

    out = []
    for event in prof.key_averages():
        if getattr(event, "is_user_annotation", False) or event.key.startswith(ANNOTATIONS):
            continue  # a span over kernels listed on their own (on a GPU "Optimizer.step#AdamW.step")
        if on_gpu:
            if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(event, "self_device_time_total", None)
            us = getattr(event, "self_cuda_time_total", 0.0) if us is None else us
        else:
            us = event.self_cpu_time_total
        if us > 0:
            out.append((event.key, us / 1000))
    return out


def child_sft_profile(model: str, data: str, workdir: str, tiny: bool, save) -> dict:
    """Relay's SFT stage alone, full fine-tuning (bf16 on a GPU): the timed steps give tokens/s, MFU
    and peak memory; one more step under torch.profiler gives the breakdown (not in the timing)."""
    import torch

    from bench.comparisons import sft
    from stages.sft import SFTStage

    cuda = torch.cuda.is_available()
    case = sft_case("full", tiny, Path(data), cuda)
    case = dict(case, case="full-profile", steps=case["steps"] + 1)  # the last step is the profiled one
    env = harness.SideEnv(model=model, workdir=workdir, threads=os.cpu_count() or 1, quick=False)
    clock, losses, profile = harness.StepClock(), [], {}
    shape = json.loads((Path(model) / "config.json").read_text())
    peak = peak_tflops(device_name())

    class Profiled(SFTStage):
        def train_step(self):
            if clock.last is None:
                clock.start()
            if self.step < case["steps"] - 1:
                return super().train_step()
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if cuda else []
            )
            started = time.perf_counter()
            with torch.profiler.profile(activities=activities) as prof:
                out = super().train_step()
                if cuda:
                    torch.cuda.synchronize()
            profile["wall_ms"] = (time.perf_counter() - started) * 1000
            profile["prof"] = prof
            return out

    def on_step(stage, record) -> None:
        samples = [stage.train_samples[i] for group in stage.step_indices for i in group]
        clock.mark(sum(len(s["input_ids"]) for s in samples))
        losses.append(float(record["train/loss"]))
        if stage.step >= case["steps"]:
            raise _Stop

    stage = Profiled(sft.relay_config(case, env))
    try:
        stage.run(on_step=on_step)
    except _Stop:
        pass
    n_params = sum(p.numel() for p in stage.model.parameters())
    timed = harness.SideResult(
        losses[0] if losses else None,
        clock.seconds[:-1],
        harness.peak_rss_mb(),
        clock.tokens[:-1],
        {"gpu_peak_mb": round(clock.gpu_peak_mb) or None},
    )
    figures = side_figures(timed, case, shape, n_params, peak)
    result = {
        "case": case,
        "n_params": n_params,
        "losses": [round(x, 4) for x in losses],
        "step_seconds": [round(x, 3) for x in clock.seconds[:-1]],
        **figures,
    }
    save(result)
    if "prof" in profile:
        result["profile"] = breakdown(profiled_events(profile["prof"], cuda), profile["wall_ms"], cuda)
    return result


def child_qlora_merge(model: str, data: str, workdir: str, tiny: bool) -> dict:
    """QLoRA SFT for a few steps on `model`, then the stage's own save and merge; peak memory."""
    import torch

    from bench.comparisons import sft
    from stages.sft import SFTStage

    case = dict(sft_case("qlora", tiny, Path(data), torch.cuda.is_available()), case="qlora-merge", steps=3)
    env = harness.SideEnv(model=model, workdir=workdir, threads=os.cpu_count() or 1, quick=False)
    cfg = sft.relay_config(case, env)
    started = time.perf_counter()
    stage = SFTStage(cfg)
    stage.run()
    merged = Path(cfg.output_dir) / "merged"
    weights = sorted(p.name for p in merged.glob("*.safetensors"))
    return {
        "steps": stage.step,
        "losses": [s.get("train/loss") for s in stage.history.steps],
        "seconds": round(time.perf_counter() - started, 1),
        "merged": bool(weights),
        "merged_files": weights,
        "gpu_peak_mb": round(torch.cuda.max_memory_allocated() / 2**20) if torch.cuda.is_available() else None,
    }


def child_rl(algo: str, model: str, workdir: str, tiny: bool, backend: str = "relay") -> dict:
    """PPO or GRPO (LoRA, bf16 on a GPU) on `model`, sampling on `backend` (its other generation
    options the stage's defaults): the seconds before the first step (loading), seconds per step
    after the first (on vLLM the server starts in the first step's rollout), the generation share;
    on vLLM the engine's log-probs against the trainer's (rollout/logprob_diff_mean and _max)."""
    import torch

    from bench.comparisons import grpo, ppo

    env = harness.SideEnv(model=model, workdir=workdir, threads=os.cpu_count() or 1, quick=False)
    case = (ppo if algo == "ppo" else grpo).cases(quick=tiny)[0]
    case = dict(case, steps=3 if tiny else 5)
    if algo == "ppo":
        from stages.ppo import PPOStage as stage_class

        cfg = ppo.relay_config(case, env, ppo.write_prompts(case, env, "gpu"))
    else:
        from stages.grpo import GRPOStage as stage_class

        cfg = grpo.relay_config(case, env)
    if torch.cuda.is_available():
        cfg.model.dtype = cfg.train.precision = "bf16"
    cfg.generation.backend = backend
    clock, records = harness.StepClock(), []

    def on_step(stage, record) -> None:
        clock.mark()
        records.append(dict(record))
        if stage.step >= case["steps"]:
            raise _Stop

    began, first = time.perf_counter(), []

    class Timed(stage_class):
        def train_step(self):
            if clock.last is None:
                clock.start()
                first.append(time.perf_counter() - began)
            return super().train_step()

    with harness.full_length_sampling():
        try:
            Timed(cfg).run(on_step=on_step)
        except _Stop:
            pass
    timed = clock.seconds[1:] or clock.seconds
    share = [r[f"{algo}/gen_time_frac"] for r in records[1:] or records if f"{algo}/gen_time_frac" in r]
    result = {
        "case": case,
        "backend": backend,
        "start_s": round(first[0], 1) if first else None,
        "s_per_step": round(sum(timed) / len(timed), 3),
        "step_seconds": [round(s, 3) for s in clock.seconds],
        "generation_share": round(sum(share) / len(share), 3) if share else None,
        "gpu_peak_mb": round(clock.gpu_peak_mb) or None,
    }
    for stat in ("mean", "max"):  # an engine that reports its log-probs (vLLM) logs these
        if diffs := [round(r[key], 5) for r in records if (key := f"rollout/logprob_diff_{stat}") in r]:
            result[f"logprob_diff_{stat}"] = diffs
    return result


GENERATE_BATCHES = (1, 8, 32)
GENERATE_TOKENS = 128


def child_generate(model: str, tiny: bool, compiled: bool, save) -> dict:
    """Decoding on `model` (bf16 on a GPU), greedy, every row exactly GENERATE_TOKENS new tokens;
    tokens/s per batch size. Not `compiled`: Relay's engine with its CUDA graph and with the model's
    own step (RELAY_DECODE_GRAPHS=0), transformers' `generate` with its dynamic cache, compilation
    off. `compiled`: `generate` with its static cache, which transformers compiles. Every side is
    warmed up by one call of the very shapes it is timed on (graph capture, compilation), and that
    call's seconds are kept apart. `save(result)` after each batch size."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from data_formats.collate import left_pad
    from pipeline.modeling.decode import generate
    from pipeline.modeling.models import load_tokenizer
    from pipeline.tools.chat import prompt_ids
    from pipeline.tools.gold import load_gold, messages_of

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa")
    loaded = loaded.to("cuda" if cuda else "cpu").eval().requires_grad_(False)
    tokenizer = load_tokenizer(model)
    records = load_gold(ROOT / "data" / "sample" / "gold" / "eval.jsonl")
    tokens = 8 if tiny else GENERATE_TOKENS
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def relay(prompts, n, graphs: bool):
        os.environ["RELAY_DECODE_GRAPHS"] = "1" if graphs else "0"
        return generate(
            loaded, prompts, max_new_tokens=n, eos_ids=[eos], pad_id=pad, temperature=0.0, min_new_tokens=n
        ).tokens

    def peer(prompts, n, cache: str):
        ids, mask = left_pad(prompts, pad)
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=eos,
            pad_token_id=pad,
            cache_implementation=None if cache == "dynamic" else "static",
            disable_compile=cache == "dynamic",
        )
        out = loaded.generate(
            input_ids=ids.to(loaded.device), attention_mask=mask.to(loaded.device), generation_config=config
        )
        return out[:, ids.shape[1] :].tolist()

    sides = (
        {"generate-static": lambda p, n: peer(p, n, "static")}
        if compiled
        else {
            "relay-graph": lambda p, n: relay(p, n, True),
            "relay-eager": lambda p, n: relay(p, n, False),
            "generate-dynamic": lambda p, n: peer(p, n, "dynamic"),
        }
    )
    result = {
        "rows": [],
        "unit": "tok/s",
        "dtype": str(dtype).replace("torch.", ""),
        "compiled": compiled,
        "warmup_s": {},
    }
    for batch in GENERATE_BATCHES[:2] if tiny else GENERATE_BATCHES:
        prompts = [prompt_ids(tokenizer, messages_of(records[i % len(records)])) for i in range(batch)]
        row = {"batch": batch, "new_tokens": tokens}
        for name, call in sides.items():
            started = time.perf_counter()
            call(prompts, tokens)
            sync()
            result["warmup_s"][f"{name}@{batch}"] = round(time.perf_counter() - started, 2)
            started = time.perf_counter()
            out = call(prompts, tokens)
            sync()
            seconds = time.perf_counter() - started
            if any(len(r) != tokens for r in out):
                raise RuntimeError(f"generate {name}: rows of {sorted({len(r) for r in out})} tokens, wanted {tokens}")
            row[name] = round(batch * tokens / seconds, 1)
        result["rows"].append(row)
        save(result)
    os.environ.pop("RELAY_DECODE_GRAPHS", None)
    return result


# ------------------------------------------------------------------------------------------
# The check: parts under budgets, the report rewritten after each
# ------------------------------------------------------------------------------------------


def selected(spec: str) -> list[Part]:
    """The parts GPU_CHECK_PARTS names: run names (first, second, third) and part names, separated by
    spaces or commas; the install always comes first.

    Raises:
        ValueError: a name that is neither (the message lists both).
    """
    names = [n for n in spec.replace(",", " ").split() if n]
    known = {p.name for p in PARTS}
    bad = [n for n in names if n not in RUNS and n not in known]
    if bad:
        raise ValueError(
            f"GPU_CHECK_PARTS: {', '.join(bad)} not known; runs: {', '.join(RUNS)}; parts: "
            f"{', '.join(p.name for p in PARTS)}"
        )
    return [p for p in PARTS if p.run == "every" or p.run in names or p.name in names]


def budget_of(part: Part, environ=os.environ) -> int:
    """A part's budget in seconds: GPU_CHECK_S_<NAME> (upper case, - as _) overrides PARTS'."""
    key = "GPU_CHECK_S_" + part.name.upper().replace("-", "_")
    return int(environ.get(key, part.budget_s))


def run_budget(parts: list[Part], gpus: int, environ=os.environ) -> int:
    """Seconds a run of `parts` may take by its own budgets on `gpus` GPUs (parts that need more are not started)."""
    return STARTUP_S + sum(budget_of(p, environ) for p in parts if p.gpus <= max(gpus, 1))


class Stopped(Exception):
    """The check itself was told to stop (the device window's end): SIGTERM or SIGINT."""


def run_process(cmd: list[str], timeout: float, env: dict, log: Path, grace_s: float = 0) -> tuple[int | None, float]:
    """Run `cmd` in a session of its own, output appended to `log`; past `timeout` its session gets
    SIGINT and `grace_s` seconds to end (pytest then writes its JUnit report), then SIGKILL (a
    benchmark keeps what it saved as it went). (exit status or None when cut off, seconds).

    Raises:
        Stopped: the check received SIGTERM or SIGINT meanwhile (the child's session is stopped first).
    """
    started = time.monotonic()
    with open(log, "a") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(timeout, 1))
            return code, time.monotonic() - started
        except subprocess.TimeoutExpired:
            _stop(proc, grace_s)
            return None, time.monotonic() - started
        except Stopped:
            _stop(proc, grace_s)
            raise


def _stop(proc: subprocess.Popen, grace_s: float) -> None:
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def check(out: Path, spec: str, bundle, tiny: bool, total_s=None) -> int:
    """Run the parts `spec` names, each under its budget and all under `total_s` (default: the
    parts' budgets), writing OUTDIR/gpu_check.md after each; 0 when every part that ran passed. Its
    work folder (the bundle's install) is removed when it ends, also when stopped."""
    import torch

    parts = selected(spec)
    gpus = torch.cuda.device_count()
    total = float(total_s) if total_s is not None else run_budget(parts, gpus)
    deadline = time.monotonic() + total
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="relay-gpu-check-"))
    state = gpu_report.State(out)
    state.start(device_name(), [p.name for p in parts], total, tiny)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [x for x in [os.environ.get("PYTHONPATH")] if x]))

    def stop(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    failed, blocked = False, ""
    try:
        for part in parts:
            budget = min(budget_of(part), deadline - time.monotonic())
            if blocked:
                state.record(part.name, f"not run: {blocked}", 0.0, budget_of(part))
                continue
            if part.gpus > 1 and gpus < part.gpus:
                state.record(part.name, f"not run: needs {part.gpus} GPUs", 0.0, budget_of(part))
                continue
            if part.vllm and vllm_python() is None:
                state.record(part.name, f"not run: {VLLM_ABSENT}", 0.0, budget_of(part))
                continue
            if budget < (1 if tiny else 15):
                state.record(part.name, "not run: the run's time budget was spent", 0.0, budget_of(part))
                continue
            print(f"gpu_check: {part.name} ({budget:.0f} s budget)", flush=True)
            state.record(part.name, "running", 0.0, budget_of(part))
            status, seconds = run_part(part, budget, out, work, env, bundle, tiny, state)
            failed |= status.startswith(("failed", "error"))
            state.record(part.name, status, seconds, budget_of(part))
            print(f"gpu_check: {part.name}: {status} in {seconds:.0f} s", flush=True)
            if part.name == "install" and status != "passed":
                blocked = "the install did not finish"
            if part.name == "install" and bundle:
                env["PYTHONPATH"] = os.pathsep.join([str(work / "site"), env["PYTHONPATH"]])
    except Stopped as why:
        running = [name for name, rec in state.data["parts"].items() if rec["status"] == "running"]
        for name in running:
            state.record(name, f"cut off: the check was stopped ({why})", 0.0, state.data["parts"][name]["budget_s"])
        print(f"gpu_check: stopped; {out / 'gpu_check.md'} holds what finished", flush=True)
        return 124
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def run_part(
    part: Part, budget: float, out: Path, work: Path, env: dict, bundle, tiny: bool, state
) -> tuple[str, float]:
    """Run one part within `budget` seconds; (status line, seconds)."""
    log = out / f"{part.name}.log"
    py = sys.executable
    if part.name == "install":
        cmd = (
            ["bash", "run_scripts/install.sh", "--bundle", str(bundle), "--target", str(work / "site")]
            if bundle
            else [py, "-m", "pipeline.tools.compat"]
        )
        code, seconds = run_process(cmd, budget, env, log)
        if code in (0, 3) and bundle:  # 3: installed, compat names a problem; the tests show what it breaks
            site_env = dict(env, PYTHONPATH=os.pathsep.join([str(work / "site"), env["PYTHONPATH"]]))
            code = run_process([py, "-m", "pipeline.tools.bundle", "--seed-cache", str(bundle)], 30, site_env, log)[0]
        state.install(log, site=work / "site" if bundle else None)
        return (
            "passed" if code in (0, 3) else "cut off" if code is None else f"failed (exit {code}; {log.name})"
        ), seconds
    if part.tests:
        junit, collected = out / "junit" / f"{part.name}.xml", out / "junit" / f"{part.name}.collected"
        junit.parent.mkdir(exist_ok=True)
        timeout = ["--timeout", str(int(budget))] if _has("pytest_timeout", env) else []
        cmd = [
            py,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "bench.gpu_collect",
            "-rfEs",
            *timeout,
            "--junitxml",
            str(junit),
            *part.tests.split(),
        ]
        code, seconds = run_process(cmd, budget, dict(env, RELAY_COLLECTED=str(collected)), log, grace_s=15)
        return (
            "cut off"
            if code is None
            else "passed"
            if code == 0
            else "no tests collected"
            if code == 5
            else f"failed (exit {code})"
        ), seconds
    result_file = work / f"{part.name}.json"
    args = _bench_args(part, work, tiny)
    code, seconds = run_process(
        [py, str(Path(__file__)), "child", part.name, *args, "--result", str(result_file)],
        budget,
        dict(env, GPU_CHECK_PART_S=str(int(budget))),
        log,
    )
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if code is None:
        result["cut_off"] = f"after {seconds:.0f} s (its budget)"
    elif code != 0:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-3:]
        result["error"] = f"exited {code}: " + " | ".join(tail)
    state.bench(part.name, result)
    return ("cut off" if code is None else "passed" if code == 0 else f"error (exit {code})"), seconds


def _has(module: str, env: dict) -> bool:
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    return subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def _bench_args(part: Part, work: Path, tiny: bool) -> list[str]:
    """The child's arguments: the model of the part's shape (made once a run, in a child of its own
    so the budget covers it) and the synthetic SFT data."""
    shape = "tiny" if tiny else "qwen2.5-1.5b" if part.name == "qlora-merge" else "qwen2.5-0.5b"
    data = work / "sft" / "synthetic.jsonl"
    if not data.is_file():
        write_sft_data(data, 40 if tiny else 400, 60 if tiny else 380)
    return [str(work / shape), str(data), str(work / part.name)] + (["--tiny"] if tiny else [])


def ensure_model(shape: str, folder: Path) -> int:
    """The random-init model of `shape` in `folder` (made on first use); its parameter count."""
    marker = folder / "n_params.txt"
    if not marker.is_file():
        from pipeline.modeling.embedded import materialize

        _, n = make_model(shape, folder, materialize())
        marker.write_text(str(n))
    return int(marker.read_text())


def plan(bundle, environ=os.environ) -> int:
    """What gpu_check.sh runs (the dry run): each run's parts with their budgets and sums, and whether
    the bundle is complete."""
    from pipeline.tools import bundle as bundles

    print("gpu_check.sh would run, each run in one device window (GPU_CHECK_PARTS=first|second|third or part names):")
    missing = sorted(
        {
            a.split("::")[0]
            for args, _ in GPU_TESTS
            for a in args.split()
            if a.startswith("tests/") and not (ROOT / a.split("::")[0]).is_file()
        }
    )
    problems = [f"{path}: missing" for path in missing]
    for run_name in RUNS:
        parts = selected(run_name)
        print(f"{run_name} run:")
        for part in parts:
            needs = f" [needs {part.gpus} GPUs: not started on fewer]" if part.gpus > 1 else ""
            needs += " [needs vLLM: not started without it]" if part.vllm else ""
            if part.name == "install":
                what = (
                    f"bash run_scripts/install.sh --bundle {bundle or 'DIR'} --target <work>/site  (no index, "
                    f"--no-deps; torch kept) -- {part.what}"
                )
            elif part.tests:
                what = f"pytest {part.tests}  -- {part.what}"
            else:
                what = f"bench/gpu.py child {part.name}  -- {part.what}"
            print(f"  {budget_of(part, environ):4d} s  {part.name}: {what}{needs}")
        one, two = run_budget(parts, 1, environ), run_budget(parts, 2, environ)
        sums = f"{one} s ({one / 60:.1f} min) on one GPU" + (
            f", {two} s ({two / 60:.1f} min) on two" if two != one else ""
        )
        print(
            f"  budget sum with {STARTUP_S} s of start-up: {sums}; limit {RUN_LIMIT_S} s ({RUN_LIMIT_S / 60:.0f} min)"
        )
        if max(one, two) > RUN_LIMIT_S:
            problems.append(f"the {run_name} run's budgets add up to {max(one, two)} s, over {RUN_LIMIT_S} s")
    print("  report:  OUTDIR/gpu_check.md (markdown for bench/RESULTS.md), rewritten after every part")
    if bundle:
        problems += bundles.check(Path(bundle))
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems:
        print(f"dry run OK{': bundle ' + str(bundle) + ' complete' if bundle else ' (no bundle given: not checked)'}")
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--bundle")
    p = sub.add_parser("check")
    p.add_argument("--out", required=True)
    p.add_argument("--bundle")
    p.add_argument("--parts", default=os.environ.get("GPU_CHECK_PARTS", "first"))
    p.add_argument(
        "--total-s",
        type=float,
        default=os.environ.get("GPU_CHECK_TOTAL_S"),
        help="seconds for the whole run (default: the sum of its parts' budgets)",
    )
    p.add_argument("--tiny", action="store_true")
    p = sub.add_parser("child")
    p.add_argument(
        "kind",
        choices=("sft-profile", "sft-vs-trl", "qlora-merge", "ppo", "grpo", "grpo-vllm", "decode", "decode-compiled"),
    )
    p.add_argument("model")
    p.add_argument("data")
    p.add_argument("workdir")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan(args.bundle)
    if args.command == "check":
        try:
            selected(args.parts)
        except ValueError as err:
            print(f"gpu_check: {err}", file=sys.stderr)
            return 2
        return check(Path(args.out), args.parts, args.bundle, args.tiny, args.total_s)
    return child(args)


def child(args) -> int:
    """One benchmark part in this process; its result JSON in --result, rewritten as it goes."""
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    result_path = Path(args.result)
    save = lambda result: result_path.write_text(json.dumps(result, indent=1) + "\n")
    shape = Path(args.model).name
    save({"device": device_name(), "shape": shape, "tiny": args.tiny})  # a part cut off while the model is made says so
    n_params = ensure_model(shape, Path(args.model))
    base = {
        "device": device_name(),
        "shape": shape,
        "n_params": n_params,
        "peak_bf16_tflops": peak_tflops(device_name()),
        "tiny": args.tiny,
    }
    with_base = lambda result: save({**base, **result})
    with_base({})
    if args.kind == "sft-profile":
        result = child_sft_profile(args.model, args.data, args.workdir, args.tiny, with_base)
    elif args.kind == "sft-vs-trl":
        budget = Budget(float(os.environ.get("GPU_CHECK_PART_S", 1e9)))
        rows = bench_sft(
            Path(args.model),
            n_params,
            SHAPES[shape],
            Path(args.data),
            Path(args.workdir),
            budget,
            args.tiny,
            save=lambda rows: with_base({"rows": rows}),
        )
        result = {"rows": rows}
    elif args.kind == "qlora-merge":
        result = child_qlora_merge(args.model, args.data, args.workdir, args.tiny)
    elif args.kind in ("decode", "decode-compiled"):
        result = child_generate(args.model, args.tiny, args.kind == "decode-compiled", with_base)
    elif args.kind == "grpo-vllm":
        result = child_rl("grpo", args.model, args.workdir, args.tiny, backend="vllm")
    else:
        result = child_rl(args.kind, args.model, args.workdir, args.tiny)
    with_base(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
