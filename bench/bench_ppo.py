"""Relay's PPO stage vs TRL 1.12's `trl.experimental.ppo.PPOTrainer` (the last TRL with PPO):
seconds per PPO step and peak RSS, LoRA and full fine-tuning, same model/prompts/lengths/batch.

    .venv/bin/python bench/bench_ppo.py [--steps 3 --batch 4 --new-tokens 16 --epochs 1]

TRL runs from its own virtualenv (TRL 1.13+ dropped PPO; Relay does not pin an old TRL):
    python3 -m venv bench/.venv-trl && bench/.venv-trl/bin/pip install torch==2.13.0 && \
        bench/.venv-trl/bin/pip install 'trl==1.12.*' 'peft==0.21.*'
Each (framework, mode) runs in its own subprocess so peak RSS is per run. The policy and the reward
model are the embedded SmolLM2-135M-Instruct (the RM with a fresh head on both sides); the step
time is the mean over steps after the first (warm-up), the RSS is read at the end of the last
step (before Relay's final merge). Writes the table into bench/RESULTS.md ("## PPO vs TRL").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_PYTHON = ROOT / "bench" / ".venv-trl" / "bin" / "python"
RELAY_PYTHON = ROOT / ".venv" / "bin" / "python"
PROMPTS = ROOT / "data" / "sample" / "ppo" / "train.jsonl"
SECTION = "## PPO vs TRL"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_relay(args) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from stages import ppo

    torch.set_num_threads(args.threads)
    cfg = ppo.PPOConfig(output_dir=str(Path(args.workdir) / f"relay-{args.mode}"))
    cfg.model.finetuning = args.mode
    cfg.model.path = cfg.reward_model.path = "embedded"
    cfg.data.train, cfg.data.eval = [str(PROMPTS)], []
    cfg.train.max_steps, cfg.train.batch_size, cfg.train.eval_steps = args.steps, args.batch, 0
    cfg.train.learning_rate, cfg.train.lr_schedule, cfg.train.warmup = 1e-5, "constant", 0
    cfg.generation.max_new_tokens, cfg.generation.temperature = args.new_tokens, 1.0
    cfg.ppo.epochs, cfg.ppo.mini_batch_size = args.epochs, args.batch
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    marks, rss = [time.perf_counter()], []
    ppo.PPOStage(cfg).run(on_step=lambda stage, record: (marks.append(time.perf_counter()), rss.append(peak_rss_mb())))
    return {"step_seconds": [b - a for a, b in zip(marks, marks[1:])], "peak_rss_mb": rss[-1]}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(42)
    path = args.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True) for p in prompts]
    ids = [x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x for x in ids]
    dataset = Dataset.from_dict({"input_ids": ids})
    policy = AutoModelForCausalLM.from_pretrained(path)
    reward = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    ref = None if args.mode == "lora" else AutoModelForCausalLM.from_pretrained(path)
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM") if args.mode == "lora" else None
    config = PPOConfig(
        output_dir=str(Path(args.workdir) / f"trl-{args.mode}"), per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=args.epochs, total_episodes=args.steps * args.batch, response_length=args.new_tokens,
        temperature=1.0, stop_token="eos", missing_eos_penalty=1.0, learning_rate=1e-5, num_sample_generations=0,
        local_rollout_forward_batch_size=args.batch, report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=42,
    )
    marks, rss = [], []

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())
            rss.append(peak_rss_mb())

    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=dataset, value_model=value, eval_dataset=dataset, peft_config=peft_config, callbacks=[Timer()])
    trainer.train()
    return {"step_seconds": [b - a for a, b in zip(marks, marks[1:])], "peak_rss_mb": rss[-1] if rss else peak_rss_mb()}


def child(args) -> None:
    result = run_relay(args) if args.side == "relay" else run_trl(args)
    print("RESULT " + json.dumps(result), flush=True)


def launch(side: str, mode: str, args, model_path: str) -> dict:
    python = RELAY_PYTHON if side == "relay" else TRL_PYTHON
    if not python.exists():
        return {"error": f"{python} does not exist (see the module docstring for the TRL virtualenv)"}
    cmd = [str(python), __file__, "--side", side, "--mode", mode, "--steps", str(args.steps), "--batch", str(args.batch),
           "--new-tokens", str(args.new_tokens), "--epochs", str(args.epochs), "--threads", str(args.threads),
           "--workdir", args.workdir, "--model", model_path]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"running {side} {mode} ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(found[-1][len("RESULT "):])


def versions(python: Path) -> str:
    if not python.exists():
        return "not installed"
    code = "import importlib.metadata as m; print(' '.join(f'{p} {m.version(p)}' for p in ('torch','transformers','peft','accelerate','trl')))"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip()


def table(results: dict, args) -> str:
    lines = [SECTION,
             f"`bench/bench_ppo.py` (one run; `--steps {args.steps} --batch {args.batch} --new-tokens {args.new_tokens} --epochs {args.epochs}`, "
             f"OMP_NUM_THREADS={args.threads}). Embedded SmolLM2-135M-Instruct as policy and reward model (fresh head), "
             f"the {PROMPTS.relative_to(ROOT)} prompts, fp32 on CPU ({platform.machine()}, {os.cpu_count()} cores shared with other jobs, "
             "so absolute times are noisy). Step time: mean over steps after the first; peak RSS at the end of the last step.",
             "", f"- Relay: {versions(RELAY_PYTHON)}", f"- TRL side: {versions(TRL_PYTHON)}", "",
             "| mode | Relay s/step | TRL 1.12 s/step | time ratio | Relay peak RSS MB | TRL peak RSS MB | RSS ratio |",
             "|---|---|---|---|---|---|---|"]
    for mode in ("lora", "full"):
        r, t = results[("relay", mode)], results[("trl", mode)]
        if "error" in r or "error" in t:
            lines.append(f"| {mode} | {r.get('error', '')} | {t.get('error', '')} | | | | |")
            continue
        rs = sum(r["step_seconds"][1:]) / max(1, len(r["step_seconds"]) - 1)
        ts = sum(t["step_seconds"][1:]) / max(1, len(t["step_seconds"]) - 1)
        lines.append(f"| {mode} | {rs:.2f} | {ts:.2f} | {rs / ts:.2f}x | {r['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / t['peak_rss_mb']:.2f}x |")
    lines.append("")
    lines.append("Goal (LoRA): at most 0.5x TRL's step time and 0.6x its peak memory. Relay's LoRA mode keeps two backbones "
                 "(policy/reference share one, critic/reward the other); TRL's keeps the policy LoRA with the adapter-disabled "
                 "reference but a full separate value model and reward model.")
    return "\n".join(lines) + "\n"


def write_section(text: str) -> None:
    path = ROOT / "bench" / "RESULTS.md"
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    current = pattern.sub("", current).rstrip("\n") + "\n\n"
    path.write_text(current + text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("relay", "trl"))
    parser.add_argument("--mode", choices=("lora", "full"), default="lora")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", default="/tmp/relay-bench-ppo")
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    if args.side:
        child(args)
        return 0
    sys.path.insert(0, str(ROOT))
    from pipeline.modeling.embedded import materialize

    model_path = str(materialize())
    results = {(side, mode): launch(side, mode, args, model_path) for mode in ("lora", "full") for side in ("relay", "trl")}
    for key, value in results.items():
        print(key, value)
    text = table(results, args)
    write_section(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
