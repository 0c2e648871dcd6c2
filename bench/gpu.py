"""The GPU benchmarks of run_scripts/gpu_check.sh: random-init models of Qwen2.5's real shapes (no
download), the embedded model's tokenizer, synthetic multi-turn SFT data.

    python bench/gpu.py run --out bench.json [--budget 240] [--tiny]    # the benchmarks (JSON)
    python bench/gpu.py plan                                              # what gpu_check.sh runs

- SFT on the 0.5B shape, seq 2048, packed, full fine-tuning / LoRA / QLoRA in bf16: Relay's SFT
  stage and TRL's SFTTrainer on the very same packs (bench/comparisons/sft.py, equal first loss
  within GPU_LOSS_TOLERANCE), each side in its own process: tokens/s, MFU, peak GPU memory
  (torch.cuda.max_memory_allocated at the end of the last timed step).
- QLoRA on the 1.5B shape: trains a few steps and merges (the stage's own export), peak memory.
- PPO and GRPO on the 0.5B shape (LoRA, bf16): seconds per step and the share of it spent
  generating (the stage's own `gen_time_frac`).
- Decoding on the 0.5B shape (bf16), batch 1/8/32 x 128 new tokens, greedy: Relay's engine with its
  CUDA graph and with the model's own step, transformers' `generate` with its dynamic and static
  cache (`child_generate`): tokens/s.

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
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

GPU_TESTS = [
    ("tests/test_gpu.py", "packed == unpacked on CUDA sdpa (fp32, bf16); PPO (fp32, bf16) and GRPO (bf16) on CUDA; "
                          "the decode engine's CUDA graph == the model's own step (fp32, bf16); "
                          "FSDP on one rank: checkpoint gather/scatter, stopped + resumed == unbroken == plain one GPU"),
    ("tests/test_fsdp.py", "FSDP2 on one rank on CUDA (nccl), the code path CPU ranks run over gloo: every stage == one "
                           "process == DDP, stopped + resumed == unbroken, the data cursor across batch splits"),
    ("tests/test_qlora.py", "QLoRA: nf4 double-quant base on CUDA, only LoRA trains, the adapter merges into the full-precision base"),
    ("tests/test_distributed_stages.py -k fsdp", "FSDP on two ranks == one process; stopped and resumed == unbroken"),
    ("tests/test_distributed_gpu.py::test_bf16_tracks_fp32 tests/test_distributed_gpu.py::test_ppo_under_zero3_equals_one_gpu "
     "tests/test_distributed_gpu.py::test_qlora_trains_under_sharding_and_tracks_one_gpu "
     "tests/test_distributed_gpu.py::test_resuming_a_zero3_run_is_refused_up_front",
     "bf16 tracks fp32; PPO under ZeRO-3 == one GPU; QLoRA under ZeRO-3 (and FSDP, 2 GPUs); resuming ZeRO refused up front"),
    ("tests/test_distributed_gpu.py::test_zero_equals_one_gpu", "ZeRO-2, ZeRO-3, ZeRO-3 offload == one GPU (SFT, RM, grad_accum 1 and 4)"),
    ("tests/test_vllm_gpu.py", "vLLM (where installed: bash run_scripts/install_vllm.sh): sleep mode frees the engine's GPU memory "
                               "during the update and it wakes following the LoRA policy; tensor_parallel_size 2 on two GPUs"),
]
"""(pytest arguments, what it proves): every GPU-marked test, in the order gpu_check.sh runs them
(the quick ones first: what the tests' time budget cuts off is listed as not run)."""
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
}
"""Qwen2.5-0.5B and -1.5B's published configs (architecture only; weights random)."""
PEAK_BF16_TFLOPS = [("H200", 989.0), ("GH200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
                    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0), ("L4", 121.0)]
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
    config = Qwen2Config(**SHAPES[shape_name], max_position_embeddings=32768, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    from pipeline.modeling.manifest import write_manifest

    write_manifest(folder, stage="random-init", parent=None, config={"shape": shape_name, "seed": 0})
    del model
    return folder, n_params


WORDS = ("atlas river harbour lantern market granite orchard signal copper meadow winter quarry beacon tide ledger "
         "compass ember willow canyon falcon garnet meridian pylon thistle").split()


def write_sft_data(path: Path, samples: int, words: int, seed: int = 0) -> Path:
    """`samples` two-turn conversations of about `words` words each (seeded), Relay's SFT format."""
    rng = random.Random(seed)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n)) + "."
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for i in range(samples):
            rounds = [{"role": "human", "content": text(words // 4)}, {"role": "bot", "content": text(words // 4)},
                      {"role": "human", "content": text(words // 8)}, {"role": "bot", "content": text(3 * words // 8)}]
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
    return {"case": f"{mode}-packing-gpu", "finetuning": mode, "padding": "packing", "steps": steps, "warmup": warmup,
            "batch_size": 4 if tiny else 16, "seq_length": 256 if tiny else 2048, "seed": 42, "gc": False,
            "precision": "bf16" if cuda else "fp32", "data": str(data)}


def side_figures(result: harness.SideResult, case: dict, shape: dict, n_params: int, peak) -> dict:
    """tokens/s, s/step, MFU, peak GPU memory and first loss of one side."""
    seconds, rate = harness.timed(result, case["warmup"])
    flops = flops_per_token(shape, n_params, case["seq_length"], case["finetuning"])
    return {"tokens_per_s": round(rate, 1), "s_per_step": round(seconds, 4), "first_loss": result.first_loss,
            "mfu": round(rate * flops / (peak * 1e12), 4) if peak else None, "gpu_peak_mb": result.extra.get("gpu_peak_mb"),
            "flops_per_token": flops}


def bench_sft(model: Path, n_params: int, shape: dict, data: Path, workdir: Path, budget: Budget, tiny: bool) -> list[dict]:
    """Relay vs TRL, each in its own process, for every SFT mode while the budget lasts."""
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
    return rows


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
    return {"steps": stage.step, "losses": [s.get("train/loss") for s in stage.history.steps], "seconds": round(time.perf_counter() - started, 1),
            "merged": bool(weights), "merged_files": weights,
            "gpu_peak_mb": round(torch.cuda.max_memory_allocated() / 2**20) if torch.cuda.is_available() else None}


def child_rl(algo: str, model: str, workdir: str, tiny: bool) -> dict:
    """PPO or GRPO (LoRA, bf16 on a GPU) on `model`: seconds per step and the generation share."""
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
    clock, shares = harness.StepClock(), []

    def on_step(stage, record) -> None:
        clock.mark()
        shares.append(record.get(f"{algo}/gen_time_frac"))
        if stage.step >= case["steps"]:
            raise _Stop

    class Timed(stage_class):
        def train_step(self):
            if clock.last is None:
                clock.start()
            return super().train_step()

    with harness.full_length_sampling():
        try:
            Timed(cfg).run(on_step=on_step)
        except _Stop:
            pass
    timed = clock.seconds[1:] or clock.seconds
    share = [s for s in shares[1:] or shares if s is not None]
    return {"case": case, "s_per_step": round(sum(timed) / len(timed), 3), "step_seconds": [round(s, 3) for s in clock.seconds],
            "generation_share": round(sum(share) / len(share), 3) if share else None,
            "gpu_peak_mb": round(clock.gpu_peak_mb) or None}


GENERATE_BATCHES = (1, 8, 32)
GENERATE_TOKENS = 128


def child_generate(model: str, tiny: bool) -> dict:
    """Decoding on `model` (bf16 on a GPU): Relay's engine with its CUDA graph, the engine with the
    model's own step (RELAY_DECODE_GRAPHS=0), transformers' `generate` with its dynamic and its static
    cache; greedy, every row exactly GENERATE_TOKENS new tokens, after an 8-token warm-up call each.
    Tokens/s per batch size."""
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
        return generate(loaded, prompts, max_new_tokens=n, eos_ids=[eos], pad_id=pad, temperature=0.0, min_new_tokens=n).tokens

    def peer(prompts, n, cache: str):
        ids, mask = left_pad(prompts, pad)
        config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=eos, pad_token_id=pad,
                                  cache_implementation=None if cache == "dynamic" else "static")
        out = loaded.generate(input_ids=ids.to(loaded.device), attention_mask=mask.to(loaded.device), generation_config=config)
        return out[:, ids.shape[1]:].tolist()

    sides = {"relay-graph": lambda p, n: relay(p, n, True), "relay-eager": lambda p, n: relay(p, n, False),
             "generate-dynamic": lambda p, n: peer(p, n, "dynamic"), "generate-static": lambda p, n: peer(p, n, "static")}
    rows = []
    for batch in GENERATE_BATCHES[:2] if tiny else GENERATE_BATCHES:
        prompts = [prompt_ids(tokenizer, messages_of(records[i % len(records)])) for i in range(batch)]
        row = {"batch": batch, "new_tokens": tokens}
        for name, call in sides.items():
            call(prompts, 8)
            sync()
            started = time.perf_counter()
            out = call(prompts, tokens)
            sync()
            seconds = time.perf_counter() - started
            if any(len(r) != tokens for r in out):
                raise RuntimeError(f"generate {name}: rows of {sorted({len(r) for r in out})} tokens, wanted {tokens}")
            row[name] = round(batch * tokens / seconds, 1)
        rows.append(row)
    os.environ.pop("RELAY_DECODE_GRAPHS", None)
    return {"rows": rows, "unit": "tok/s", "dtype": str(dtype).replace("torch.", "")}


def run_child(kind: str, args: list[str], workdir: Path, timeout: float) -> dict:
    """Run `bench/gpu.py child KIND ...` in a fresh process; its JSON result, or {"error": ...}."""
    import subprocess

    out = workdir / f"child-{kind}-{len(list(workdir.glob('child-*')))}.json"
    cmd = [sys.executable, str(Path(__file__)), "child", kind, *args, "--result", str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s (the part's time budget)"}
    if proc.returncode != 0 or not out.exists():
        tail = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()][-3:]
        return {"error": f"exited {proc.returncode}: " + " | ".join(tail)}
    return json.loads(out.read_text())


PARTS = {"sft": 0.4, "qlora_merge": 0.15, "ppo": 0.15, "grpo": 0.15, "generate": 0.15}
"""Each part's share of the benchmarks' time budget."""


def versions() -> dict:
    import importlib.metadata as metadata

    out = {}
    for name in ("torch", "transformers", "accelerate", "peft", "trl", "deepspeed", "bitsandbytes"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run(out: Path, seconds: float, tiny: bool) -> dict:
    """Every benchmark within `seconds` (each part its PARTS share, unspent time carried on); the
    results as JSON in `out`, rewritten after each part so a stopped run keeps what it measured."""
    from pipeline.modeling.embedded import materialize

    work = Path(tempfile.mkdtemp(prefix="relay-gpu-bench-"))
    started, result = time.monotonic(), {"device": device_name(), "versions": versions(), "tiny": tiny}
    save = lambda: out.write_text(json.dumps(result, indent=1) + "\n")
    tokenizer = materialize()
    small = "tiny" if tiny else "qwen2.5-0.5b"
    model, n_params = make_model(small, work / small, tokenizer)
    data = write_sft_data(work / "sft" / "synthetic.jsonl", 40 if tiny else 400, 60 if tiny else 380)
    result.update(shape=small, shape_config=SHAPES[small], n_params=n_params, peak_bf16_tflops=peak_tflops(result["device"]))
    spent = 0.0
    for part, share in PARTS.items():
        budget = Budget(share * seconds + max(0.0, sum(PARTS[p] for p in list(PARTS)[:list(PARTS).index(part)]) * seconds - spent))
        print(f"bench/gpu.py: {part} ({budget.left():.0f} s)", flush=True)
        if budget.left() < (0 if tiny else 20):
            result[part] = {"not_run": "the benchmarks' time budget was spent"}
        elif part == "sft":
            result["sft"] = bench_sft(model, n_params, SHAPES[small], data, work, budget, tiny)
        elif part == "qlora_merge":
            big = "tiny" if tiny else "qwen2.5-1.5b"
            big_model = model if tiny else make_model(big, work / big, tokenizer)[0]
            result["qlora_merge"] = dict(shape=big, **run_child("qlora", [str(big_model), str(data), str(work / "qlora")] + (["--tiny"] if tiny else []),
                                                                 work, budget.left()))
        else:
            result[part] = run_child(part, [str(model), str(data), str(work / part)] + (["--tiny"] if tiny else []), work, budget.left())
        spent = time.monotonic() - started
        save()
    result["seconds"] = round(time.monotonic() - started, 1)
    save()
    return result


def plan(bundle) -> int:
    """What gpu_check.sh runs (the dry run): the tests, the benchmarks, and whether the bundle is complete."""
    from pipeline.tools import bundle as bundles

    print("gpu_check.sh would run:")
    print(f"  install: bash run_scripts/install.sh --bundle {bundle or 'DIR'} --target <work>/site  (no index, --no-deps; torch kept)")
    missing = sorted({a.split("::")[0] for args, _ in GPU_TESTS for a in args.split() if a.startswith("tests/")
                      and not (ROOT / a.split("::")[0]).is_file()})
    for args, what in GPU_TESTS:
        print(f"  tests:   pytest {args}  -- {what}")
    print(f"  bench:   SFT {'/'.join(SFT_MODES)} bf16 packed seq 2048 on the Qwen2.5-0.5B shape, Relay vs TRL SFTTrainer "
          "(tokens/s, MFU, peak GPU memory); QLoRA on the 1.5B shape trains and merges; PPO and GRPO step time and "
          "generation share (0.5B shape); decoding, batch 1/8/32: the engine's CUDA graph vs transformers' generate (0.5B, bf16)")
    print("  report:  OUTDIR/gpu_check.md (markdown for bench/RESULTS.md)")
    problems = [f"{path}: missing" for path in missing]
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
    p = sub.add_parser("run")
    p.add_argument("--out", required=True)
    p.add_argument("--budget", type=float, default=240.0, help="seconds for all benchmarks")
    p.add_argument("--tiny", action="store_true")
    p = sub.add_parser("child")
    p.add_argument("kind", choices=("qlora", "ppo", "grpo", "generate"))
    p.add_argument("model")
    p.add_argument("data")
    p.add_argument("workdir")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan(args.bundle)
    if args.command == "run":
        run(Path(args.out), args.budget, args.tiny)
        return 0
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if args.kind == "qlora":
        result = child_qlora_merge(args.model, args.data, args.workdir, args.tiny)
    elif args.kind == "generate":
        result = child_generate(args.model, args.tiny)
    else:
        result = child_rl(args.kind, args.model, args.workdir, args.tiny)
    Path(args.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
