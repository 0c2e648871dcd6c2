"""GRPO: Relay's GRPO stage vs TRL 1.16's `GRPOTrainer`, seconds per optimizer step and peak RSS
at equal generations per step.

    .venv/bin/python bench/run.py grpo [--quick] [--threads N]

Both sides: the harness's model (the embedded SmolLM2-135M-Instruct; `--quick` a tiny random
Llama) in fp32 with sdpa attention, LoRA r16 / alpha 32 / dropout 0.05 on every linear layer but
the head (peft's "all-linear"), dropout off; per step `prompts` prompts of
data/sample/ppo/train.jsonl, each sampled `generations` times at temperature 1 (no top-k/top-p)
with each side's sampler (Relay: its decode engine; TRL: transformers' `generate`, `use_vllm=False`), `new_tokens`
tokens per completion; the
reward is `reward` below, the same Python function on both sides (no reward model: the trainer is
the thing compared); group-normalised advantages (scaled by the group's std), one optimizer step
per generation batch (num_iterations 1, so neither side runs an old-policy forward), clip 0.2,
token-level ("dapo") normalisation, a k3 KL term to the adapter-disabled reference with beta
0.04 (configs/pipeline_grpo.yaml's; both sides run one reference forward per step), AdamW (lr 1e-4,
betas 0.9/0.95, eps 1e-8, no weight decay, clip 1.0, constant schedule, no warm-up), no gradient
checkpointing, no evaluation, no saving.

Equal work. GRPO samples, so no two runs score the same completions and no loss after the first
can agree; the first one cannot prove anything either: with every completion the same length the
token mean of the advantages is 0 on both sides by construction. What makes a step's work equal
is the same prompts and the same number of generated tokens, and each side checks it:
- Same prompts, same order, same groups: Relay draws the prompts in the order of
  `data_formats.sampling.epoch_order(n, seed, 0)` (its sampler's pure function; the Relay side
  fails unless it drew exactly that order) and TRL gets the dataset in that order with
  `shuffle_dataset=False` (its RepeatSampler then takes them in turn, each `generations` times).
  TRL renders each prompt with the tokenizer's chat template (its conversational format), Relay
  with its own renderer; each side reports its prompt tokens per step, which agree only if both
  rendered the same prompts to the same ids.
- Same generated tokens: both sides sample exactly `new_tokens` tokens per completion, EOS
  suppressed until then (`min_new_tokens = max_new_tokens`: TRL's `generation_kwargs`; Relay's
  decode engine's `min_new_tokens`, as bench/comparisons/ppo.py does). Each side counts the completion
  tokens of its own batches (Relay: the rollout's response mask; TRL: the completion mask of its
  generation batch), records them per step in `extra["completion_tokens"]` and fails unless every
  step has prompts x generations x new_tokens. With no EOS, Relay's missing-EOS penalty is set
  to 0 (TRL has none); it would shift every reward by the same amount anyway.

What differs is design, the thing compared: how each side batches the rollout, the reference
forward and the update (Relay: pipeline/rl/grpo.py; TRL: its trainer's own path).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

from bench import harness

PEER = "TRL 1.16 GRPOTrainer"
PEER_PYTHON = "relay"
UNIT = "s/step"
LOSS_TOLERANCE = None
WHY_NO_LOSS = "sampled completions; equal prompts and generated tokens per step are checked instead"

PROMPTS = harness.ROOT / "data" / "sample" / "ppo" / "train.jsonl"
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
OPTIM = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 1.0}
BETA = 0.04
EPSILON = 0.2
SEED = 42
REWARD = "bench.comparisons.grpo:reward"


def cases(quick: bool) -> list[dict]:
    """LoRA with configs/pipeline_grpo.yaml's batch (quick: 3 small steps of the tiny model)."""
    if quick:
        return [
            {
                "case": "lora",
                "steps": 3,
                "warmup": 1,
                "prompts": 2,
                "generations": 4,
                "grad_accum": 1,
                "new_tokens": 8,
                "seq_length": 256,
                "seed": SEED,
            }
        ]
    return [
        {
            "case": "lora",
            "steps": 6,
            "warmup": 1,
            "prompts": 4,
            "generations": 4,
            "grad_accum": 1,
            "new_tokens": 24,
            "seq_length": 256,
            "seed": SEED,
        }
    ]


def reward(prompts: Sequence, completions: Sequence, **_) -> list[float]:
    """The demo's house phrase (1 when the answer opens with "Per the Kelvra Atlas,") plus the
    share of its characters that are letters or spaces, so a group's rewards differ even under a
    random model. Relay passes completion texts; TRL conversational completions
    ([{"role": "assistant", "content": ...}])."""
    from pipeline.algorithms.rewards import PHRASE

    out = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        plain = sum(c.isalpha() or c == " " for c in text) / len(text) if text else 0.0
        out.append(float(text.strip().startswith(PHRASE)) + plain)
    return out


def prompt_order(n: int, case: dict) -> list[int]:
    """The prompt indices Relay's sampler draws, step after step: its epoch-0 permutation.

    Raises:
        harness.HarnessError: the steps need more than one epoch of prompts.
    """
    from data_formats.sampling import epoch_order

    need = case["steps"] * case["prompts"]
    if need > n:
        raise harness.HarnessError(f"grpo {case['case']}: {case['steps']} steps need {need} prompts, {PROMPTS} has {n}")
    return epoch_order(n, case["seed"], 0)


def read_prompts() -> list[str]:
    """The prompts of PROMPTS in file order."""
    import json

    return [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]


def check_generated(side: str, counts: Sequence[int], case: dict) -> None:
    """Every step must have generated prompts x generations x new_tokens tokens.

    Raises:
        harness.HarnessError: a step generated another count, or no step ran.
    """
    want = case["prompts"] * case["generations"] * case["new_tokens"]
    if len(counts) != case["steps"] or any(n != want for n in counts):
        raise harness.HarnessError(
            f"grpo {side}: completion tokens per step {list(counts)}, want {want} in each of "
            f"{case['steps']} steps (equal work needs full-length completions on both sides)"
        )


# ------------------------------------------------------------------------------------------
# Relay
# ------------------------------------------------------------------------------------------


class _Finished(Exception):
    """Raised after the last step: the final checkpoint and the merge are not measured."""


def relay_config(case: dict, env: harness.SideEnv):
    """The GRPO stage config of `case` (module docstring)."""
    from stages.grpo import GRPOConfig

    out = Path(env.workdir) / f"relay-grpo-{case['case']}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = GRPOConfig(output_dir=str(out))
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
    cfg.data.train, cfg.data.eval, cfg.data.template = [str(PROMPTS)], [], "chat_template"
    cfg.data.max_prompt_length, cfg.data.truncation = case["seq_length"] - case["new_tokens"], "drop"
    g = cfg.generation
    g.max_new_tokens, g.temperature, g.top_k, g.top_p, g.missing_eos_penalty = case["new_tokens"], 1.0, 0, 1.0, 0.0
    r = cfg.grpo
    r.num_generations, r.num_iterations, r.epsilon, r.epsilon_high, r.beta = case["generations"], 1, EPSILON, None, BETA
    r.scale_rewards, r.loss_type, r.reward_funcs, r.reward_weights = "group", "dapo", [REWARD], None
    t = cfg.train
    t.max_steps, t.batch_size, t.grad_accum, t.seq_length, t.seed = (
        case["steps"],
        case["prompts"],
        case["grad_accum"],
        case["seq_length"],
        case["seed"],
    )
    harness.relay_train_settings(cfg, OPTIM)
    t.log_steps = 1
    return cfg


def relay(case: dict, env: harness.SideEnv) -> harness.SideResult:
    """Run `GRPOStage` for case["steps"] steps with full-length sampling."""
    import torch

    from stages.grpo import GRPOStage

    torch.set_num_threads(env.threads)
    clock, hwm, drawn, seen = (
        harness.StepClock(),
        [],
        [],
        {"completion": [], "prompt": [], "rows": [], "loss": [], "reward": []},
    )

    class TimedGRPO(GRPOStage):
        def train_step(self):
            if clock.last is None:
                clock.start()
            return super().train_step()

    def on_step(stage, record) -> None:
        r = stage.last_rollout["rollout"]
        completion, prompt = int(r.response_mask.sum()), int(r.attention_mask[:, : r.prompt_width].sum())
        clock.mark(completion + prompt)
        hwm.append(round(clock.rss))
        drawn.extend(i for group in stage.step_indices for i in group)
        for key, value in (
            ("completion", completion),
            ("prompt", prompt),
            ("rows", int(r.input_ids.shape[0])),
            ("loss", record["train/loss"]),
            ("reward", record["grpo/reward"]),
        ):
            seen[key].append(value)
        if stage.step >= case["steps"]:
            raise _Finished

    stage = TimedGRPO(relay_config(case, env))
    with harness.full_length_sampling():
        try:
            stage.run(on_step=on_step)
        except _Finished:
            pass
    n = len(read_prompts())
    if len(stage.train_samples) != n or drawn != prompt_order(n, case)[: len(drawn)]:
        raise harness.HarnessError(
            f"grpo relay: drew prompts {drawn[:8]}... of {len(stage.train_samples)}, not the first of "
            "data_formats.sampling.epoch_order's order over all prompts (update bench/comparisons/grpo.py)"
        )
    check_generated("relay", seen["completion"], case)
    return clock.result(
        seen["loss"][0],
        completion_tokens=seen["completion"],
        prompt_tokens=seen["prompt"],
        completions=seen["rows"],
        first_prompts=drawn[: case["prompts"]],
        losses=seen["loss"],
        rewards=seen["reward"],
        rss_mb_per_step=hwm,
    )


# ------------------------------------------------------------------------------------------
# TRL
# ------------------------------------------------------------------------------------------


def peer(case: dict, env: harness.SideEnv) -> harness.SideResult:
    """TRL's GRPOTrainer on the same prompts in Relay's order (module docstring)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(env.threads)
    texts = read_prompts()
    order = prompt_order(len(texts), case)
    rows = [{"prompt": [{"role": "user", "content": texts[i]}], "line": i} for i in order]
    tokenizer = AutoTokenizer.from_pretrained(env.model)
    model = AutoModelForCausalLM.from_pretrained(env.model, dtype=torch.float32, attn_implementation="sdpa")
    clock, hwm, step_logs = harness.StepClock(), [], []
    seen = {"completion": [], "prompt": [], "rows": [], "lines": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if clock.last is None:
                clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            clock.mark((seen["completion"][-1] + seen["prompt"][-1]) if seen["completion"] else 0)
            hwm.append(round(clock.rss))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                step_logs.append(dict(logs))

    class CountingGRPO(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                seen["completion"].append(int(out["completion_mask"].sum()))
                seen["prompt"].append(int(out["prompt_mask"].sum()))
                seen["rows"].append(int(out["completion_mask"].shape[0]))
                seen["lines"].append([x["line"] for x in inputs[:: case["generations"]]])
            return out

    per_device = case["prompts"] * case["generations"] // case["grad_accum"]
    args = GRPOConfig(
        output_dir=str(Path(env.workdir) / f"trl-grpo-{case['case']}"),
        max_steps=case["steps"],
        seed=case["seed"],
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=case["grad_accum"],
        num_generations=case["generations"],
        max_completion_length=case["new_tokens"],
        generation_kwargs={"min_new_tokens": case["new_tokens"]},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        use_vllm=False,
        beta=BETA,
        num_iterations=1,
        epsilon=EPSILON,
        loss_type="dapo",
        scale_rewards="group",
        importance_sampling_level="token",
        mask_truncated_completions=False,
        shuffle_dataset=False,
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
        log_completions=False,
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
    trainer = CountingGRPO(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    trainer.train()
    check_generated("peer", seen["completion"], case)
    expected = [order[s * case["prompts"] : (s + 1) * case["prompts"]] for s in range(case["steps"])]
    if seen["lines"] != expected:
        raise harness.HarnessError(f"grpo peer: prompts per step {seen['lines']}, not Relay's order {expected}")
    return clock.result(
        step_logs[0]["loss"] if step_logs else None,
        completion_tokens=seen["completion"],
        prompt_tokens=seen["prompt"],
        completions=seen["rows"],
        first_prompts=seen["lines"][0],
        losses=[log["loss"] for log in step_logs],
        rewards=[log.get("reward") for log in step_logs],
        rss_mb_per_step=hwm,
        optim=trainer.args.optim,
    )
