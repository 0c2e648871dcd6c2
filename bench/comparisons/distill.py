"""On-policy distillation: Relay's distill stage vs TRL 1.16's `DistillationTrainer`, seconds per
optimizer step and peak RSS on equal work.

    .venv/bin/python bench/run.py distill [--quick] [--threads N]

Both sides: the harness's model (the embedded SmolLM2-135M-Instruct; `--quick` a tiny random
Llama) as the student in fp32 with sdpa attention, LoRA r16 / alpha 32 / no dropout on every
linear layer but the head (peft's "all-linear"); the teacher is the same model with its final norm's
weight doubled (a sharper distribution over the same tokenizer, written once to the work folder),
loaded frozen in fp32 beside it; per step `prompts` prompts of data/sample/ppo/train.jsonl, each
answered once; the loss is TRL's generalized JSD (beta 0.5, temperature 1) over the full vocabulary,
token-level over the batch; AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8, no weight decay, clip 1.0,
constant schedule, no warm-up), no gradient checkpointing, no evaluation, no saving.

Equal work. The samplers are out of the comparison: both sides answer each prompt with the same
`new_tokens` token ids, a pure function of the prompt's ids (`scripted`; Relay through its
generator hook, TRL by replacing `_generate_single_turn`), so each step scores the same sequences
and the first step's loss must agree (LOSS_TOLERANCE). Relay draws the prompts in the order of
`data_formats.sampling.epoch_order(n, seed, 0)` (its sampler's pure function) and TRL gets the
dataset in that order with `shuffle_dataset=False`. What is timed is the rest of the step: the
teacher's forward, the student's forward and backward through each side's divergence (Relay:
pipeline/algorithms/distill.py through the chunked head; TRL: `_chunked_divergence_loss`), and the
optimizer step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bench import harness

PEER = "TRL 1.16 DistillationTrainer"
PEER_PYTHON = "relay"
UNIT = "s/step"
LOSS_TOLERANCE = 1e-4

PROMPTS = harness.ROOT / "data" / "sample" / "ppo" / "train.jsonl"
LORA = {"r": 16, "alpha": 32, "dropout": 0.0}
OPTIM = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}
BETA = 0.5
SEED = 42


def cases(quick: bool) -> list[dict]:
    """LoRA with configs/pipeline_distill.yaml's batch (quick: 3 small steps of the tiny model)."""
    if quick:
        return [{"case": "lora", "steps": 3, "warmup": 1, "prompts": 2, "new_tokens": 8, "seed": SEED}]
    return [{"case": "lora", "steps": 5, "warmup": 1, "prompts": 8, "new_tokens": 24, "seed": SEED}]


def scripted(prompt: list[int], new_tokens: int) -> list[int]:
    """The answer both sides give `prompt`: `new_tokens` ids in [100, 1000), no EOS."""
    seed = sum(prompt) + 31 * len(prompt)
    return [100 + (seed * 7 + 13 * i) % 900 for i in range(new_tokens)]


def teacher_folder(env: harness.SideEnv) -> Path:
    """The student's model with its final norm's weight doubled, saved once in the work folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.modeling.manifest import write_manifest

    path = Path(env.workdir) / "teacher"
    if (path / "config.json").exists():
        return path
    model = AutoModelForCausalLM.from_pretrained(env.model, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(env.model).save_pretrained(path)
    write_manifest(path, stage="bench-teacher", parent=env.model, config={"norm_scale": 2.0})
    return path


def prompt_order(n: int, case: dict) -> list[int]:
    """The prompt indices Relay's sampler draws, step after step: its epoch-0 permutation."""
    from data_formats.sampling import epoch_order

    need = case["steps"] * case["prompts"]
    if need > n:
        raise harness.HarnessError(f"distill: {case['steps']} steps need {need} prompts, {PROMPTS} has {n}")
    return epoch_order(n, case["seed"], 0)


def read_prompts() -> list[str]:
    import json

    return [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------
# Relay
# ------------------------------------------------------------------------------------------


class _Finished(Exception):
    """Raised after the last step: the final checkpoint and the merge are not measured."""


class _Scripted:
    def __init__(self, new_tokens: int):
        self.new_tokens = new_tokens

    def generate(self, prompts, **_):
        return [scripted(list(p), self.new_tokens) for p in prompts]


def relay(case: dict, env: harness.SideEnv) -> harness.SideResult:
    """Run `DistillStage` for case["steps"] steps on the scripted answers."""
    import torch

    from stages.distill import DistillConfig, DistillStage

    torch.set_num_threads(env.threads)
    out = Path(env.workdir) / f"relay-distill-{case['case']}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = DistillConfig(output_dir=str(out))
    cfg.model.path, cfg.model.finetuning, cfg.model.dtype, cfg.model.attn_implementation = (
        env.model,
        "lora",
        "fp32",
        "sdpa",
    )
    cfg.model.gradient_checkpointing = False
    cfg.teacher.path, cfg.teacher.dtype, cfg.teacher.attn_implementation = str(teacher_folder(env)), "fp32", "sdpa"
    cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules = (
        LORA["r"],
        LORA["alpha"],
        LORA["dropout"],
        ["all-linear"],
    )
    cfg.data.train, cfg.data.eval, cfg.data.completions, cfg.data.template = [str(PROMPTS)], [], [], "chat_template"
    cfg.generation.max_new_tokens = case["new_tokens"]
    cfg.distill.beta, cfg.distill.temperature, cfg.distill.lmbda = BETA, 1.0, 1.0
    t = cfg.train
    t.max_steps, t.batch_size, t.grad_accum, t.seq_length, t.seed = (
        case["steps"],
        case["prompts"],
        1,
        256,
        case["seed"],
    )
    harness.relay_train_settings(cfg, OPTIM)
    t.log_steps = 1
    clock, hwm, drawn, seen = harness.StepClock(), [], [], {"loss": [], "tokens": []}

    class TimedDistill(DistillStage):
        def train_step(self):
            if clock.last is None:
                clock.start()
            return super().train_step()

    def on_step(stage, record) -> None:
        tokens = int(record["distill/completion_length"] * case["prompts"])
        clock.mark(tokens)
        hwm.append(round(clock.rss))
        drawn.extend(i for group in stage.step_indices for i in group)
        seen["loss"].append(record["train/loss"])
        seen["tokens"].append(tokens)
        if stage.step >= case["steps"]:
            raise _Finished

    stage = TimedDistill(cfg, generator_factory=lambda policy: _Scripted(case["new_tokens"]))
    try:
        stage.run(on_step=on_step)
    except _Finished:
        pass
    n = len(read_prompts())
    if drawn != prompt_order(n, case)[: len(drawn)]:
        raise harness.HarnessError(
            f"distill relay: drew prompts {drawn[:8]}..., not data_formats.sampling.epoch_order's order"
        )
    return clock.result(seen["loss"][0], losses=seen["loss"], completion_tokens=seen["tokens"], rss_mb_per_step=hwm)


# ------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------


def peer(case: dict, env: harness.SideEnv) -> harness.SideResult:
    """TRL's DistillationTrainer on the same prompts in Relay's order and the same answers."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    torch.set_num_threads(env.threads)
    texts = read_prompts()
    order = prompt_order(len(texts), case)[: case["steps"] * case["prompts"]]
    rows = [{"prompt": [{"role": "user", "content": texts[i]}]} for i in order]
    tokenizer = AutoTokenizer.from_pretrained(env.model)
    clock, hwm, losses = harness.StepClock(), [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if clock.last is None:
                clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            clock.mark(case["prompts"] * case["new_tokens"])
            hwm.append(round(clock.rss))

    class Scripted(DistillationTrainer):
        def _generate_single_turn(self, ids, images, multimodal_fields, has_tool_images=False):
            return [scripted(list(p), case["new_tokens"]) for p in ids]

        def compute_loss(self, *args, **kwargs):
            out = super().compute_loss(*args, **kwargs)
            losses.append(float((out[0] if isinstance(out, tuple) else out).detach()))
            return out

    args = DistillationConfig(
        output_dir=str(Path(env.workdir) / f"trl-distill-{case['case']}"),
        max_steps=case["steps"],
        seed=case["seed"],
        per_device_train_batch_size=case["prompts"],
        gradient_accumulation_steps=1,
        max_completion_length=case["new_tokens"],
        beta=BETA,
        temperature=1.0,
        shuffle_dataset=False,
        teacher_model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        learning_rate=OPTIM["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=OPTIM["beta1"],
        adam_beta2=OPTIM["beta2"],
        adam_epsilon=OPTIM["eps"],
        weight_decay=OPTIM["weight_decay"],
        max_grad_norm=OPTIM["max_grad_norm"],
        disable_dropout=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
    )
    peft_config = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )
    trainer = Scripted(
        model=env.model,
        teacher_model=str(teacher_folder(env)),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    trainer.train()
    return clock.result(losses[0] if losses else None, losses=losses, rss_mb_per_step=hwm, optim=trainer.args.optim)
