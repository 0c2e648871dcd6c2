"""DPO: Relay's DPO stage vs TRL 1.16's `DPOTrainer`, seconds per optimizer step and peak RSS.

    .venv/bin/python bench/run.py dpo [--quick] [--threads N] [--case lora-precomputed]

Both sides: the harness's model (the embedded SmolLM2-135M-Instruct; `--quick` a tiny random
Llama) in fp32 with sdpa attention, LoRA r16 / alpha 32 / dropout 0.05 on every linear layer but
the head (peft's "all-linear"), the sigmoid DPO loss with beta 0.1, `batch` pairs per micro-batch
and `grad_accum` micro-batches per step (configs/dpo.yaml: 4 x 2), AdamW (lr 5e-5, betas
0.9/0.95, eps 1e-8, no weight decay, clip 1.0, constant schedule, no warm-up), dropout off (TRL's
`disable_dropout`, Relay's default), no gradient checkpointing, no evaluation, no saving. The
reference is the policy with its adapter disabled on both sides.

Cases:
- lora: one reference forward (adapter disabled, no grad) per micro-batch on both sides.
- lora-precomputed: the reference log-probs of every training pair are computed once before
  training, in batches of `batch` in data order (Relay: `dpo.precompute_ref_log_probs`; TRL:
  `precompute_ref_log_probs=True`, which does it in the trainer's constructor). The one-off pass
  is outside the step times on both sides (Relay's runs before its clock starts) and its seconds
  are reported as `extra["precompute_seconds"]`.

Equal work, checked rather than assumed:
- Same pairs, same order, same batches: the first steps x batch x grad_accum pairs of
  data/sample/rm/train.jsonl (exactly one epoch, so the precomputed pairs are the trained ones),
  written to the work folder for both sides. Relay draws them in the order of
  `data_formats.sampling.epoch_order(n, seed, 0)` (its sampler's pure function); the Relay side
  fails unless the indices it trained on are exactly that order, and the TRL side gets the pairs
  in that order with `train_sampling_strategy="sequential"`.
- Same tokens: TRL gets each pair as text, the prompt rendered by the tokenizer's own chat
  template with the generation prompt and each answer ending in the EOS (<|im_end|>) that TRL
  appends itself; that tokenises to the very ids Relay renders (prompt + answer + end-of-turn).
  Every pair is far shorter than `seq_length` (512), so neither side truncates anything; each
  side reports the answer tokens and the real tokens of its first step.
- Same first loss (LOSS_TOLERANCE): at step 1 the policy is the reference (LoRA's B starts at 0),
  so the sigmoid loss is log 2 on both sides whatever the data. That alone proves nothing about
  the data, so each side also reports its first step's mean chosen and rejected answer
  log-prob sums (Relay: its `sequence_logps` on the policy; TRL: its `logps/chosen` and
  `logps/rejected` metrics), which depend on every token and every label position, and the
  second step's loss and implicit rewards, which depend on the first update as well.

What differs is design, the thing compared: TRL computes log-probs with its fused, chunked LM head
and logs extra metrics (entropy, token accuracy, mean logits) every step; Relay materialises the
logits of the answer positions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench import harness

PEER = "TRL 1.16 DPOTrainer"
PEER_PYTHON = "relay"
UNIT = "s/step"
LOSS_TOLERANCE = 1e-4
WHY_NO_LOSS = ""

PAIRS = harness.ROOT / "data" / "sample" / "rm" / "train.jsonl"
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
OPTIM = {"lr": 5e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}
BETA = 0.1
SEED = 42


def cases(quick: bool) -> list[dict]:
    """The adapter-disabled reference every step, and precomputed (quick: 3 steps of the tiny model)."""
    steps, warmup, batch = (3, 1, 1) if quick else (8, 1, 4)
    return [
        {
            "case": name,
            "precompute": precompute,
            "steps": steps,
            "warmup": warmup,
            "batch": batch,
            "grad_accum": 2,
            "seq_length": 512,
            "seed": SEED,
        }
        for name, precompute in (("lora", False), ("lora-precomputed", True))
    ]


def pairs_file(case: dict, env: harness.SideEnv) -> Path:
    """The case's pairs: the first steps x batch x grad_accum records of PAIRS (one epoch, so every
    pair precomputed is trained on), written to the work folder; both sides read this file."""
    need = case["steps"] * case["batch"] * case["grad_accum"]
    lines = [line for line in PAIRS.read_text().splitlines() if line.strip()]
    if need > len(lines):
        raise harness.HarnessError(
            f"dpo {case['case']}: {case['steps']} steps need {need} pairs, {PAIRS} has {len(lines)}"
        )
    path = Path(env.workdir) / f"dpo-pairs-{need}.jsonl"
    path.write_text("\n".join(lines[:need]) + "\n")
    return path


def pair_order(n: int, case: dict) -> list[int]:
    """The pair indices Relay's sampler draws, step after step: its epoch-0 permutation."""
    from data_formats.sampling import epoch_order

    return epoch_order(n, case["seed"], 0)


def logps_figures(chosen: list[float], rejected: list[float]) -> dict:
    """Mean over the first step's micro-batches of each one's mean chosen / rejected sum."""
    return {"first_logps_chosen": sum(chosen) / len(chosen), "first_logps_rejected": sum(rejected) / len(rejected)}


# ------------------------------------------------------------------------------------------
# Relay
# ------------------------------------------------------------------------------------------


class _Finished(Exception):
    """Raised after the last step: the final checkpoint and the merge are not measured."""


def relay_config(case: dict, env: harness.SideEnv, pairs: Path):
    """The DPO stage config of `case` (module docstring)."""
    from stages.dpo import DPOConfig

    out = Path(env.workdir) / f"relay-dpo-{case['case']}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = DPOConfig(output_dir=str(out))
    cfg.model.path, cfg.model.finetuning, cfg.model.dtype, cfg.model.attn_implementation = (
        env.model,
        "lora",
        "fp32",
        "sdpa",
    )
    cfg.model.gradient_checkpointing = False
    cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.target_modules = (
        LORA["r"],
        LORA["alpha"],
        LORA["dropout"],
        ["all-linear"],
    )
    cfg.data.train, cfg.data.eval, cfg.data.template, cfg.data.truncation = [str(pairs)], [], "chat_template", "drop"
    cfg.dpo.loss_type, cfg.dpo.beta, cfg.dpo.label_smoothing = "sigmoid", BETA, 0.0
    cfg.dpo.precompute_ref_log_probs = case["precompute"]
    t = cfg.train
    t.max_steps, t.batch_size, t.grad_accum, t.seq_length, t.seed = (
        case["steps"],
        case["batch"],
        case["grad_accum"],
        case["seq_length"],
        case["seed"],
    )
    harness.relay_train_settings(cfg, OPTIM)
    t.log_steps = 1
    return cfg


def relay(case: dict, env: harness.SideEnv) -> harness.SideResult:
    """Run `DPOStage` for case["steps"] steps (precompute first, outside the clock)."""
    import time

    import torch

    import pipeline.algorithms.preference as dpo_module
    from stages.dpo import DPOStage

    torch.set_num_threads(env.threads)
    clock, hwm, records, drawn = harness.StepClock(), [], [], []
    first = {"chosen": [], "rejected": [], "answer_tokens": 0, "tokens": 0, "precompute_seconds": 0.0}
    scoring = dpo_module.sequence_logps

    def recording_logps(model, batch, accelerator):
        sums, counts = scoring(model, batch, accelerator)
        if (
            torch.is_grad_enabled() and not records
        ):  # the policy's forward of step 1 (the reference's runs without grad)
            half = sums.shape[0] // 2
            first["chosen"].append(float(sums[:half].mean()))
            first["rejected"].append(float(sums[half:].mean()))
            first["answer_tokens"] += int((batch["labels"] != -100).sum())
            first["tokens"] += int(batch["attention_mask"].sum())
        return sums, counts

    class TimedDPO(DPOStage):
        def train_step(self):
            if clock.last is None:
                if case["precompute"]:
                    started = time.perf_counter()
                    self.precompute()
                    first["precompute_seconds"] = time.perf_counter() - started
                clock.start()
            return super().train_step()

    def on_step(stage, record) -> None:
        indices = [i for group in stage.step_indices for i in group]
        drawn.extend(indices)
        clock.mark(
            sum(len(stage.train_samples[i][k]) for i in indices for k in ("chosen_input_ids", "rejected_input_ids"))
        )
        hwm.append(round(clock.rss))
        records.append(record)
        if stage.step >= case["steps"]:
            raise _Finished

    pairs = pairs_file(case, env)
    dpo_module.sequence_logps = recording_logps
    stage = TimedDPO(relay_config(case, env, pairs))
    try:
        stage.run(on_step=on_step)
    except _Finished:
        pass
    finally:
        dpo_module.sequence_logps = scoring
    n = len(pairs.read_text().splitlines())
    if len(stage.train_samples) != n:
        raise harness.HarnessError(
            f"dpo relay: {len(stage.train_samples)} of {n} pairs kept (the comparison needs none dropped)"
        )
    if drawn != pair_order(n, case)[: len(drawn)] or len(records) != case["steps"]:
        raise harness.HarnessError(
            f"dpo relay: drew pairs {drawn[:8]}... over {len(records)} steps, not the order "
            "data_formats.sampling.epoch_order gives (update bench/comparisons/dpo.py)"
        )
    longest = max(max(len(s["chosen_input_ids"]), len(s["rejected_input_ids"])) for s in stage.train_samples)
    return clock.result(
        records[0]["train/loss"],
        **logps_figures(first["chosen"], first["rejected"]),
        first_answer_tokens=first["answer_tokens"],
        first_tokens=first["tokens"],
        first_pairs=drawn[: case["batch"] * case["grad_accum"]],
        second_loss=records[1]["train/loss"] if len(records) > 1 else None,
        second_rewards_chosen=records[1]["dpo/rewards_chosen"] if len(records) > 1 else None,
        second_rewards_rejected=records[1]["dpo/rewards_rejected"] if len(records) > 1 else None,
        losses=[r["train/loss"] for r in records],
        longest_sequence=longest,
        precompute_seconds=first["precompute_seconds"],
        rss_mb_per_step=hwm,
    )


# ------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------


def trl_rows(tokenizer, case: dict, env: harness.SideEnv) -> tuple[list[dict], list[int]]:
    """TRL's text examples ({prompt, chosen, rejected, line}) in Relay's order, and that order.
    The prompt is the chat template's rendering with the generation prompt; TRL appends the EOS
    to each answer itself."""
    records = [json.loads(line) for line in pairs_file(case, env).read_text().splitlines()]
    order = pair_order(len(records), case)
    rows = []
    for i in order:
        r = records[i]
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False
        )
        rows.append({"prompt": prompt, "chosen": r["response_chosen"], "rejected": r["response_rejected"], "line": i})
    return rows, order


def peer(case: dict, env: harness.SideEnv) -> harness.SideResult:
    """TRL's DPOTrainer on the same pairs in Relay's order (module docstring)."""
    import time

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(env.threads)
    tokenizer = AutoTokenizer.from_pretrained(env.model)
    rows, order = trl_rows(tokenizer, case, env)
    model = AutoModelForCausalLM.from_pretrained(env.model, dtype=torch.float32, attn_implementation="sdpa")
    clock, hwm, step_logs, step_tokens = harness.StepClock(), [], [], [0]
    first = {"answer_tokens": 0, "tokens": 0, "precompute_seconds": 0.0}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if clock.last is None:
                clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            clock.mark(step_tokens[-1])
            hwm.append(round(clock.rss))
            step_tokens.append(0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                step_logs.append(dict(logs))

    class MeasuredDPO(DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            started = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            first["precompute_seconds"] += time.perf_counter() - started
            return out

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:
                tokens = int(inputs["attention_mask"].sum())
                step_tokens[-1] += tokens
                if self.state.global_step == 0:
                    first["answer_tokens"] += int(inputs["completion_mask"].sum())
                    first["tokens"] += tokens
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = DPOConfig(
        output_dir=str(Path(env.workdir) / f"trl-dpo-{case['case']}"),
        max_steps=case["steps"],
        seed=case["seed"],
        per_device_train_batch_size=case["batch"],
        gradient_accumulation_steps=case["grad_accum"],
        learning_rate=OPTIM["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=OPTIM["beta1"],
        adam_beta2=OPTIM["beta2"],
        adam_epsilon=OPTIM["eps"],
        weight_decay=OPTIM["weight_decay"],
        max_grad_norm=OPTIM["max_grad_norm"],
        beta=BETA,
        loss_type=["sigmoid"],
        label_smoothing=0.0,
        max_length=case["seq_length"],
        precompute_ref_log_probs=case["precompute"],
        precompute_ref_batch_size=case["batch"],
        disable_dropout=True,
        train_sampling_strategy="sequential",
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
    trainer = MeasuredDPO(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    longest = max(
        len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in trainer.train_dataset
    )
    trainer.train()
    if len(step_logs) != case["steps"]:
        raise harness.HarnessError(f"dpo peer: {len(step_logs)} logged steps, want {case['steps']}")
    one, two = step_logs[0], step_logs[1] if len(step_logs) > 1 else {}
    return clock.result(
        one["loss"],
        first_logps_chosen=one["logps/chosen"],
        first_logps_rejected=one["logps/rejected"],
        first_answer_tokens=first["answer_tokens"],
        first_tokens=first["tokens"],
        first_pairs=order[: case["batch"] * case["grad_accum"]],
        second_loss=two.get("loss"),
        second_rewards_chosen=two.get("rewards/chosen"),
        second_rewards_rejected=two.get("rewards/rejected"),
        losses=[log["loss"] for log in step_logs],
        longest_sequence=longest,
        precompute_seconds=first["precompute_seconds"],
        rss_mb_per_step=hwm,
        optim=trainer.args.optim,
    )
