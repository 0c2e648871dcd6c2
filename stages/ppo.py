"""PPO stage: tune the SFT policy against the reward model (Relay's own PPO on accelerate).

    torchrun --nproc_per_node 1 stages/ppo.py --config configs/ppo.yaml [--train.max_steps 20]

Each step: sample responses for a batch of prompts (KV-cached `generate`), score them with the
reward model (or a Python `reward_fn`), shape per-token rewards with the KL to the reference
policy, estimate advantages with GAE, then run `ppo.epochs` passes of clipped policy and value
updates over mini-batches. Two backbones in LoRA modes (see pipeline/rollout.py): policy and
reference share the SFT backbone, critic and reward share the RM backbone.

Resume restores the adapters (or full weights), optimizer, scheduler, KL controller, reward
normaliser, RNG and prompt position, so a restarted run draws the same rollouts as an unbroken
one. RELAY_STOP_AFTER_STEP=k (pipeline/training.py) saves and exits after step k.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm.auto import tqdm

from data_formats.sampling import DataCursor, next_micro_batches
from pipeline import rl
from pipeline.config import ConfigError, ModelConfig, PromptDataConfig, StageConfig, load_config, save_config, to_dict
from pipeline.rollout import ActorCritic, Experience, Generator, HFGenerator, Rollout, actor_critic_backward, assemble, score_rollout

log = logging.getLogger("relay.ppo")

RewardFn = Callable[[list[str], list[list[int]]], torch.Tensor]
REWARD_NORMS = ("none", "running", "stored")


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class PPOData(PromptDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/ppo/train.jsonl"])
    """Prompt files (`{"prompt": ...}` or chat records whose last turn is the user's)."""
    eval: list[str] = field(default_factory=lambda: ["data/sample/ppo/valid.jsonl"])
    """Held-out prompts for `eval/reward` and `eval/kl`."""


@dataclass
class RewardModelConfig(ModelConfig):
    """The reward model: a merged RM folder (sequence classifier with one output). 'embedded'
    loads the embedded model with a fresh random head, only sensible for smoke runs. Its
    `finetuning` and `gradient_checkpointing` are ignored: the critic trained on it follows
    `model.finetuning` and `model.gradient_checkpointing`."""


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    """Longest response sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature (log-probs for the PPO ratio use the same temperature)."""
    top_k: int = 0
    """Must stay 0: truncating the distribution would make the sampled tokens' log-probs differ
    from the ones the PPO ratio scores (kept as a key so a config that sets it gets that reason)."""
    top_p: float = 1.0
    """Must stay 1.0, for the same reason as top_k."""
    missing_eos_penalty: Optional[float] = 1.0
    """Subtracted from the (normalised) score of a response that hits max_new_tokens without EOS."""


@dataclass
class PPOSection:
    epochs: int = 2
    """Passes of PPO updates over each rollout batch."""
    mini_batch_size: Optional[int] = None
    """Samples per optimizer step (per device; None: the whole rollout batch). Each mini-batch is
    split into train.grad_accum micro-batches."""
    kl_coef: float = 0.05
    """KL penalty coefficient (the initial one when kl_target is set)."""
    kl_target: Optional[float] = None
    """Target KL per response for Ziegler's adaptive controller (None: fixed coefficient)."""
    kl_horizon: float = 10000
    """Adaptive controller horizon, in samples."""
    kl_estimator: str = "k1"
    """Per-token KL estimator in the reward: k1 (log-ratio) or k3 (non-negative, lower variance)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    cliprange: float = 0.2
    """Policy ratio clip."""
    cliprange_value: float = 0.2
    """Value clip around the rollout's values."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    whiten_advantages: bool = True
    """Normalise advantages to zero mean, unit variance per rollout batch."""
    reward_norm: str = "running"
    """Score normalisation: none | running (statistics of every reward so far) | stored (the RM's
    manifest `reward_stats`)."""
    reward_clip: Optional[float] = 5.0
    """Clip (normalised) scores to [-reward_clip, reward_clip] (None: no clipping)."""
    samples_logged: int = 2
    """Prompt/response/reward samples written to the tracker each logged step."""

    def problems(self, key: str = "ppo") -> list[str]:
        out: list[str] = []
        if self.epochs < 1:
            out.append(f"{key}.epochs: must be >= 1, got {self.epochs}")
        if self.kl_estimator not in rl.KL_ESTIMATORS:
            out.append(f"{key}.kl_estimator: {self.kl_estimator!r} is not one of {rl.KL_ESTIMATORS}")
        if self.reward_norm not in REWARD_NORMS:
            out.append(f"{key}.reward_norm: {self.reward_norm!r} is not one of {REWARD_NORMS}")
        if self.kl_target is not None and (self.kl_target <= 0 or self.kl_horizon <= 0):
            out.append(f"{key}.kl_target/kl_horizon: must be > 0 for the adaptive controller")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                out.append(f"{key}.{name}: must be in [0, 1], got {getattr(self, name)!r}")
        return out


@dataclass
class PPOConfig(StageConfig):
    output_dir: str = "outputs/ppo"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (the final policy), summary.json."""
    data: PPOData = field(default_factory=PPOData)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    ppo: PPOSection = field(default_factory=PPOSection)

    def problems(self) -> list[str]:
        out = super().problems()
        batch, accum = self.train.batch_size, self.train.grad_accum
        mini = self.ppo.mini_batch_size or batch
        if batch % mini:
            out.append(f"ppo.mini_batch_size: {mini} does not divide train.batch_size {batch}")
        elif mini % accum:
            out.append(f"train.grad_accum: {accum} does not divide the mini-batch of {mini}")
        if self.generation.max_new_tokens < 1:
            out.append("generation.max_new_tokens: must be >= 1")
        if self.generation.temperature <= 0:
            out.append("generation.temperature: must be > 0")
        if self.generation.top_k != 0 or self.generation.top_p != 1.0:
            out.append("generation.top_k/top_p: PPO samples from the full distribution (top_k 0, top_p 1.0), because the "
                       "ratio scores log-probs of softmax(logits / temperature); use temperature to sharpen sampling")
        return out


def validate(cfg: PPOConfig) -> None:
    """Every problem with the config at once.

    Raises:
        ConfigError: listing each problem.
    """
    from pipeline.models import resolve_model_path
    from pipeline.training import data_problems, parent_problems

    found = cfg.problems() + data_problems(cfg.data.train, "data.train") + data_problems(cfg.data.eval, "data.eval")
    found += parent_problems(resolve_model_path(cfg.model.path))
    if found:
        raise ConfigError(found)


# ------------------------------------------------------------------------------------------
# Setup: compatibility check, models, prompts, reward normaliser
# ------------------------------------------------------------------------------------------


def check_shared_tokenizer(policy_path: str, reward_path: str) -> None:
    """The policy and the reward model must tokenise identically (the RM scores policy ids).

    Raises:
        ValueError: tokenizer hashes or vocab sizes differ (both values shown).
    """
    from pipeline.manifest import tokenizer_hash, vocab_size_of

    problems = []
    for name, fn in (("tokenizer hash", tokenizer_hash), ("vocab size", vocab_size_of)):
        a, b = fn(policy_path), fn(reward_path)
        if a != b:
            problems.append(f"{name}: policy {policy_path} has {a}, reward model {reward_path} has {b}")
    if problems:
        raise ValueError("the policy and the reward model do not share a tokenizer:\n  " + "\n  ".join(problems))


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.requires_grad_(False)
    return model.eval()


def build_models(cfg: PPOConfig, tokenizer) -> ActorCritic:
    """The actor-critic: LoRA modes share backbones (adapter disabled = reference / reward);
    full mode loads separate frozen copies of the policy and the reward model.

    Raises:
        ValueError / OSError: from pipeline.models.load_model.
    """
    from pipeline.models import load_model, train_without_dropout

    rm_cfg = dataclasses.replace(cfg.reward_model, finetuning=cfg.model.finetuning,
                                 gradient_checkpointing=cfg.model.gradient_checkpointing)
    policy = load_model(cfg.model, cfg.lora, kind="causal", tokenizer=tokenizer)
    critic = load_model(rm_cfg, cfg.lora, kind="reward", tokenizer=tokenizer)
    reference = reward = None
    if cfg.model.finetuning == "full":
        reference = _frozen(load_model(cfg.model, None, kind="causal", tokenizer=tokenizer))
        reward = _frozen(load_model(rm_cfg, None, kind="reward", tokenizer=tokenizer))
    # The update's forward must reproduce the rollout's log-probs (the first ratio is 1), so no
    # dropout anywhere; train mode stays on so gradient checkpointing runs.
    return ActorCritic(train_without_dropout(policy), train_without_dropout(critic), reference, reward)


def make_normaliser(cfg: PPOConfig, reward_path: str) -> rl.RunningMoments:
    """The reward normaliser: running statistics from scratch, or the RM's stored ones.

    Raises:
        ValueError: reward_norm 'stored' but the RM folder records no reward_stats.
    """
    if cfg.ppo.reward_norm != "stored":
        return rl.RunningMoments()
    from pipeline.manifest import read_manifest

    stats = (read_manifest(reward_path) or {}).get("reward_stats")
    if not stats:
        raise ValueError(f"ppo.reward_norm is 'stored' but {reward_path}/manifest.json has no reward_stats (train the RM with stages/reward.py)")
    return rl.RunningMoments(stats["mean"], stats["std"], stats["n"])


# ------------------------------------------------------------------------------------------
# Rollout and experience
# ------------------------------------------------------------------------------------------


def shape_scores(raw: torch.Tensor, finished: torch.Tensor, normaliser: rl.RunningMoments, cfg: PPOConfig, gathered: torch.Tensor) -> torch.Tensor:
    """Normalise (updating running statistics with every rank's raw scores), clip, then subtract
    the missing-EOS penalty."""
    if cfg.ppo.reward_norm == "running":
        normaliser.update(gathered)
    scores = normaliser.normalise(raw) if cfg.ppo.reward_norm != "none" else raw.clone()
    if cfg.ppo.reward_clip:
        scores = scores.clamp(-cfg.ppo.reward_clip, cfg.ppo.reward_clip)
    if cfg.generation.missing_eos_penalty:
        scores = scores - cfg.generation.missing_eos_penalty * (~finished).to(scores.dtype)
    return scores


def make_experience(model: ActorCritic, rollout: Rollout, prompts_text: list[str], *, cfg: PPOConfig, kl_coef: float,
                    normaliser: rl.RunningMoments, reward_fn: Optional[RewardFn], accelerator) -> Experience:
    """Score a rollout and turn it into advantages and returns."""
    micro = (cfg.ppo.mini_batch_size or cfg.train.batch_size) // cfg.train.grad_accum
    s = score_rollout(model, rollout, micro=micro, temperature=cfg.generation.temperature, autocast=accelerator.autocast)
    raw = s["rm"] if reward_fn is None else reward_fn(prompts_text, rollout.responses).detach().float().cpu()
    gathered = accelerator.gather(raw.to(accelerator.device)).cpu()
    scores = shape_scores(raw, rollout.finished, normaliser, cfg, gathered)
    mask = rollout.response_mask
    kl = rl.kl_per_token(s["old"], s["ref"], cfg.ppo.kl_estimator) * mask
    rewards = rl.token_rewards(scores, kl, mask, kl_coef)
    advantages, returns = rl.gae(rewards, s["values"], mask, cfg.ppo.gamma, cfg.ppo.lam)
    if cfg.ppo.whiten_advantages and mask.sum() > 1:
        advantages = rl.masked_whiten(advantages, mask)
    return Experience(rollout, s["old"], s["ref"], s["values"] * mask, advantages, returns, kl, raw, scores, s["entropy"])


# ------------------------------------------------------------------------------------------
# The PPO update
# ------------------------------------------------------------------------------------------


def ppo_update(model, optimizer, exp: Experience, accelerator, cfg: PPOConfig, step: int) -> dict[str, float]:
    """`ppo.epochs` passes over the rollout in shuffled mini-batches, one optimizer step each.

    Also reports `ratio_dev_first`: max |ratio - 1| on the first micro-batch before any update
    (0 when the update reproduces the rollout log-probs, as it must).

    Raises:
        NonFiniteError: a non-finite loss or gradient (before the optimizer steps).
    """
    from accelerate.utils import DistributedType

    from pipeline.training import _is_deepspeed, check_finite, clip_gradients

    B = exp.old_logprobs.shape[0]
    mini = cfg.ppo.mini_batch_size or cfg.train.batch_size
    accum = cfg.train.grad_accum
    micro = mini // accum
    # DeepSpeed divides each backward by its own accumulation count; elsewhere we average here.
    scale = 1.0 if _is_deepspeed(accelerator) else 1.0 / accum
    separate = accelerator.distributed_type == DistributedType.NO
    order_gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
    stats: dict[str, list[float]] = defaultdict(list)
    for epoch in range(cfg.ppo.epochs):
        # The first pass keeps rollout order so its micro-batches are exactly those of the rollout.
        order = torch.arange(B) if epoch == 0 else torch.randperm(B, generator=order_gen)
        for start in range(0, B, mini):
            rows = order[start : start + mini]
            total = 0.0
            for k in range(accum):
                sync = contextlib.nullcontext() if k == accum - 1 else accelerator.no_sync(model)
                with sync:
                    micro_stats = actor_critic_backward(model, exp, rows[k * micro : (k + 1) * micro], accelerator, scale=scale, separate=separate,
                                                        temperature=cfg.generation.temperature, cliprange=cfg.ppo.cliprange,
                                                        cliprange_value=cfg.ppo.cliprange_value, vf_coef=cfg.ppo.vf_coef)
                if not stats["ratio_dev_first"]:
                    stats["ratio_dev_first"].append(micro_stats["ratio_dev"])
                total += micro_stats.pop("loss") / accum
                micro_stats.pop("ratio_dev")
                for key, value in micro_stats.items():
                    stats[key].append(value)
            grad_norm = clip_gradients(model, accelerator, cfg.train.max_grad_norm)
            check_finite(total, model, step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stats["grad_norm"].append(grad_norm)
    return {k: sum(v) / len(v) for k, v in stats.items()}


def _mean_over_ranks(value: float, accelerator) -> float:
    return float(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction="mean"))


def step_metrics(exp: Experience, update: dict, accelerator, *, kl_coef: float, gen_frac: float, lr: float) -> dict[str, float]:
    """The ppo/* scalars of one step (rollout statistics averaged over ranks)."""
    mask = exp.rollout.response_mask
    seq_kl = exp.kl.sum(1)
    local = {
        "ppo/reward_raw": float(exp.raw_scores.mean()),
        "ppo/reward_norm": float(exp.scores.mean()),
        "ppo/kl": float(seq_kl.mean()),
        "ppo/entropy": float(rl.masked_mean(exp.entropy, mask)),
        "ppo/response_length": float(mask.sum(1).float().mean()),
    }
    out = {k: _mean_over_ranks(v, accelerator) for k, v in local.items()}
    out.update({f"ppo/{k}": _mean_over_ranks(v, accelerator) for k, v in update.items() if k != "grad_norm"})
    out.update({"ppo/kl_coef": kl_coef, "ppo/gen_time_frac": gen_frac, "train/lr": lr, "train/grad_norm": update.get("grad_norm", float("nan"))})
    return out


def sample_text(tokenizer, prompts_text: list[str], exp: Experience, n: int) -> str:
    """A few prompt / response / reward triples as markdown, for the tracker."""
    parts = []
    for i in range(min(n, len(prompts_text))):
        response = tokenizer.decode(exp.rollout.responses[i], skip_special_tokens=False)
        parts.append(f"**prompt**: {prompts_text[i]}\n\n**response**: {response}\n\n**reward**: {float(exp.raw_scores[i]):.4f}")
    return "\n\n---\n\n".join(parts)


# ------------------------------------------------------------------------------------------
# Evaluation
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: ActorCritic, generator: Generator, prompts: list[dict], cfg: PPOConfig, accelerator, reward_fn: Optional[RewardFn],
             pad_id: int, eos_ids: list[int]) -> dict[str, float]:
    """Mean raw reward and mean per-response KL (k1) on held-out prompts.

    Sampling runs under a forked RNG seeded the same way at every evaluation, so evaluations see
    the same random numbers (less noise between them) and training's RNG stream is untouched.
    """
    from pipeline.checkpoint import seeded_fork
    from pipeline.training import eval_shards

    rewards, kls, weights = [], [], []
    shards = eval_shards(len(prompts), cfg.train.batch_size, accelerator.num_processes, accelerator.process_index, cfg.train.eval_batches)
    with seeded_fork(cfg.train.seed + 1):
        for indices, counts in shards:
            batch = [prompts[i] for i in indices]
            rollout = assemble([p["prompt_ids"] for p in batch], generator.generate([p["prompt_ids"] for p in batch]), pad_id, eos_ids)
            s = score_rollout(model, rollout, micro=cfg.train.batch_size, temperature=cfg.generation.temperature, autocast=accelerator.autocast)
            raw = s["rm"] if reward_fn is None else reward_fn([p["text"] for p in batch], rollout.responses).float().cpu()
            kl = (rl.kl_per_token(s["old"], s["ref"], "k1") * rollout.response_mask).sum(1)
            rewards.append(raw.sum() * counts)
            kls.append(kl.sum() * counts)
            weights.append(torch.tensor(float(len(batch) * counts)))
    totals = torch.stack([torch.stack(rewards).sum(), torch.stack(kls).sum(), torch.stack(weights).sum()]) if weights else torch.zeros(3)
    totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu() if accelerator.num_processes > 1 else totals
    n = float(totals[2]) or float("nan")
    return {"eval/reward": float(totals[0]) / n, "eval/kl": float(totals[1]) / n}


# ------------------------------------------------------------------------------------------
# Checkpoint state
# ------------------------------------------------------------------------------------------


@dataclass
class RunState:
    """What the loop carries between steps besides the model and optimizer."""

    step: int
    cursor: DataCursor
    kl_controller: "rl.FixedKLController | rl.AdaptiveKLController"
    normaliser: rl.RunningMoments
    history: dict


def checkpoint_state(model, optimizer, scheduler, accelerator, run: RunState) -> dict:
    """Every part a resumed run needs (see the module docstring)."""
    from pipeline.checkpoint import rng_state
    from pipeline.training import trainable_state

    return {
        "model": trainable_state(model, accelerator),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "trainer": {"step": run.step, "kl_controller": run.kl_controller.state_dict(), "normaliser": run.normaliser.state_dict(), "history": run.history},
        "data": dataclasses.asdict(run.cursor),
        "rng": rng_state(),
    }


def restore_state(state: dict, model, optimizer, scheduler, accelerator, run: RunState) -> None:
    """Load a checkpoint's parts into the model, optimizer, scheduler and `run`.

    Raises:
        KeyError: the checkpoint's weights do not match the model.
    """
    from pipeline.checkpoint import set_rng_state
    from pipeline.training import load_trainable_state

    load_trainable_state(model, state["model"], accelerator)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    trainer = state["trainer"]
    run.step = int(trainer["step"])
    run.kl_controller.load_state_dict(trainer["kl_controller"])
    run.normaliser.load_state_dict(trainer["normaliser"])
    run.history = trainer["history"]
    run.cursor = DataCursor(**state["data"])
    if "rng" in state:
        set_rng_state(state["rng"])
    else:
        log.warning("the checkpoint has no RNG state for this rank: rollouts will differ from an unbroken run")


def export_policy(s: Setup, cfg: PPOConfig, chat_template: Optional[str]) -> Path:
    """Save the adapters and merge the policy into <output_dir>/merged (the pipeline's final model).
    The models, optimizer and scheduler in `s` are released before the merge loads the base again.

    Raises:
        MergeError: the merged folder does not reproduce base + adapter.
    """
    from pipeline.manifest import weights_hash
    from pipeline.merge import export_full_model, merge_adapter

    acc, out = s.accelerator, Path(cfg.output_dir)
    merged = out / "merged"
    full = cfg.model.finetuning == "full"
    # The reward model the policy was optimised against: the driver re-runs PPO when it changes.
    extra = {"reward_model": {"path": s.reward_path, "weights_hash": weights_hash(s.reward_path)}}
    if acc.is_main_process and full:
        export_full_model(s.inner.policy, s.tokenizer, str(merged), parent=s.policy_path, stage="ppo", config=to_dict(cfg),
                          chat_template=chat_template, overwrite=True, extra_manifest=extra)
    elif acc.is_main_process:
        s.inner.policy.save_pretrained(out / "adapter")
        s.inner.critic.save_pretrained(out / "critic_adapter")
    s.inner = s.generator = None
    s.model, s.optimizer, s.scheduler = acc.free_memory(s.model, s.optimizer, s.scheduler)
    if acc.is_main_process and not full:
        merge_adapter(s.policy_path, str(out / "adapter"), str(merged), kind="causal", stage="ppo", config=to_dict(cfg),
                      chat_template=chat_template, overwrite=True, extra_manifest=extra)
    acc.wait_for_everyone()
    return merged


def summarize(history: dict, step: int, wall: float) -> dict:
    """summary.json's figures."""
    rewards, evals = history["reward"], history["eval_reward"]
    return {
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "kl_last": history["kl"][-1] if history["kl"] else None,
        "eval_reward_first": evals[0] if evals else None,
        "eval_reward_last": evals[-1] if evals else None,
        "eval_kl_last": history["eval_kl"][-1] if history["eval_kl"] else None,
        "steps": step,
        "wall_seconds": history["wall_before"] + wall,
    }


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


def setup_data(cfg: PPOConfig, tokenizer):
    """(template, train prompts, eval prompts); eval prompts are empty when evaluation is off.

    Raises:
        DataError: bad records (strict mode), naming file:line.
    """
    from data_formats.datasets import build_prompt_data
    from data_formats.render import make_template

    template = make_template(cfg.data, tokenizer)
    train_prompts = build_prompt_data(cfg.data, tokenizer, template, "train")
    has_eval = cfg.train.eval_steps > 0 and (cfg.data.eval or cfg.data.eval_fraction > 0)
    eval_prompts = build_prompt_data(cfg.data, tokenizer, template, "eval") if has_eval else []
    return template, train_prompts, eval_prompts


@dataclass
class Setup:
    """Everything the loop needs, built once by `setup` (export_policy releases the models,
    optimizer and scheduler: None afterwards)."""

    accelerator: object
    model: torch.nn.Module  # the accelerate-prepared ActorCritic
    inner: ActorCritic  # the same, unwrapped
    optimizer: object
    scheduler: object
    tokenizer: object
    template: object
    train_prompts: list[dict]
    eval_prompts: list[dict]
    generator: Generator
    policy_path: str
    reward_path: str

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]


def setup(cfg: PPOConfig, generator_factory: Optional[Callable[[torch.nn.Module], Generator]] = None) -> Setup:
    """Check the config and the tokenizers, load models and prompts, build optimizer and scheduler.

    Raises:
        ConfigError, ValueError (tokenizer mismatch), DataError, OSError (missing model).
    """
    from pipeline.embedded import is_embedded
    from pipeline.models import load_tokenizer, resolve_model_path
    from pipeline.schedule import build_scheduler
    from pipeline.training import build_optimizer, setup_accelerator

    validate(cfg)
    accelerator = setup_accelerator(cfg)
    policy_path, rm_path = resolve_model_path(cfg.model.path), resolve_model_path(cfg.reward_model.path)
    if is_embedded(cfg.reward_model.path):
        log.warning("reward_model.path is the embedded model: its reward head is random (smoke runs only)")
    check_shared_tokenizer(policy_path, rm_path)
    torch.manual_seed(cfg.train.seed)  # LoRA init and a fresh reward head depend on it
    tokenizer = load_tokenizer(policy_path, cfg.model.trust_remote_code)
    template, train_prompts, eval_prompts = setup_data(cfg, tokenizer)
    model = build_models(cfg, tokenizer)
    for frozen in (model.reference, model.reward):
        if frozen is not None:
            frozen.to(accelerator.device)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(prepared)
    gen = cfg.generation
    generator = generator_factory(inner.policy) if generator_factory else HFGenerator(
        inner.policy, tokenizer.pad_token_id, [tokenizer.eos_token_id], gen.max_new_tokens, gen.temperature)
    return Setup(accelerator, prepared, inner, optimizer, scheduler, tokenizer, template, train_prompts, eval_prompts, generator, policy_path, rm_path)


def new_run_state(cfg: PPOConfig, reward_path: str) -> RunState:
    """The loop state of a fresh run."""
    history = {"reward": [], "kl": [], "eval_reward": [], "eval_kl": [], "wall_before": 0.0}
    controller = rl.make_kl_controller(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
    return RunState(0, DataCursor(), controller, make_normaliser(cfg, reward_path), history)


def ppo_step(s: Setup, run: RunState, cfg: PPOConfig, reward_fn: Optional[RewardFn] = None) -> tuple[dict, Experience, list[str]]:
    """One PPO step (rollout, scoring, update, scheduler, KL controller); advances `run`.

    Returns (metrics, experience, prompt texts).
    """
    acc = s.accelerator
    step = run.step + 1
    t0 = time.perf_counter()
    (indices,), run.cursor = next_micro_batches(len(s.train_prompts), run.cursor, seed=cfg.train.seed, batch_size=cfg.train.batch_size,
                                                grad_accum=1, world_size=acc.num_processes, rank=acc.process_index)
    batch = [s.train_prompts[i] for i in indices]
    prompt_ids, texts = [p["prompt_ids"] for p in batch], [p["text"] for p in batch]
    rollout = assemble(prompt_ids, s.generator.generate(prompt_ids), s.pad_id, s.eos_ids)
    gen_time = time.perf_counter() - t0
    exp = make_experience(s.inner, rollout, texts, cfg=cfg, kl_coef=run.kl_controller.value, normaliser=run.normaliser,
                          reward_fn=reward_fn, accelerator=acc)
    update = ppo_update(s.model, s.optimizer, exp, acc, cfg, step)
    lr = s.scheduler.get_last_lr()[0]
    s.scheduler.step()
    metrics = step_metrics(exp, update, acc, kl_coef=run.kl_controller.value, gen_frac=gen_time / (time.perf_counter() - t0), lr=lr)
    run.kl_controller.update(metrics["ppo/kl"], cfg.train.batch_size * acc.num_processes)
    run.step = step
    run.history["reward"].append(metrics["ppo/reward_raw"])
    run.history["kl"].append(metrics["ppo/kl"])
    return metrics, exp, texts


def run_eval(s: Setup, run: RunState, cfg: PPOConfig, tracker, reward_fn: Optional[RewardFn]) -> None:
    """Evaluate, record in the history and log at the current step."""
    result = evaluate(s.inner, s.generator, s.eval_prompts, cfg, s.accelerator, reward_fn, s.pad_id, s.eos_ids)
    run.history["eval_reward"].append(result["eval/reward"])
    run.history["eval_kl"].append(result["eval/kl"])
    tracker.log(result, run.step)


def train(cfg: PPOConfig, *, reward_fn: Optional[RewardFn] = None,
          generator_factory: Optional[Callable[[torch.nn.Module], Generator]] = None,
          on_step: Optional[Callable[[int, dict, Experience], None]] = None) -> dict:
    """Run the PPO stage; return its summary (also written to summary.json).

    `reward_fn(prompt_texts, response_ids) -> [B] tensor` replaces the reward model's score (the
    RM backbone still hosts the critic). `generator_factory(policy)` swaps the sampler.
    `on_step(step, metrics, experience)` is called after every step (notebooks, tests).

    Raises:
        ConfigError, ValueError (tokenizer mismatch, missing reward_stats), DataError, NonFiniteError.
    """
    from data_formats.render import template_jinja
    from pipeline.checkpoint import Checkpointer
    from pipeline.tracking import Tracker, default_run_name
    from pipeline.training import stop_after_step, write_summary

    started = time.time()
    s = setup(cfg, generator_factory)
    acc, out = s.accelerator, Path(cfg.output_dir)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
    run = new_run_state(cfg, s.reward_path)
    checkpointer = Checkpointer(out / "checkpoints", cfg.checkpoint, rank=acc.process_index, world_size=acc.num_processes,
                                barrier=acc.wait_for_everyone)
    resume = checkpointer.resume_path()
    if resume is not None:
        restore_state(checkpointer.load(resume), s.model, s.optimizer, s.scheduler, acc, run)
        log.info("resumed from %s at step %d", resume, run.step)
    tracker = Tracker(cfg.tracking, out, default_run_name("ppo"), to_dict(cfg), enabled=acc.is_main_process)
    if s.eval_prompts and run.step == 0:
        run_eval(s, run, cfg, tracker, reward_fn)
    stop_at = stop_after_step()
    bar = tqdm(total=cfg.train.max_steps, initial=run.step, desc="ppo", disable=not acc.is_local_main_process)
    while run.step < cfg.train.max_steps:
        metrics, exp, texts = ppo_step(s, run, cfg, reward_fn)
        step = run.step
        if step % cfg.train.log_steps == 0:
            tracker.log(metrics, step)
            tracker.log_text("ppo/samples", sample_text(s.tokenizer, texts, exp, cfg.ppo.samples_logged), step)
        if s.eval_prompts and (step % cfg.train.eval_steps == 0 or step == cfg.train.max_steps):
            run_eval(s, run, cfg, tracker, reward_fn)
        if on_step is not None:
            on_step(step, metrics, exp)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['ppo/reward_raw']:.3f}", kl=f"{metrics['ppo/kl']:.3f}")
        kind = checkpointer.due(step) or ("temporary" if step == stop_at else None)
        if kind:
            run.history["wall_before"] += time.time() - started
            started = time.time()
            checkpointer.save(step, checkpoint_state(s.model, s.optimizer, s.scheduler, acc, run), kind=kind)
        if step == stop_at:
            log.warning("RELAY_STOP_AFTER_STEP=%d: checkpoint saved, stopping", step)
            bar.close()
            tracker.close()
            return {"stopped_at": step}
    bar.close()
    tracker.close()
    export_policy(s, cfg, template_jinja(s.template, s.tokenizer))
    summary = summarize(run.history, run.step, time.time() - started)
    if acc.is_main_process:
        write_summary(out, summary)
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=os.environ.get("RELAY_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(PPOConfig, argv, prog="stages/ppo.py")
        summary = train(cfg)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
