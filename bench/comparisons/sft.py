"""SFT: Relay's SFT stage vs TRL 1.16's `SFTTrainer` on equal work.

    .venv/bin/python bench/run.py sft [--quick] [--threads N] [--case lora-padding]

The embedded SmolLM2-135M-Instruct in fp32 on CPU, the bundled multi-turn two-task sample
(data/sample/sft/train), loss on assistant turns only (Relay's SFT template defaults), batch 4
samples, seq 512, AdamW (lr 2e-4, betas 0.9/0.95, eps 1e-8, no weight decay, clip 1.0, constant
schedule, no warm-up), no evaluation, no saving. LoRA is r16 / alpha 32 / dropout 0.05 on every
linear layer but the head on both sides (Relay's `lora:` defaults, peft's "all-linear"). Figures:
real (non-padding) tokens per second over the timed steps and peak RSS; four cases, LoRA and full
fine-tuning, each with padding and with packing.

Equal work. The Relay side runs `SFTStage` and writes the tokenised samples of every step, in
the order its sampler drew them (input_ids and labels: -100 off the assistant turns), to the
work folder; the TRL side trains on exactly those, so both sides see the same samples in the
same order with the same loss mask, and their step-1 losses (each side's loss of the first batch,
before any update) must agree within LOSS_TOLERANCE.

- padding: TRL gets the samples as a pre-tokenised dataset (its `labels` column is used as is),
  `train_sampling_strategy="sequential"`, 4 per batch; both sides pad each batch to its longest
  sample.
- packing: TRL's default strategy, "bfd" (padding-free: one flattened row per batch, position_ids
  restarting at every sample; transformers 5 turns those into a block-diagonal mask for sdpa, so
  samples do not see each other, like Relay's block-causal mask; it does so only without a KV
  cache, and TRL passes use_cache=False. Checked on the quick model's first pack: separated
  10.797348 on both sides, one causal row over the pack 10.802857, so the loss check would catch
  contamination). TRL's own `pack_dataset` would
  group samples across the whole dataset (best-fit decreasing), which makes batches Relay never
  trains on, so no first loss could agree. TRL is therefore handed Relay's packs: each step's
  samples are one pre-packed example with their `seq_lengths`, exactly the columns
  `pack_dataset` emits, and `skip_prepare_dataset` keeps TRL from re-packing. TRL's collator and
  forward then run their bfd path on the same packs Relay trains on (one pack per step here: the
  sample's 4 conversations never exceed 512 tokens). Relay pads its packed rows to seq_length;
  TRL's padding-free row has no padding; only real tokens are counted on both sides.

Settings where TRL's defaults differ and would change the work: `bf16` off (fp32 is the
comparison), `gradient_checkpointing` as the case says on both sides (TRL turns it on by
default, Relay's default is off; recomputing activations is not the same work, so the `-gc`
cases turn it on for both). TRL keeps its own default optimizer
implementation and its fused (chunked) LM-head loss.

bench/gpu.py runs these same two sides on a GPU: a case may add `precision: bf16` (model weights
and training precision on both sides), `data` (another SFT folder or file) and `finetuning: qlora`
(TRL gets the same nf4 double-quantised base through transformers' BitsAndBytesConfig).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench import harness

PEER = "TRL 1.16 SFTTrainer"
PEER_PYTHON = "relay"
UNIT = "tok/s"
LOSS_TOLERANCE = 1e-4

DATA = harness.ROOT / "data" / "sample" / "sft" / "train"
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
OPTIM = {"lr": 2e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}


def cases(quick: bool) -> list[dict]:
    """LoRA and full fine-tuning, each padded and packed; quick: the two LoRA cases, 3 steps of the
    tiny model (the row's form is checked, not a time; each side is mostly its imports)."""
    steps, warmup = (3, 1) if quick else (12, 2)
    modes = ("lora",) if quick else ("lora", "full")
    out = [
        {
            "case": f"{mode}-{padding}",
            "finetuning": mode,
            "padding": padding,
            "steps": steps,
            "warmup": warmup,
            "batch_size": 4,
            "seq_length": 512,
            "seed": 42,
            "gc": False,
        }
        for mode in modes
        for padding in ("padding", "packing")
    ]
    if not quick:  # both sides recomputing activations (TRL's default; Relay's model.gradient_checkpointing)
        out += [dict(out[0], case="lora-padding-gc", gc=True), dict(out[2], case="full-padding-gc", gc=True)]
    return out


def batches_file(case: dict, env: harness.SideEnv) -> Path:
    """Where the Relay side leaves each step's samples for the TRL side."""
    return Path(env.workdir) / f"sft-{case['case']}-batches.json"


def step_tokens(steps: list[list[dict]]) -> list[int]:
    """Real (non-padding) tokens of each step."""
    return [sum(len(s["input_ids"]) for s in samples) for samples in steps]


# ------------------------------------------------------------------------------------------
# Relay
# ------------------------------------------------------------------------------------------


class _Finished(Exception):
    """Raised after the last timed step: the final checkpoint and the merge are not measured."""


def relay_config(case: dict, env: harness.SideEnv):
    """The SFT stage config of `case`, built in code (see the module docstring for the settings)."""
    from stages.sft import SFTConfig

    cfg = SFTConfig(output_dir=str(Path(env.workdir) / f"relay-{case['case']}"))
    precision = case.get("precision", "fp32")  # bench/gpu.py: bf16 on a GPU
    cfg.model.path, cfg.model.finetuning, cfg.model.dtype, cfg.model.attn_implementation = (
        env.model,
        case["finetuning"],
        precision,
        "sdpa",
    )
    cfg.model.gradient_checkpointing = case.get("gc", False)
    cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules = (
        LORA["r"],
        LORA["alpha"],
        LORA["dropout"],
        ["all-linear"],
    )
    cfg.data.train, cfg.data.eval = [case.get("data", str(DATA))], []
    cfg.data.padding_mode = "pack" if case["padding"] == "packing" else "padding"
    cfg.multitask.weighted_loss_mode = "none"
    t = cfg.train
    t.max_steps, t.batch_size, t.grad_accum, t.seq_length, t.seed = (
        case["steps"],
        case["batch_size"],
        1,
        case["seq_length"],
        case["seed"],
    )
    harness.relay_train_settings(cfg, OPTIM)
    t.precision = precision
    return cfg


def relay(case: dict, env: harness.SideEnv) -> harness.SideResult:
    """Run `SFTStage` for case["steps"] steps; leave each step's samples in `batches_file`."""
    import torch

    from stages.sft import SFTStage

    torch.set_num_threads(env.threads)
    clock, steps, losses = harness.StepClock(), [], []

    class TimedSFT(SFTStage):
        def train_step(self):
            if clock.last is None:
                clock.start()
            return super().train_step()

    def on_step(stage, record) -> None:
        samples = [stage.train_samples[i] for group in stage.step_indices for i in group]
        clock.mark(sum(len(s["input_ids"]) for s in samples))
        steps.append([{"input_ids": list(s["input_ids"]), "labels": list(s["labels"])} for s in samples])
        losses.append(float(record["train/loss"]))
        if stage.step >= case["steps"]:
            raise _Finished

    stage = TimedSFT(relay_config(case, env))
    try:
        stage.run(on_step=on_step)
    except _Finished:
        pass
    if len(steps) != case["steps"]:
        raise harness.HarnessError(f"sft {case['case']}: Relay ran {len(steps)} of {case['steps']} steps")
    batches_file(case, env).write_text(
        json.dumps({"case": case, "model": env.model, "pad_token": stage.tokenizer.pad_token, "steps": steps})
    )
    return clock.result(
        losses[0], losses=losses, packing_efficiency=stage.history.steps[-1].get("train/packing_efficiency")
    )


# ------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------


def read_batches(case: dict, env: harness.SideEnv) -> dict:
    """The Relay side's samples of this very case and model.

    Raises:
        harness.HarnessError: missing (the Relay side did not run first) or written for another case.
    """
    path = batches_file(case, env)
    if not path.exists():
        raise harness.HarnessError(f"{path} does not exist: the Relay side of {case['case']} must run first")
    found = json.loads(path.read_text())
    if found["case"] != case or found["model"] != env.model:
        raise harness.HarnessError(f"{path} was written for another case or model")
    return found


def trl_rows(steps: list[list[dict]], packing: bool) -> list[dict]:
    """TRL's pre-tokenised examples: the samples one by one, or (packing) one pack per step with
    its `seq_lengths` (the first label of every sample is -100, as in Relay's and TRL's packs)."""
    if not packing:
        return [{"input_ids": s["input_ids"], "labels": s["labels"]} for samples in steps for s in samples]
    rows = []
    for samples in steps:
        row = {"input_ids": [], "labels": [], "seq_lengths": []}
        for s in samples:
            row["input_ids"] += s["input_ids"]
            row["labels"] += [-100] + s["labels"][1:]
            row["seq_lengths"].append(len(s["input_ids"]))
        rows.append(row)
    return rows


def peer(case: dict, env: harness.SideEnv) -> harness.SideResult:
    """TRL's SFTTrainer on the Relay side's samples (see the module docstring)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(env.threads)
    found = read_batches(case, env)
    steps, packing = found["steps"], case["padding"] == "packing"
    tokens = step_tokens(steps)
    tokenizer = AutoTokenizer.from_pretrained(env.model)
    tokenizer.pad_token = found["pad_token"]
    bf16 = case.get("precision", "fp32") == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    quantized = {}
    if case["finetuning"] == "qlora":  # Relay's QLoRA: nf4, double quantisation, bf16 compute
        from transformers import BitsAndBytesConfig

        quantized = {
            "quantization_config": BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype,
            ),
            "device_map": {"": 0 if torch.cuda.is_available() else "cpu"},
        }
    model = AutoModelForCausalLM.from_pretrained(env.model, dtype=dtype, attn_implementation="sdpa", **quantized)
    clock, first = harness.StepClock(), []

    class Clock(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            if clock.last is None:
                clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            clock.mark(tokens[state.global_step - 1])

    class FirstLossSFT(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if not first and model.training:
                first.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    args = SFTConfig(
        output_dir=str(Path(env.workdir) / f"trl-{case['case']}"),
        max_steps=case["steps"],
        seed=case["seed"],
        per_device_train_batch_size=1 if packing else case["batch_size"],
        gradient_accumulation_steps=1,
        learning_rate=OPTIM["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=OPTIM["beta1"],
        adam_beta2=OPTIM["beta2"],
        adam_epsilon=OPTIM["eps"],
        weight_decay=OPTIM["weight_decay"],
        max_grad_norm=OPTIM["max_grad_norm"],
        max_length=case["seq_length"],
        packing=packing,
        packing_strategy="bfd",
        dataset_kwargs={"skip_prepare_dataset": True} if packing else None,
        train_sampling_strategy="sequential",
        bf16=bf16,
        fp16=False,
        gradient_checkpointing=case.get("gc", False),
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
    )
    peft_config = (
        LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=LORA["dropout"],
            target_modules="all-linear",
            bias="none",
            task_type="CAUSAL_LM",
        )
        if case["finetuning"] in ("lora", "qlora")
        else None
    )
    trainer = FirstLossSFT(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(trl_rows(steps, packing)),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return clock.result(first[0] if first else None, losses=losses, optim=trainer.args.optim)
