"""The `grpo:` config section (stages/grpo.py): group size and iterations, the policy loss
(`loss_type` and its hyper-parameters, TRL 1.16 GRPOConfig's names and defaults), the advantage
estimator, the reward sources and DAPO's dynamic sampling and overlong shaping; `problems` checks
every option against the others it conflicts with, one line each, before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pipeline.algorithms import advantages as adv
from pipeline.algorithms import rewards as rw
from pipeline.algorithms.grpo_losses import IMPORTANCE_LEVELS, LOSS_TYPES, Objective, loss_options


@dataclass
class GRPOSection:
    num_generations: int = 4
    """Completions sampled per prompt (G, >= 2): the group a completion's reward is compared with."""
    num_iterations: int = 1
    """Optimizer steps per generation batch (mu); the rollout's log-probs are the old policy's."""
    loss_type: str = "dapo"
    """The policy loss (TRL's GRPOConfig.loss_type, pipeline/algorithms/grpo_losses.py):
    dapo: clipped ratio, token sum / the step's tokens (TRL's default); grpo: mean over completions
    of each one's token mean; bnpo: token mean of each micro-batch; dr_grpo: token sum /
    (completions x generation.max_new_tokens); luspo: mean over completions of each one's token sum
    (GSPO weighted by length; needs importance_sampling_level sequence); cispo: -sg(min(r,
    epsilon_high)) A logp, token mean over the step (needs epsilon_high, e.g. 5.0); sapo: soft
    sigmoid gate instead of the clip, per-completion mean; vespo: a Gamma weight of the sequence
    ratio times A logp, token mean over the step (importance_sampling_level token). A loss type's own
    option (epsilon, epsilon_high, delta, sapo_*, vespo_*) set away from its default under a loss
    type that does not read it is refused."""
    epsilon: float = 0.2
    """Ratio clip below 1 (and above, unless epsilon_high is set); clipped-ratio loss types only."""
    epsilon_high: Optional[float] = None
    """Ratio clip above 1 (DAPO's clip-higher, e.g. 0.28); null: epsilon. With cispo: the cap on
    the ratio itself (ScaleRL's epsilon_max, e.g. 5.0; required)."""
    delta: Optional[float] = None
    """Two-sided clip (INTELLECT-2): the unclipped ratio is also capped at delta (> 1 + epsilon_high);
    null: off. Clipped-ratio loss types only."""
    importance_sampling_level: str = "token"
    """token: one ratio per token; sequence: one per completion, exp of its mean token log-ratio (GSPO)."""
    beta: float = 0.0
    """Weight of the k3 KL(policy || reference) loss term; 0: no KL, no reference forward."""
    advantage_estimator: str = "grpo"
    """grpo: reward against the group's mean (scaled as scale_rewards says); rloo: against the mean
    of the group's other completions (leave-one-out); reinforce_plus_plus: the reward whitened over
    the batch's tokens (no group baseline); reinforce_plus_plus_baseline: reward minus its group
    mean, then whitened over the batch's tokens (verl's definitions, gamma 1)."""
    scale_rewards: str = "group"
    """How the grpo estimator scales (reward - group mean): group (its group's std), batch (the
    batch's std, PPO Lite) or none (Dr. GRPO). Other estimators scale their own way: leave 'group'."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """With several rewards: sum_then_normalize (weighted sum, then the estimator) or
    normalize_then_sum (GDPO: each reward normalised in its group, weighted sum, normalised over the
    batch; the result is the advantage, so advantage_estimator grpo and scale_rewards group)."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_new_tokens (no EOS) out of the loss (DAPO's overlong filtering);
    their rewards still count in their group's baseline."""
    top_entropy_quantile: float = 1.0
    """Keep in the policy loss only the top quantile of loss tokens by entropy (Beyond the 80/20
    Rule recommends 0.2; 1.0: every token; 0.0: the highest-entropy tokens only)."""
    sapo_temperature_pos: float = 1.0
    """sapo: gate temperature for tokens with positive advantage."""
    sapo_temperature_neg: float = 1.05
    """sapo: gate temperature for tokens with non-positive advantage."""
    vespo_k_pos: float = 2.0
    """vespo: power k of the Gamma weight for non-negative advantages."""
    vespo_lambda_pos: float = 3.0
    """vespo: decay lambda of the Gamma weight for non-negative advantages."""
    vespo_k_neg: float = 3.0
    """vespo: power k for negative advantages."""
    vespo_lambda_neg: float = 2.0
    """vespo: decay lambda for negative advantages."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop each group whose rewards are all equal and sample more prompts
    until train.batch_size groups remain, at most max_generation_batches generation batches a step
    (then the step is topped up with dropped groups; grpo/dynamic/* in the tracker counts each)."""
    max_generation_batches: int = 4
    """dynamic_sampling: generation batches a step may sample (>= 1)."""
    overlong_buffer: int = 0
    """DAPO's overlong reward shaping: a completion longer than max_new_tokens - overlong_buffer
    tokens loses overlong_penalty x (excess / overlong_buffer) reward (0: off)."""
    overlong_penalty: float = 1.0
    """The shaping's penalty at max_new_tokens (verl's penalty_factor)."""
    reward_funcs: list[str] = field(default_factory=list)
    """Reward functions "module:function" (an installed package, PYTHONPATH, the working directory)
    or "path/to/file.py:function", called by keyword as TRL's GRPOTrainer calls them:
    f(prompts=, completions=, completion_ids=, **the prompt record's other fields, trainer_state=,
    log_extra=, log_metric=) -> one float (or None) per completion (pipeline/algorithms/rewards.py).
    A config runs the code it names: name only code you trust."""
    reward_weights: Optional[list[float]] = None
    """One weight per reward function (null: 1 each)."""
    samples_logged: int = 2
    """Prompt/completion/reward samples written to the tracker each logged step."""

    def objective(self) -> Objective:
        """The loss's hyper-parameters."""
        return Objective(
            loss_type=self.loss_type,
            epsilon=self.epsilon,
            epsilon_high=self.epsilon_high,
            delta=self.delta,
            beta=self.beta,
            importance_sampling_level=self.importance_sampling_level,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
            vespo_k_pos=self.vespo_k_pos,
            vespo_lambda_pos=self.vespo_lambda_pos,
            vespo_k_neg=self.vespo_k_neg,
            vespo_lambda_neg=self.vespo_lambda_neg,
        )

    def problems(self, key: str = "grpo") -> list[str]:
        out: list[str] = []
        if self.num_generations < 2:
            out.append(
                f"{key}.num_generations: must be >= 2 (a group of one has no baseline), got {self.num_generations}"
            )
        if self.num_iterations < 1:
            out.append(f"{key}.num_iterations: must be >= 1, got {self.num_iterations}")
        if self.epsilon <= 0 or (self.epsilon_high is not None and self.epsilon_high <= 0):
            out.append(f"{key}.epsilon/epsilon_high: must be > 0")
        if self.beta < 0:
            out.append(f"{key}.beta: must be >= 0, got {self.beta}")
        for name, allowed in (
            ("loss_type", tuple(LOSS_TYPES)),
            ("importance_sampling_level", IMPORTANCE_LEVELS),
            ("advantage_estimator", tuple(adv.ESTIMATORS)),
            ("scale_rewards", adv.SCALES),
            ("multi_objective_aggregation", adv.AGGREGATIONS),
        ):
            if getattr(self, name) not in allowed:
                old = (
                    " (the old true/false: true is 'group', false is 'none')"
                    if str(getattr(self, name)) in ("True", "False")
                    else ""
                )
                out.append(f"{key}.{name}: {getattr(self, name)!r} is not one of {allowed}{old}")
        out += self._loss_conflicts(key) + self._advantage_conflicts(key)
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            out.append(
                f"{key}.reward_weights: {len(self.reward_weights)} "
                f"weights for {len(self.reward_funcs)} reward functions"
            )
        out += [f"{key}.reward_funcs: {p}" for p in filter(None, map(rw.reward_func_problem, self.reward_funcs))]
        return out

    def _loss_conflicts(self, key: str) -> list[str]:
        entry = LOSS_TYPES.get(self.loss_type)
        if entry is None:  # refused by the choice check
            return []
        out = self._unread_options(key) + list(entry.problems(self, key))
        if (
            "delta" in entry.options
            and self.delta is not None
            and self.delta <= 1 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)
        ):
            out.append(f"{key}.delta: must be > 1 + epsilon_high (it caps the ratio above the clip), got {self.delta}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            out.append(f"{key}.top_entropy_quantile: must be in [0, 1], got {self.top_entropy_quantile}")
        return out

    def _unread_options(self, key: str) -> list[str]:
        """One line per loss-specific option set away from its default that the loss type does not
        read (its LOSS_TYPES entry's `options`): it would be ignored."""
        reads = LOSS_TYPES[self.loss_type].options
        out = []
        for name in loss_options():
            default = getattr(GRPOSection, name)
            if name not in reads and getattr(self, name) != default:
                readers = ", ".join(n for n, e in LOSS_TYPES.items() if name in e.options)
                out.append(
                    f"{key}.{name}: loss_type {self.loss_type} does not read it (only {readers}); "
                    f"leave it {'null' if default is None else default}"
                )
        return out

    def _advantage_conflicts(self, key: str) -> list[str]:
        out, est = [], self.advantage_estimator
        entry = adv.ESTIMATORS.get(est)
        if entry is None:  # refused by the choice check
            return out
        scaling = ", ".join(name for name, e in adv.ESTIMATORS.items() if e.scales_rewards)
        if self.scale_rewards in ("batch", "none") and not entry.scales_rewards:
            out.append(
                f"{key}.scale_rewards: applies to advantage_estimator "
                f"{scaling} only ({est} scales its own way); leave 'group'"
            )
        if self.multi_objective_aggregation == "normalize_then_sum":
            if not entry.scales_rewards:  # the group-normalising estimator is what it replaces
                out.append(
                    f"{key}.multi_objective_aggregation: normalize_then_sum yields the advantages itself; use "
                    f"advantage_estimator {scaling}, not {est}"
                )
            if self.scale_rewards in ("batch", "none"):
                out.append(
                    f"{key}.scale_rewards: normalize_then_sum normalises each reward in its group itself; leave 'group'"
                )
        if self.dynamic_sampling and not entry.group_baseline:
            out.append(
                f"{key}.dynamic_sampling: drops groups of equal rewards, which {est} (no group baseline) learns from"
            )
        if self.max_generation_batches < 1:
            out.append(f"{key}.max_generation_batches: must be >= 1, got {self.max_generation_batches}")
        if self.overlong_buffer < 0 or self.overlong_penalty <= 0:
            out.append(f"{key}.overlong_buffer/overlong_penalty: must be >= 0 and > 0")
        return out

    def generation_problems(self, max_new_tokens: int, key: str = "grpo") -> list[str]:
        """Checks against generation.max_new_tokens."""
        if self.overlong_buffer and self.overlong_buffer >= max_new_tokens:
            return [
                f"{key}.overlong_buffer: {self.overlong_buffer} must be < generation.max_new_tokens ({max_new_tokens})"
            ]
        return []
