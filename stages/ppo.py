"""PPO stage: tune the SFT policy against the reward model (Relay's own PPO on accelerate).

    torchrun --nproc_per_node 1 stages/ppo.py --config configs/ppo.yaml [--train.max_steps 20]

Each step (`PPOStage.train_step`): sample responses for a batch of prompts (Relay's decode engine,
`generation.backend`, from exactly the distribution the ratio scores), score them with the reward model (or
a Python `reward_fn`) at the end-of-turn token the RM was trained to score, shape per-token
rewards with the KL to the reference policy, estimate advantages with GAE, then run `ppo.epochs`
passes of clipped policy and value updates over mini-batches (pipeline/rl/ppo.py). Two
backbones in LoRA modes (see pipeline/rl/rollout.py): policy and reference share the SFT backbone,
critic and reward share the RM backbone.

Resume is the engine's (pipeline/engine/stage.py): adapters (or full weights), optimizer,
scheduler, RNG, prompt position, and this stage's KL controller and reward normaliser, so a
restarted run draws the same rollouts as an unbroken one.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from pipeline.algorithms import rewards as rw
from pipeline.algorithms import rl
from pipeline.algorithms.judge import JudgeConfig, JudgeReward
from pipeline.algorithms.mismatch import logprob_diff
from pipeline.config import GenerationConfig, PromptDataConfig, RewardModelConfig, StageConfig, ToolsConfig
from pipeline.config.policy import sampling_engine_problems
from pipeline.engine.accelerator import full_parameters
from pipeline.engine.checkpoint import seeded_fork
from pipeline.engine.held_out import ratio
from pipeline.engine.stage_main import main
from pipeline.engine.steps import rank_mean
from pipeline.modeling.manifest import read_manifest
from pipeline.modeling.models import load_model, train_without_dropout
from pipeline.rl.policy_stage import GeneratorFactory, PolicyStage, frozen
from pipeline.rl.ppo import (
    REWARD_NORMS,
    RewardFn,
    make_experience,
    ppo_update,
    score_rollout,
    step_metrics,
)
from pipeline.rl.rollout import ActorCritic
from pipeline.rl.tool_rollout import tools_problems

log = logging.getLogger("relay.ppo")


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class PPOData(PromptDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/ppo/train.jsonl"])
    """Prompt files (`{"prompt": ...}` or chat records whose last turn is the user's)."""
    eval: list[str] = field(default_factory=list)
    """Held-out prompts for `eval/reward` and `eval/kl`. None by default
    (data.eval_fraction carves them off `train`)."""


@dataclass
class PPORewardModel(RewardModelConfig):
    weight: float = 1.0
    """Weight of the reward model's score in the summed reward (0 with a judge: the judge alone
    rewards, the reward model's backbone still starts the critic)."""


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
    """Per-token KL estimator in the reward (pipeline/algorithms/rl.py's KL_ESTIMATORS): k1 (log-ratio)
    or k3 (non-negative, lower variance)."""
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
            out.append(f"{key}.kl_estimator: {self.kl_estimator!r} is not one of {tuple(rl.KL_ESTIMATORS)}")
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
    reward_model: PPORewardModel = field(default_factory=PPORewardModel)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    ppo: PPOSection = field(default_factory=PPOSection)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """An LLM judge behind an OpenAI-compatible endpoint, summed with the reward model's score by
    their weights (pipeline/algorithms/judge.py)."""

    def problems(self) -> list[str]:
        out = super().problems() + tools_problems(self.tools)  # the judge section: in super()'s walk
        if self.ppo.reward_norm == "stored" and (self.judge.enabled or self.reward_model.weight != 1.0):
            out.append(
                "ppo.reward_norm: 'stored' normalises with the reward model's own score statistics, and the summed "
                "reward is not its score alone (a judge, or reward_model.weight != 1); use running or none"
            )
        out += sampling_engine_problems(self.generation, self.distributed, self.tools.enabled)
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
# Pieces: models, reward normaliser
# ------------------------------------------------------------------------------------------


def build_models(cfg: PPOConfig, tokenizer) -> ActorCritic:
    """The actor-critic: LoRA modes share backbones (adapter disabled = reference / reward);
    full mode loads separate frozen copies of the policy and the reward model.

    Raises:
        ValueError / OSError: from pipeline.modeling.models.load_model.
    """
    rm_cfg = cfg.reward_model.beside(
        cfg.model, finetuning=cfg.model.finetuning, gradient_checkpointing=cfg.model.gradient_checkpointing
    )
    policy = load_model(cfg.model, cfg.lora, kind="causal", tokenizer=tokenizer)
    critic = load_model(rm_cfg, cfg.lora, kind="reward", tokenizer=tokenizer)
    reference = reward = None
    if cfg.model.finetuning == "full":
        reference = frozen(load_model(cfg.model, None, kind="causal", tokenizer=tokenizer))
        reward = frozen(load_model(rm_cfg, None, kind="reward", tokenizer=tokenizer))
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
    stats = (read_manifest(reward_path) or {}).get("reward_stats")
    if not stats:
        raise ValueError(
            f"ppo.reward_norm is 'stored' but {reward_path}/manifest.json "
            "has no reward_stats (train the RM with stages/reward.py)"
        )
    return rl.RunningMoments(stats["mean"], stats["std"], stats["n"])


# ------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------


class PPOStage(PolicyStage):
    name = "ppo"
    config_class = PPOConfig
    evaluates_loss = False  # eval/reward, eval/kl: nothing for early stopping to watch

    def __init__(
        self,
        cfg: PPOConfig,
        *,
        reward_fn: Optional[RewardFn] = None,
        generator_factory: Optional[GeneratorFactory] = None,
    ):
        """`reward_fn(prompt_texts, response_ids) -> [B] tensor` replaces the reward model's score (the
        RM backbone still hosts the critic); `generator_factory(policy)` swaps the sampler."""
        super().__init__(cfg, generator_factory=generator_factory)
        self.reward_fn = reward_fn
        self.kl_controller = rl.make_kl_controller(cfg.ppo.kl_coef, cfg.ppo.kl_target, cfg.ppo.kl_horizon)
        self.normaliser: Optional[rl.RunningMoments] = None
        self.judge: Optional[JudgeReward] = None
        self.reward_parts: dict[str, torch.Tensor] = {}
        """The latest summed reward's sources by name ('rm', 'judge'), each [B] before weighting."""
        self.last_experience = None
        """The latest step's experience (tests and notebooks read it from `on_step`)."""

    def build_data(self) -> list[str]:
        """Prompts (eval prompts only when evaluation is on) and the reward normaliser."""
        problems = self.build_prompts()
        self.normaliser = make_normaliser(self.cfg, self.reward_path)
        if self.cfg.judge.enabled:
            problems += self.cfg.judge.record_problems(
                [rw.record_columns(s) for s in self.train_samples + self.eval_samples]
            )
        return problems

    def build_model(self) -> torch.nn.Module:
        model = build_models(self.cfg, self.tokenizer)
        for copy in (model.reference, model.reward):
            if copy is not None:
                copy.to(self.accelerator.device)
        return model

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
            others = self.other_rewards(batch, rollout, tag=step)
            exp = make_experience(
                self.inner,
                rollout,
                texts,
                cfg=cfg,
                kl_coef=self.kl_controller.value,
                normaliser=self.normaliser,
                reward_fn=self.reward_fn,
                accelerator=acc,
                combine=lambda score: self.summed_reward(score, others),
            )
        update = ppo_update(self.model, self.optimizer, exp, acc, cfg, step)
        figures = step_metrics(
            exp, update, acc, kl_coef=self.kl_controller.value, gen_frac=gen_time / (time.perf_counter() - started)
        )
        if self.judge is not None:
            sources = {f"ppo/reward/{name}": float(v.nanmean()) for name, v in self.reward_parts.items()}
            figures.update(rank_mean(sources, acc))
            figures.update(self.judge.take_figures(total=lambda counts: rank_mean(counts, acc, totals=counts)))
        figures.update(self.tool_figures(rollout))
        self.kl_controller.update(figures["ppo/kl"], cfg.train.batch_size * acc.num_processes)
        if rollout.engine_logp is not None:  # an engine reporting its log-probs (vLLM): the mismatch, measured
            mean, worst = logprob_diff(exp.old_logprobs, rollout.engine_logp, rollout.response_mask)
            figures.update({"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": worst})
        if step % cfg.train.log_steps == 0:
            self.tracker.log_text(
                "ppo/samples",
                self.sample_text(texts, exp.rollout.responses, exp.raw_scores, cfg.ppo.samples_logged),
                step,
            )
        self.last_experience = exp
        return figures

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """eval/reward (mean raw reward) and eval/kl (mean per-response k1 KL) on held-out prompts.

        Sampling runs under a forked RNG seeded the same way at every evaluation, so evaluations see
        the same random numbers (less noise between them) and training's RNG streams are untouched.
        """
        if not self.eval_samples:
            return None

        def figures(indices: list[int]) -> dict:
            batch = [self.eval_samples[i] for i in indices]
            rollout = self.rollout(batch)
            s = score_rollout(
                self.inner,
                rollout,
                micro=self.cfg.train.batch_size,
                temperature=self.cfg.generation.temperature,
                values=False,
                autocast=self.accelerator.autocast,
            )
            raw = (
                s["rm"]
                if self.reward_fn is None
                else self.reward_fn([p["text"] for p in batch], rollout.responses).float().cpu()
            )
            raw = self.summed_reward(raw, self.other_rewards(batch, rollout, tag=self.step))
            kl = (rl.kl_per_token(s["old"], s["ref"], "k1") * rollout.response_mask).sum(1)
            return {"n": len(batch), "eval/reward": raw.sum(), "eval/kl": kl.sum()}

        with seeded_fork(self.cfg.train.seed + 1), full_parameters(self.accelerator, self.model):
            sums = self.held_out(figures)
        if self.judge is not None:
            self.judge.take_figures()  # the step figures count training's requests only
        return {key: ratio(sums, key, "n") for key in ("eval/reward", "eval/kl")}

    def other_rewards(self, samples: list[dict], rollout, tag: int) -> dict[str, torch.Tensor]:
        """The reward sources beside the reward model, by name ([B] each): the judge's score of each
        response's final answer (a tool rollout's last assistant turn), its requests filed in the
        cache under optimizer step `tag`.

        Raises:
            JudgeError: a judge request failed and judge.on_failure is null.
        """
        if not self.cfg.judge.enabled:
            return {}
        prompts, completions, columns = self.reward_inputs(samples, rollout)
        return {"judge": rw.judge_scores(self.opened_judge(), prompts, completions, columns, tag)}

    def summed_reward(self, score: torch.Tensor, others: dict[str, torch.Tensor]) -> torch.Tensor:
        """The raw reward ([B]): the reward model's (or reward_fn's) score and `others`, weighted and
        summed as GRPO sums its sources (rewards.weighted_sum). A NaN score of the reward model stays
        NaN (a broken model stops at the step's finite check instead of training on a 0)."""
        self.reward_parts = {"rm": score, **others}
        weights = {"rm": self.cfg.reward_model.weight, "judge": self.cfg.judge.weight}
        return torch.where(score.isnan(), score, rw.weighted_sum(self.reward_parts, weights, len(score)))

    def state_dict(self) -> dict:
        return {"kl_controller": self.kl_controller.state_dict(), "normaliser": self.normaliser.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.normaliser.load_state_dict(state["normaliser"])

    def manifest_extras(self) -> dict:
        """The reward model the policy was optimised against (the driver re-runs PPO when it changes)
        and the judge, if any."""
        return {**self.reward_model_record(), **self.cfg.judge.manifest_record()}

    def export_adapters(self) -> dict[str, torch.nn.Module]:
        """The critic's adapter beside the policy's (LoRA modes)."""
        return {"critic_adapter": self.inner.critic}

    def release(self) -> None:
        super().release()
        self.last_experience = None

    def progress(self, figures: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{figures['ppo/reward_raw']:.3f}", "kl": f"{figures['ppo/kl']:.3f}"}

    def summary(self) -> dict:
        return {
            **self.history.pick(
                reward_first="ppo/reward_raw:first",
                reward_last="ppo/reward_raw",
                kl_last="ppo/kl",
                eval_reward_first="eval/reward:first",
                eval_reward_last="eval/reward",
                eval_kl_last="eval/kl",
            ),
            **self.run_figures(),
        }


if __name__ == "__main__":
    raise SystemExit(main(PPOStage))
