"""PPO: Relay's PPO stage vs TRL 1.12's `trl.experimental.ppo.PPOTrainer` (the last TRL with PPO),
seconds per PPO step and peak RSS, LoRA and full fine-tuning.

    .venv/bin/python bench/run.py ppo [--quick] [--threads N] [--case lora]

Both sides: the model given to the harness as the policy and as the reward model (a fresh,
random score head: the sides time the machinery, they do not learn anything), fp32, sdpa,
`batch` prompts per step, `new_tokens` sampled per prompt at temperature 1, one PPO epoch over
one mini-batch of the whole rollout, learning rate 1e-5, `env.threads` threads. TRL runs from
bench/.venv-trl (trl 1.12.0 in front of the main venv's torch/transformers/peft).

Equal work. PPO samples, so no training loss is equal on the two sides; what makes a step's
work equal is the same weights, the same prompt tokens in every batch and the same number of
sampled tokens. Each is checked, none assumed:

- Same prompts in the same batches: the prompt file holds exactly one batch (the first
  `batch` prompts of data/sample/ppo/train.jsonl), so every step of both sides rolls out the
  same prompts, whatever order each side's sampler draws them in. The peer gets the ids of
  the tokenizer's own chat template (TRL's documented preparation); the Relay side checks
  that its renderer produced the very same ids and fails otherwise.
- Same weights and forward: `first_loss` is the mean negative log-likelihood the initial
  policy gives that batch's prompt tokens (each token predicted from the ones before it,
  left padding excluded), computed before the first step by each side's own scoring path
  (Relay's `ActorCritic` forward with `logprobs_from_logits`; TRL's `forward` with
  `selective_log_softmax`). The harness requires the two to agree within LOSS_TOLERANCE:
  a different template, system prompt, dtype, attention mask or position ids shows here.
- Same sampled tokens: both sides generate exactly `new_tokens` tokens per prompt, EOS
  suppressed until then (`min_new_tokens = max_new_tokens`: on the peer the policy's
  generation_config, which TRL merges into its own; on Relay its decode engine's
  `min_new_tokens`, harness.full_length_sampling). Without this a response that ends early shortens one side's rollout
  and every later forward. Each side counts the tokens its own rollouts hold (Relay: the
  rollout's response mask; TRL: its policy's `generate` output cut at the first EOS),
  records them per step in `extra["generated_tokens"]` and fails unless every step has
  `batch * new_tokens`. Forcing the length leaves the sampled distribution slightly off
  the one the ratio scores (EOS masked), which changes no figure a timing reads.

What still differs is design, the thing compared: TRL reads the rollout log-probs from
`generate`'s scores, computes LM-head logits at every position and trains a full value model
beside the LoRA policy; Relay runs a policy forward for the log-probs (LM head on the response
positions only), its critic is a LoRA on the reward backbone (two backbones in LoRA modes, see
pipeline/rl/rollout.py), and it clips the gradient norm at 1.0 (TRL's PPO loop does not
clip).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from bench import harness

PEER = "TRL 1.12 PPOTrainer"
PEER_PYTHON = "trl-1.12"
UNIT = "s/step"
LOSS_TOLERANCE = 1e-3
"""first_loss is a prompt NLL of the untrained policy in fp32: equal inputs agree to ~1e-5 (the
embedded model, 2026-11-22: 5.16398 / 5.16399); another template or dtype moves it by far more."""

PROMPTS = harness.ROOT / "data" / "sample" / "ppo" / "train.jsonl"
LEARNING_RATE = 1e-5
SEED = 42


def cases(quick: bool) -> list[dict]:
    """lora and full: 4 steps of 4 prompts x 16 new tokens; quick (tiny random model, checks the
    row's form in seconds): 3 steps of 2 prompts x 8 new tokens."""
    size = {"steps": 3, "batch": 2, "new_tokens": 8} if quick else {"steps": 4, "batch": 4, "new_tokens": 16}
    return [{"case": mode, "finetuning": mode, "warmup": 1, "epochs": 1, **size} for mode in ("lora", "full")]


# ------------------------------------------------------------------------------------------
# What both sides share: the prompts and the checks
# ------------------------------------------------------------------------------------------


def batch_prompts(case: dict) -> list[str]:
    """The first `batch` prompts of data/sample/ppo/train.jsonl: the one batch every step uses."""
    lines = [line for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [json.loads(line)["prompt"] for line in lines[: case["batch"]]]


def template_ids(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt as one user turn through the tokenizer's chat template, with the assistant opener."""
    out = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def prompt_nll(logprobs, input_ids, attention_mask) -> float:
    """Mean -log p of every prompt token that has a real token before it.

    `logprobs[:, t]` is log p(input_ids[:, t + 1]) ([B, T-1]); `attention_mask` is [B, T].
    """
    mask = (attention_mask[:, 1:] > 0) & (attention_mask[:, :-1] > 0)
    return float(-(logprobs.double() * mask).sum() / mask.sum())


def tokens_until_eos(rows: Sequence[Sequence[int]], eos_id: int) -> int:
    """Sampled tokens of a batch of responses, each counted up to and including its first EOS."""
    return sum(list(row).index(eos_id) + 1 if eos_id in row else len(row) for row in rows)


def check_generated(side: str, generated: Sequence[int], case: dict) -> None:
    """Every step must have sampled `batch * new_tokens` tokens.

    Raises:
        harness.HarnessError: a step sampled another count, or no step ran.
    """
    want = case["batch"] * case["new_tokens"]
    if not generated or any(n != want for n in generated):
        raise harness.HarnessError(
            f"{side}: sampled tokens per step {list(generated)}, want {want} every step "
            "(equal work needs full-length responses on both sides)"
        )


def write_prompts(case: dict, env: harness.SideEnv, side: str) -> Path:
    """The one-batch prompt file Relay's stage reads (bench/scaling.py's PPO points use it too)."""
    path = Path(env.workdir) / f"ppo-prompts-{side}-{case['case']}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in batch_prompts(case)))
    return path


# ------------------------------------------------------------------------------------------
# Relay
# ------------------------------------------------------------------------------------------


def relay_config(case: dict, env: harness.SideEnv, prompts: Path):
    from stages import ppo

    cfg = ppo.PPOConfig(output_dir=str(Path(env.workdir) / f"relay-{case['case']}"))
    cfg.model.path = cfg.reward_model.path = env.model
    cfg.model.finetuning, cfg.model.dtype, cfg.model.attn_implementation = case["finetuning"], "fp32", "sdpa"
    cfg.reward_model.allow_untrained = True
    cfg.data.train, cfg.data.eval = [str(prompts)], []
    t = cfg.train
    t.max_steps, t.batch_size, t.eval_steps, t.seed, t.precision = case["steps"], case["batch"], 0, SEED, "fp32"
    t.learning_rate, t.lr_schedule, t.warmup = LEARNING_RATE, "constant", 0
    cfg.generation.max_new_tokens, cfg.generation.temperature = case["new_tokens"], 1.0
    cfg.ppo.epochs, cfg.ppo.mini_batch_size = case["epochs"], case["batch"]
    cfg.checkpoint.resume = False
    cfg.tracking.trackers = []
    return cfg


def relay(case: dict, env: harness.SideEnv) -> harness.SideResult:
    import torch

    from data_formats.collate import left_pad
    from pipeline.algorithms.rl import logprobs_from_logits
    from pipeline.modeling.models import load_tokenizer
    from stages import ppo

    torch.set_num_threads(env.threads)
    cfg = relay_config(case, env, write_prompts(case, env, "relay"))
    clock, seen = harness.StepClock(), {"first_loss": None, "generated": [], "width": []}
    expected = sorted(template_ids(load_tokenizer(env.model), batch_prompts(case)))

    class BenchPPO(ppo.PPOStage):
        """Relay's PPO stage, scoring the prompt batch once before its first step (untimed)."""

        def train_step(self):
            if self.step == 0:
                ids = sorted(s["prompt_ids"] for s in self.train_samples)
                if ids != expected:
                    raise harness.HarnessError(
                        "relay: its rendered prompts differ from the tokenizer's chat template's ids "
                        "(the peer would roll out other prompts)"
                    )
                input_ids, mask = left_pad(ids, self.tokenizer.pad_token_id)
                with torch.no_grad():
                    logits, _ = self.inner(input_ids, mask, 1, critic=False)
                seen["first_loss"] = prompt_nll(logprobs_from_logits(logits, input_ids[:, 1:]), input_ids, mask)
                clock.start()
            return super().train_step()

    def on_step(stage, record) -> None:
        r = stage.last_experience.rollout
        generated = int(r.response_mask.sum())
        clock.mark(generated)
        seen["generated"].append(generated)
        seen["width"].append(int(r.response_mask.shape[1]))

    with harness.full_length_sampling():
        BenchPPO(cfg).run(on_step=on_step)
    check_generated("relay", seen["generated"], case)
    return clock.result(
        seen["first_loss"],
        generated_tokens=seen["generated"],
        response_width=seen["width"],
        prompts=case["batch"],
        first_loss_is="mean NLL of the prompt batch under the initial policy",
    )


# ------------------------------------------------------------------------------------------
# TRL 1.12
# ------------------------------------------------------------------------------------------


def count_generation(model, eos_id: int, sink: list) -> None:
    """Record (sampled tokens, response width) of every `model.generate` call (TRL calls it on the policy)."""
    original = model.generate

    def generate(*args, **kwargs):
        out = original(*args, **kwargs)
        sequences = out.sequences if hasattr(out, "sequences") else out
        new = sequences[:, kwargs["input_ids"].shape[1] :]
        sink.append((tokens_until_eos(new.tolist(), eos_id), int(new.shape[1])))
        return out

    model.generate = generate


def peer(case: dict, env: harness.SideEnv) -> harness.SideResult:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo.ppo_trainer import forward
    from trl.trainer.utils import selective_log_softmax

    torch.set_num_threads(env.threads)
    torch.manual_seed(SEED)
    tokenizer = AutoTokenizer.from_pretrained(env.model, padding_side="left")
    dataset = Dataset.from_dict({"input_ids": template_ids(tokenizer, batch_prompts(case))})
    load = dict(dtype=torch.float32, attn_implementation="sdpa")
    policy = AutoModelForCausalLM.from_pretrained(env.model, **load)
    policy.generation_config.min_new_tokens = case["new_tokens"]
    reward = AutoModelForSequenceClassification.from_pretrained(env.model, num_labels=1, **load)
    value = AutoModelForSequenceClassification.from_pretrained(env.model, num_labels=1, **load)
    lora = case["finetuning"] == "lora"
    ref = None if lora else AutoModelForCausalLM.from_pretrained(env.model, **load)
    # Relay's lora defaults (pipeline/config/sections.py LoraConfig); dropout is off on both sides in effect
    # (TRL's disable_dropout_in_model, Relay's train_without_dropout).
    peft_config = (
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
        if lora
        else None
    )
    batch = case["batch"]
    config = PPOConfig(
        output_dir=str(Path(env.workdir) / f"trl-{case['case']}"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=case["epochs"],
        total_episodes=case["steps"] * batch,
        response_length=case["new_tokens"],
        temperature=1.0,
        stop_token="eos",
        missing_eos_penalty=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        num_sample_generations=0,
        local_rollout_forward_batch_size=batch,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=SEED,
        disable_tqdm=True,
    )
    clock, calls, generated, widths = harness.StepClock(), [], [], []

    class Timer(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            clock.start()

        def on_step_end(self, *args, **kwargs):
            generated.append(sum(n for n, _ in calls))
            widths.append(max((w for _, w in calls), default=0))
            calls.clear()
            clock.mark(generated[-1])

    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=dataset,
        value_model=value,
        peft_config=peft_config,
        callbacks=[Timer()],
    )
    count_generation(trainer.model.policy, tokenizer.eos_token_id, calls)
    first = trainer.data_collator([dataset[i] for i in range(len(dataset))])["input_ids"]
    with torch.no_grad():
        logits = forward(trainer.policy_model, first, tokenizer.pad_token_id).logits[:, :-1]
    first_loss = prompt_nll(selective_log_softmax(logits, first[:, 1:]), first, first != tokenizer.pad_token_id)
    trainer.train()
    check_generated("peer", generated, case)
    return clock.result(
        first_loss,
        generated_tokens=generated,
        response_width=widths,
        prompts=batch,
        first_loss_is="mean NLL of the prompt batch under the initial policy",
    )
