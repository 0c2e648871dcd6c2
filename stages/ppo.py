"""PPO stage: tune the SFT policy against the reward model (Relay's own PPO on accelerate).

    torchrun --nproc_per_node 1 stages/ppo.py --config configs/ppo.yaml [--train.max_steps 20]

Each step (`PPOStage.train_step`): sample responses for a batch of prompts (Relay's decode engine,
`generation.backend`, from exactly the distribution the ratio scores), score them with the reward model (or
a Python `reward_fn`) at the end-of-turn token the RM was trained to score, shape per-token
rewards with the KL to the reference policy, estimate advantages with GAE, then run `ppo.epochs`
passes of clipped policy and value updates over mini-batches (pipeline/algorithms/experience.py). Two
backbones in LoRA modes (see pipeline/algorithms/rollout.py): policy and reference share the SFT backbone,
critic and reward share the RM backbone.

Resume is the engine's (pipeline/engine/stage.py): adapters (or full weights), optimizer,
scheduler, RNG, prompt position, and this stage's KL controller and reward normaliser, so a
restarted run draws the same rollouts as an unbroken one.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from pipeline.algorithms import rl
from pipeline.config import ModelConfig, PromptDataConfig, StageConfig
from pipeline.engine.accelerator import full_parameters, is_zero3
from pipeline.engine.stage import Stage, main
from pipeline.algorithms.experience import RewardFn, make_experience, ppo_update, sample_text, step_metrics
from pipeline.algorithms.rollout import GENERATION_BACKENDS, ActorCritic, Generator, assemble, make_generator, score_rollout

log = logging.getLogger("relay.ppo")

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
    """The reward model: a merged RM folder (sequence classifier with one output). Its
    `finetuning` and `gradient_checkpointing` are ignored: the critic trained on it follows
    `model.finetuning` and `model.gradient_checkpointing`."""

    path: str = ""
    """Required: the RM stage's merged/ folder (the pipeline driver sets it). 'embedded' (a
    random reward head) only with allow_untrained."""
    allow_untrained: bool = False
    """Allow a reward model with an untrained head ('embedded'): PPO then optimises noise, so
    only for smoke runs of the machinery."""


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
    backend: str = "relay"
    """The sampler: relay (Relay's decode engine: static KV cache, batch-level early exit) or hf
    (transformers' generate, the reference). Both draw from the same distribution and RNG stream."""

    def problems(self, key: str = "generation") -> list[str]:
        out: list[str] = []
        if self.max_new_tokens < 1:
            out.append(f"{key}.max_new_tokens: must be >= 1")
        if self.temperature <= 0:
            out.append(f"{key}.temperature: must be > 0")
        if self.backend not in GENERATION_BACKENDS:
            out.append(f"{key}.backend: {self.backend!r} is not one of {GENERATION_BACKENDS}")
        if self.top_k != 0 or self.top_p != 1.0:
            out.append(f"{key}.top_k/top_p: RL stages sample from the full distribution (top_k 0, top_p 1.0), because the "
                       "ratio scores log-probs of softmax(logits / temperature); use temperature to sharpen sampling")
        return out

    def room_problems(self, seq_length: int) -> list[str]:
        """A prompt and its response must fit train.seq_length."""
        if 1 <= self.max_new_tokens and seq_length <= self.max_new_tokens:
            return [f"train.seq_length: {seq_length} leaves no room for a prompt before generation.max_new_tokens "
                    f"{self.max_new_tokens}"]
        return []


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
        for name in ("cliprange", "cliprange_value", "reward_clip"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                out.append(f"{key}.{name}: must be > 0, got {value!r}")
        for name in ("kl_coef", "vf_coef"):
            if getattr(self, name) < 0:
                out.append(f"{key}.{name}: must be >= 0, got {getattr(self, name)!r}")
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
        mini = batch if self.ppo.mini_batch_size is None else self.ppo.mini_batch_size
        if mini < 1:
            out.append(f"ppo.mini_batch_size: must be >= 1 (or null for the whole rollout batch), got {mini}")
        elif batch >= 1 and batch % mini:
            out.append(f"ppo.mini_batch_size: {mini} does not divide train.batch_size {batch}")
        elif accum >= 1 and mini % accum:
            out.append(f"train.grad_accum: {accum} does not divide the mini-batch of {mini}")
        return out + self.generation.room_problems(self.train.seq_length)


# ------------------------------------------------------------------------------------------
# Pieces: tokenizer check, models, reward normaliser
# ------------------------------------------------------------------------------------------


def tokenizer_problems(policy_path: str, reward_path: str) -> list[str]:
    """The policy and the reward model must tokenise identically (the RM scores policy ids)."""
    from pipeline.modeling.manifest import tokenizer_hash, vocab_size_of

    problems = []
    for name, fn in (("tokenizer hash", tokenizer_hash), ("vocab size", vocab_size_of)):
        a, b = fn(policy_path), fn(reward_path)
        if a != b:
            problems.append(f"reward_model.path: the policy and the reward model do not share a tokenizer: {name}: "
                            f"policy {policy_path} has {a}, reward model {reward_path} has {b}")
    return problems


def reward_model_problems(rm: "RewardModelConfig", reward_path: str, policy_path: str, stage: str) -> list[str]:
    """What keeps `rm` (resolved to `reward_path`) from scoring `policy_path`'s samples: the
    embedded model without `allow_untrained` (a random head), no folder, not a reward model
    (preflight), code it may not run, another tokenizer. One line each; PPO and GRPO use it."""
    from pipeline.modeling.embedded import is_embedded
    from pipeline.modeling.models import remote_code_problems
    from pipeline.modeling.preflight import model_problems

    if is_embedded(rm.path):
        if not rm.allow_untrained:
            return [f"reward_model.path: {stage} needs a trained reward model: give the RM stage's merged/ folder "
                    "(or set reward_model.allow_untrained: true to smoke-test with a random reward head)"]
        log.warning("reward_model.path is the embedded model: its reward head is random (smoke runs only)")
    if not Path(reward_path).is_dir():
        return [f"reward_model.path: {rm.path!r} is not a model folder (give the RM stage's merged/)"]
    found = model_problems(reward_path, "reward_model.path", need="any" if rm.allow_untrained else "reward")
    found += remote_code_problems(rm, "reward_model")
    return found or tokenizer_problems(policy_path, reward_path)


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.requires_grad_(False)
    return model.eval()


def build_models(cfg: PPOConfig, tokenizer) -> ActorCritic:
    """The actor-critic: LoRA modes share backbones (adapter disabled = reference / reward);
    full mode loads separate frozen copies of the policy and the reward model.

    Raises:
        ValueError / OSError: from pipeline.modeling.models.load_model.
    """
    from pipeline.modeling.models import load_model, train_without_dropout

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
    from pipeline.modeling.manifest import read_manifest

    stats = (read_manifest(reward_path) or {}).get("reward_stats")
    if not stats:
        raise ValueError(f"ppo.reward_norm is 'stored' but {reward_path}/manifest.json has no reward_stats (train the RM with stages/reward.py)")
    return rl.RunningMoments(stats["mean"], stats["std"], stats["n"])


# ------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------


class PPOStage(Stage):
    name = "ppo"
    config_class = PPOConfig
    evaluates_at_start = True

    def __init__(self, cfg: PPOConfig, *, reward_fn: Optional[RewardFn] = None,
                 generator_factory: Optional[Callable[[torch.nn.Module], Generator]] = None):
        """`reward_fn(prompt_texts, response_ids) -> [B] tensor` replaces the reward model's score (the
        RM backbone still hosts the critic); `generator_factory(policy)` swaps the sampler."""
        from pipeline.modeling.models import resolve_model_path

        super().__init__(cfg)
        self.reward_path = resolve_model_path(cfg.reward_model.path)
        self.reward_fn, self.generator_factory = reward_fn, generator_factory
        self._generator: Optional[Generator] = None
        self.kl_controller = rl.make_kl_controller(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
        self.normaliser: Optional[rl.RunningMoments] = None
        self.last_experience = None
        """The latest step's experience (tests and notebooks read it from `on_step`)."""

    def problems(self) -> list[str]:
        return reward_model_problems(self.cfg.reward_model, self.reward_path, self.model_path, "PPO")

    def build_data(self) -> list[str]:
        """Prompts (eval prompts only when evaluation is on) and the reward normaliser."""
        from data_formats.datasets import build_prompt_data
        from data_formats.render import make_template, template_jinja

        cfg, tok = self.cfg, self.tokenizer
        template = make_template(cfg.data, tok)
        self.chat_template = template_jinja(template, tok)
        # A prompt and its response must fit train.seq_length.
        limit = min(cfg.data.max_prompt_length, cfg.train.seq_length - cfg.generation.max_new_tokens)
        self.train_samples = build_prompt_data(cfg.data, tok, template, "train", limit)
        if cfg.train.eval_steps > 0 and (cfg.data.eval or cfg.data.eval_fraction > 0):
            self.eval_samples = build_prompt_data(cfg.data, tok, template, "eval", limit)
        self.normaliser = make_normaliser(cfg, self.reward_path)
        from pipeline.engine.stage import launched_world_size

        world = launched_world_size()
        if len(self.train_samples) < cfg.train.batch_size * world:  # all skipped, dropped overlong, or too few
            return [f"data.train: {len(self.train_samples)} usable prompt(s) cannot fill one rollout batch of "
                    f"{cfg.train.batch_size} x {world} rank(s)"]
        return []

    def build_model(self) -> torch.nn.Module:
        model = build_models(self.cfg, self.tokenizer)
        for frozen in (model.reference, model.reward):
            if frozen is not None:
                frozen.to(self.accelerator.device)
        return model

    def train_mode(self) -> None:
        """build_models left every trained module in train mode with dropout off; keep it so."""

    @property
    def inner(self) -> ActorCritic:
        return self.accelerator.unwrap_model(self.model)

    @property
    def generator(self) -> Generator:
        if self._generator is None:
            policy, gen, tok = self.inner.policy, self.cfg.generation, self.tokenizer
            self._generator = self.generator_factory(policy) if self.generator_factory else make_generator(
                gen.backend, policy, tok.pad_token_id, [tok.eos_token_id], gen.max_new_tokens, gen.temperature,
                synced_gpus=is_zero3(self.accelerator))
        return self._generator

    def rollout(self, prompts: list[dict]):
        """Sampled responses for `prompts`, laid out for scoring (pipeline.algorithms.rollout.Rollout)."""
        ids = [p["prompt_ids"] for p in prompts]
        return assemble(ids, self.generator.generate(ids), self.tokenizer.pad_token_id, [self.tokenizer.eos_token_id])

    def train_step(self) -> dict[str, float]:
        """Rollout, scoring, update and the KL controller: one PPO step."""
        cfg, acc, step = self.cfg, self.accelerator, self.step + 1
        started = time.perf_counter()
        (indices,) = self.next_sample_indices(grad_accum=1)
        batch = [self.train_samples[i] for i in indices]
        # Sampling and scoring call the unwrapped models: under FSDP their weights must be whole.
        with full_parameters(acc, self.model):
            rollout = self.rollout(batch)
            gen_time = time.perf_counter() - started
            texts = [p["text"] for p in batch]
            exp = make_experience(self.inner, rollout, texts, cfg=cfg, kl_coef=self.kl_controller.value, normaliser=self.normaliser,
                                  reward_fn=self.reward_fn, accelerator=acc)
        update = ppo_update(self.model, self.optimizer, exp, acc, cfg, step)
        figures = step_metrics(exp, update, acc, kl_coef=self.kl_controller.value, gen_frac=gen_time / (time.perf_counter() - started))
        self.kl_controller.update(figures["ppo/kl"], cfg.train.batch_size * acc.num_processes)
        if step % cfg.train.log_steps == 0:
            self.tracker.log_text("ppo/samples", sample_text(self.tokenizer, texts, exp, cfg.ppo.samples_logged), step)
        self.last_experience = exp
        return figures

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """eval/reward (mean raw reward) and eval/kl (mean per-response k1 KL) on held-out prompts.

        Sampling runs under a forked RNG seeded the same way at every evaluation, so evaluations see
        the same random numbers (less noise between them) and training's RNG streams are untouched.
        """
        from pipeline.engine.checkpoint import seeded_fork
        from pipeline.engine.steps import eval_shards

        if not self.eval_samples:
            return None
        cfg, acc = self.cfg, self.accelerator
        rewards, kls, weights = [], [], []
        with seeded_fork(cfg.train.seed + 1), full_parameters(acc, self.model):
            for indices, counts in eval_shards(len(self.eval_samples), cfg.train.batch_size, acc.num_processes,
                                               acc.process_index, cfg.train.eval_batches):
                batch = [self.eval_samples[i] for i in indices]
                rollout = self.rollout(batch)
                s = score_rollout(self.inner, rollout, micro=cfg.train.batch_size, temperature=cfg.generation.temperature,
                                  autocast=acc.autocast)
                raw = s["rm"] if self.reward_fn is None else self.reward_fn([p["text"] for p in batch], rollout.responses).float().cpu()
                kl = (rl.kl_per_token(s["old"], s["ref"], "k1") * rollout.response_mask).sum(1)
                rewards.append(raw.sum() * counts)  # counts False: a short rank's repeated batch
                kls.append(kl.sum() * counts)
                weights.append(torch.tensor(float(len(batch) * counts)))
        totals = torch.stack([torch.stack(rewards).sum(), torch.stack(kls).sum(), torch.stack(weights).sum()])
        if acc.num_processes > 1:
            totals = acc.reduce(totals.to(acc.device), reduction="sum").cpu()
        n = float(totals[2]) or float("nan")
        return {"eval/reward": float(totals[0]) / n, "eval/kl": float(totals[1]) / n}

    def state_dict(self) -> dict:
        return {"kl_controller": self.kl_controller.state_dict(), "normaliser": self.normaliser.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.normaliser.load_state_dict(state["normaliser"])

    def manifest_extras(self) -> dict:
        """The reward model the policy was optimised against: the driver re-runs PPO when it changes."""
        from pipeline.modeling.manifest import weights_hash

        return {"reward_model": {"path": self.reward_path, "weights_hash": weights_hash(self.reward_path)}}

    def export(self, summary: dict) -> Optional[Path]:
        """The policy (adapter, merged into merged/, or the full model) and the critic's adapter."""
        from pipeline.config import to_dict
        from pipeline.modeling.merge import export_full_model, merge_adapter

        acc, cfg, out = self.accelerator, self.cfg, Path(self.cfg.output_dir)
        full = cfg.model.finetuning == "full"
        common = dict(stage=self.name, config=to_dict(cfg), chat_template=self.chat_template, overwrite=True,
                      extra_manifest={"summary": summary, **self.manifest_extras()}, trust_remote_code=cfg.model.trust_remote_code)
        merged = None
        with full_parameters(acc, self.model):  # every rank gathers; rank 0 writes
            if acc.is_main_process and full:
                merged = export_full_model(self.inner.policy, self.tokenizer, str(out / "merged"), parent=self.model_path, **common)
            elif acc.is_main_process:
                self.inner.policy.save_pretrained(out / "adapter")
                self.inner.critic.save_pretrained(out / "critic_adapter")
        self._generator = self.last_experience = None
        self.model, self.optimizer, self.scheduler = acc.free_memory(self.model, self.optimizer, self.scheduler)
        if acc.is_main_process and not full:
            merged = merge_adapter(self.model_path, str(out / "adapter"), str(out / "merged"), kind="causal",
                                   allow_pickle=cfg.model.allow_pickle, **common)
        acc.wait_for_everyone()
        return merged

    def progress(self, figures: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{figures['ppo/reward_raw']:.3f}", "kl": f"{figures['ppo/kl']:.3f}"}

    def summary(self) -> dict:
        rewards, kls = self.history.values("ppo/reward_raw"), self.history.values("ppo/kl")
        evals, eval_kls = self.history.values("eval/reward", evals=True), self.history.values("eval/kl", evals=True)
        return {
            "reward_first": rewards[0] if rewards else None,
            "reward_last": rewards[-1] if rewards else None,
            "kl_last": kls[-1] if kls else None,
            "eval_reward_first": evals[0] if evals else None,
            "eval_reward_last": evals[-1] if evals else None,
            "eval_kl_last": eval_kls[-1] if eval_kls else None,
            "steps": self.step,
            "wall_seconds": self.history.wall_seconds(),
        }


if __name__ == "__main__":
    raise SystemExit(main(PPOStage))
