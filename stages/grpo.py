"""GRPO stage: tune the SFT policy with group-relative advantages, no critic.

    torchrun --nproc_per_node 1 stages/grpo.py --config configs/grpo.yaml [--train.max_steps 20]

Each step (`GRPOStage.train_step`): sample `grpo.num_generations` (G) completions for each of a
batch of prompts (PPO's prompt data and sampler: pipeline/rl/rollout.py), reward each
with the reward functions the config names (`grpo.reward_funcs`, "module:function" of the project
or an installed package, pipeline/algorithms/rewards.py) and/or a trained reward model
(`reward_model.path`, read out as PPO does), optionally shaped for overlong completions and
filtered for groups with something to learn (DAPO's `grpo.overlong_buffer`, `grpo.dynamic_sampling`),
turn rewards into advantages (`grpo.advantage_estimator`: by default the reward against its
group's, A = (r - mean) / (std + eps); pipeline/algorithms/advantages.py), then run
`grpo.num_iterations` optimizer steps of the `grpo.loss_type` policy loss (dapo by default;
pipeline/algorithms/grpo_losses.py) over the batch and, when `grpo.beta` > 0, a k3 KL term to the
reference (pipeline/rl/grpo.py). The `grpo:` options are pipeline/algorithms/grpo_config.py's.
The reference is the policy with its adapter disabled (LoRA/QLoRA) or a frozen copy (full
fine-tuning); with beta 0 none is loaded and no reference forward runs.

Resume is the engine's (pipeline/engine/stage.py): adapters (or full weights), optimizer,
scheduler, RNG and prompt position, so a restarted run samples the same completions as an
unbroken one.
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

from pipeline.algorithms import advantages as adv
from pipeline.algorithms import rewards as rw
from pipeline.algorithms.grpo_config import GRPOSection
from pipeline.algorithms.judge import JudgeReward
from pipeline.algorithms.judge_config import JudgeConfig
from pipeline.algorithms.mismatch import correction_weights
from pipeline.algorithms.mismatch import logprob_diff as mismatch_diff
from pipeline.config import GenerationConfig, PromptDataConfig, RewardModelConfig, StageConfig, ToolsConfig
from pipeline.config.policy import sampling_engine_problems
from pipeline.engine.accelerator import full_parameters
from pipeline.engine.checkpoint import seeded_fork
from pipeline.engine.held_out import ratio
from pipeline.engine.stage_main import main
from pipeline.engine.steps import rank_mean
from pipeline.modeling.models import load_model, train_without_dropout
from pipeline.rl import grpo as algo
from pipeline.rl.policy_stage import GeneratorFactory, PolicyStage, frozen
from pipeline.rl.rollout import ActorCritic, chunks, take_rows
from pipeline.rl.tool_rollout import tools_problems

log = logging.getLogger("relay.grpo")

DYNAMIC_TOTALS = ("grpo/dynamic/dropped_groups", "grpo/dynamic/topped_up")
"""Dynamic sampling's counts of the whole step: each rank keeps train.batch_size groups of its own
and counts the groups it dropped or topped up with, and the step's figure is their sum over ranks
(generation_batches, the same on every rank, is each rank's)."""


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class GRPOData(PromptDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/ppo/train.jsonl"])
    """Prompt files (`{"prompt": ...}` or chat records whose last turn is the user's), as PPO's."""
    eval: list[str] = field(default_factory=list)
    """Held-out prompts for `eval/reward` (one sampled completion each). None by default
    (data.eval_fraction carves them off `train`)."""


@dataclass
class GRPORewardModel(RewardModelConfig):
    """An optional reward model: a merged RM folder (the RM stage's merged/), scored at the
    end-of-turn token as PPO reads it, loaded frozen."""

    path: Optional[str] = None
    """The RM folder; null: rewards come from grpo.reward_funcs only."""
    weight: float = 1.0
    """Weight of the RM's score in the summed reward."""


@dataclass
class GRPOConfig(StageConfig):
    output_dir: str = "outputs/grpo"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (the final policy), summary.json."""
    data: GRPOData = field(default_factory=GRPOData)
    reward_model: GRPORewardModel = field(default_factory=GRPORewardModel)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """An LLM judge behind an OpenAI-compatible endpoint as one more reward (pipeline/algorithms/judge.py)."""

    def problems(self) -> list[str]:
        out = super().problems() + tools_problems(self.tools)  # the judge section: in super()'s walk
        rows = self.train.batch_size * self.grpo.num_generations
        if rows % self.train.grad_accum:
            out.append(
                f"train.grad_accum: {self.train.grad_accum} does not divide the {rows} completions of a step "
                f"(train.batch_size x grpo.num_generations)"
            )
        if not self.grpo.reward_funcs and not self.reward_model.path and not self.judge.enabled:
            out.append(
                "grpo.reward_funcs / reward_model.path / judge.base_url: no reward (name a reward function, a reward "
                "model or a judge)"
            )
        out += self.generation.room_problems(self.train.seq_length)
        out += self.grpo.generation_problems(self.generation.max_new_tokens)
        out += sampling_engine_problems(self.generation, self.distributed, self.tools.enabled)
        return out


# ------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------


class GRPOStage(PolicyStage):
    name = "grpo"
    config_class = GRPOConfig
    evaluates_loss = False  # eval/reward, eval/kl: nothing for early stopping to watch
    loss_can_diverge = False  # a clipped surrogate around 0, not a loss that starts high
    reward_model_required = False

    def __init__(self, cfg: GRPOConfig, *, generator_factory: Optional[GeneratorFactory] = None):
        """`generator_factory(policy)` swaps the sampler (as PPO's)."""
        super().__init__(cfg, generator_factory=generator_factory)
        self.funcs: list = []
        self.judge: Optional[JudgeReward] = None
        self.reward_log = rw.RewardLog()
        """What the reward functions logged (TRL's log_metric, log_extra) at the latest call."""
        self.last_rollout = None
        """The latest step's rollout, rewards and advantages (tests read it from `on_step`)."""

    def build_data(self) -> list[str]:
        """Prompts (eval prompts only when evaluation is on) and the reward functions."""
        problems = self.build_prompts()
        self.funcs = [rw.load_reward_func(spec) for spec in self.cfg.grpo.reward_funcs]
        if self.cfg.judge.enabled:
            problems += self.cfg.judge.record_problems(
                [rw.record_columns(s) for s in self.train_samples + self.eval_samples]
            )
        return problems

    def build_model(self) -> torch.nn.Module:
        """The policy, its reference (full fine-tuning with beta > 0: a frozen copy; LoRA: the
        adapter-disabled policy) and the frozen reward model, as one module without a critic."""
        cfg = self.cfg
        policy = load_model(cfg.model, cfg.lora, kind="causal", tokenizer=self.tokenizer)
        reference = reward = None
        if cfg.model.finetuning == "full" and cfg.grpo.beta > 0:
            reference = frozen(load_model(cfg.model, None, kind="causal", tokenizer=self.tokenizer))
        if self.reward_path is not None:
            rm_cfg = cfg.reward_model.beside(cfg.model, finetuning="full", gradient_checkpointing=False)
            reward = frozen(load_model(rm_cfg, None, kind="reward", tokenizer=self.tokenizer))
        for copy in (reference, reward):
            if copy is not None:
                copy.to(self.accelerator.device)
        # The update's forward must reproduce the rollout's log-probs (the first ratio is 1).
        return ActorCritic(train_without_dropout(policy), None, reference, reward)

    def rewards(
        self, samples: list[dict], rollout, tag: Optional[int] = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
        """The summed reward of each completion ([N]), each source's own ([N] by name: the reward
        functions' names, 'rm', 'judge', 'overlong' (DAPO's shaping), 'missing_eos' (-generation.missing_eos_penalty
        for an unfinished one)) and each source's weight in the sum. `samples`: each completion's
        prompt sample; the reward functions are called as TRL calls them (pipeline.algorithms.rewards),
        and a None they return is left out of the sum (TRL's nansum). `tag`: the optimizer step the
        judge's cache files the replies under (default: the step being trained).

        Raises:
            ValueError: a reward function returned the wrong number of values or a non-number.
            JudgeError: a judge request failed and judge.on_failure is null.
        """
        cfg, g = self.cfg, self.cfg.grpo
        prompts, completions, columns = self.reward_inputs(samples, rollout)
        ids, state = [list(r) for r in rollout.responses], rw.trainer_state(self.step, cfg.train.max_steps)
        self.reward_log = rw.RewardLog()
        parts: dict[str, torch.Tensor] = {}
        weights: dict[str, float] = {}
        for spec, func, weight in zip(g.reward_funcs, self.funcs, g.reward_weights or [1.0] * len(self.funcs)):
            parts[rw.func_name(spec)] = torch.tensor(
                rw.call_reward(func, spec, prompts, completions, ids, columns, state, self.reward_log)
            )
            weights[rw.func_name(spec)] = weight
        if self.reward_path is not None:
            device = self.accelerator.device
            scores = [
                self.inner.reward_scores(
                    rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device), rollout.prompt_width
                )
                .float()
                .cpu()
                for rows in chunks(len(completions), self.cfg.train.batch_size)
            ]
            parts["rm"], weights["rm"] = torch.cat(scores), cfg.reward_model.weight
        if cfg.judge.enabled:
            parts["judge"], weights["judge"] = self.judge_scores(prompts, completions, columns, tag), cfg.judge.weight
        if g.overlong_buffer:
            lengths = rollout.response_mask.sum(1)
            parts["overlong"] = adv.overlong_penalty(
                lengths, cfg.generation.max_new_tokens, g.overlong_buffer, g.overlong_penalty
            )
            weights["overlong"] = 1.0
        if cfg.generation.missing_eos_penalty:
            parts["missing_eos"] = -cfg.generation.missing_eos_penalty * (~rollout.finished).float()
            weights["missing_eos"] = 1.0
        return rw.weighted_sum(parts, weights, len(completions)), parts, weights

    def judge_scores(self, prompts: list, completions: list, columns: list[dict], tag: Optional[int]) -> torch.Tensor:
        """The judge's score of each completion's final answer to its prompt's last user turn."""
        return rw.judge_scores(
            self.opened_judge(), prompts, completions, columns, self.step + 1 if tag is None else tag
        )

    def sample_groups(self) -> tuple[list[dict], object, torch.Tensor, dict, dict, dict[str, float]]:
        """This step's prompts, rollout (G per prompt), rewards (total, parts, weights) and the
        dynamic-sampling counts. With `grpo.dynamic_sampling`, groups whose rewards are all equal
        are dropped and more prompts sampled until train.batch_size groups are kept, at most
        `max_generation_batches` generation batches; short of that, the step is topped up with
        dropped groups (counted in grpo/dynamic/topped_up, never hidden)."""
        g, G, B = self.cfg.grpo, self.cfg.grpo.num_generations, self.cfg.train.batch_size
        kept, dropped, batches = [], [], 0
        while True:
            (indices,) = self.next_sample_indices(grad_accum=1)
            batch = [self.train_samples[i] for i in indices]
            rollout = self.rollout(batch, G)
            total, parts, weights = self.rewards([p for p in batch for _ in range(G)], rollout)
            batches += 1
            if not g.dynamic_sampling:
                return batch, rollout, total, parts, weights, {}
            for j, informative in enumerate(adv.informative_groups(total, G).tolist()):
                (kept if informative else dropped).append(
                    (indices[j], rollout, slice(j * G, (j + 1) * G), total, parts)
                )
            if self._all_ranks(len(kept) >= B) or batches >= g.max_generation_batches:
                break
        short = max(0, B - len(kept))
        chosen = kept[:B] + dropped[:short]
        if short:
            log.warning(
                "grpo.dynamic_sampling: %d of %d groups had equal rewards after %d generation batches; "
                "the step is topped up with them",
                short,
                B,
                batches,
            )
        self.step_indices = [[c[0] for c in chosen]]  # what a divergence report names
        batch = [self.train_samples[c[0]] for c in chosen]
        ids = [p["prompt_ids"] for p in batch for _ in range(G)]
        picks = [(ro, i) for _, ro, rows, _, _ in chosen for i in range(rows.start, rows.stop)]
        rollout = take_rows(picks, ids, self.tokenizer.pad_token_id)
        total = torch.cat([t[rows] for _, _, rows, t, _ in chosen])
        parts = {k: torch.cat([p[k][rows] for _, _, rows, _, p in chosen]) for k in parts}
        counts = {
            "grpo/dynamic/generation_batches": float(batches),
            "grpo/dynamic/dropped_groups": float(len(dropped)),
            "grpo/dynamic/topped_up": float(short),
        }
        return batch, rollout, total, parts, weights, counts

    def _all_ranks(self, flag: bool) -> bool:
        """`flag` on every rank: the ranks must draw as many generation batches each (the prompt
        cursor is global)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return flag
        return float(acc.reduce(torch.tensor(float(not flag), device=acc.device), reduction="sum")) == 0

    def step_rewards(self, total: torch.Tensor, parts: dict, rollout) -> torch.Tensor:
        """[every rank's completions, 2 + K] (one gather; rank 0's rows first): each completion's
        summed reward, its loss-mask length and each source's reward (`parts` in order): the
        step's batch statistics (TRL and verl read them over every rank's completions; each rank
        holds the same number of whole groups)."""
        acc = self.accelerator
        lengths = algo.loss_mask(rollout, self.cfg.grpo.mask_truncated_completions).sum(1).double()
        local = torch.stack([total.double(), lengths, *[v.double() for v in parts.values()]], 1)
        return acc.gather(local.to(acc.device)).cpu() if acc.num_processes > 1 else local

    def advantages(self, every: torch.Tensor, weights: list[float]) -> torch.Tensor:
        """This rank's advantages ([N]) from every rank's rewards (`step_rewards`; `weights` in
        its sources' order): `grpo.multi_objective_aggregation` and `grpo.advantage_estimator`."""
        g, acc = self.cfg.grpo, self.accelerator
        advantages = adv.AGGREGATIONS[g.multi_objective_aggregation](
            every[:, 0],
            every[:, 2:],
            weights,
            every[:, 1],
            g.num_generations,
            estimator=g.advantage_estimator,
            scale=g.scale_rewards,
        )
        n = every.shape[0] // acc.num_processes
        return advantages[acc.process_index * n : (acc.process_index + 1) * n].float()

    def train_step(self) -> dict[str, float]:
        """Rollout (G per prompt; with dynamic sampling, informative groups only), rewards,
        advantages, `num_iterations` updates."""
        cfg, acc, G = self.cfg, self.accelerator, self.cfg.grpo.num_generations
        started = time.perf_counter()
        # Sampling and scoring call the unwrapped models: under FSDP their weights must be whole.
        with full_parameters(acc, self.model):
            batch, rollout, total, parts, weights, dynamic = self.sample_groups()
            gen_time = time.perf_counter() - started
            texts = [p["text"] for p in batch for _ in range(G)]
            every = self.step_rewards(total, parts, rollout)
            advantages = self.advantages(every, [weights[k] for k in parts])
            engine = rollout.engine_logp is not None  # the engine's own log-probs: measure and correct the mismatch
            scored = algo.score_completions(
                self.inner,
                rollout,
                micro=rollout.input_ids.shape[0] // cfg.train.grad_accum,
                temperature=cfg.generation.temperature,
                autocast=acc.autocast,
                old=cfg.grpo.num_iterations > 1 or engine,
                reference=cfg.grpo.beta > 0,
            )
        mismatch = self.mismatch(rollout, scored) if engine else {}
        update = algo.grpo_update(self.model, self.optimizer, rollout, advantages, scored, acc, cfg, self.step + 1)
        group_std = adv.group_std(total, G)  # over the scored completions (an unscorable one is NaN)
        local = {
            "grpo/reward_std": float(group_std.mean()),
            "grpo/frac_reward_zero_std": float((group_std == 0).float().mean()),
            "grpo/completion_length": float(rollout.response_mask.sum(1).float().mean()),
            **dynamic,
            **self.reward_log.means(),
        }
        local["grpo/clipfrac"] = update["clipfrac"]
        if "kl" in update:
            local["grpo/kl"] = update["kl"]
        figures = rank_mean(local, acc, totals=DYNAMIC_TOTALS)
        if self.judge is not None:  # every rank's requests for its own completions
            figures.update(self.judge.take_figures(total=lambda counts: rank_mean(counts, acc, totals=counts)))
        figures["grpo/reward"] = float(every[:, 0].nanmean())  # every rank's scored completions
        figures.update(algo.source_means(every[:, 2:], list(parts)))
        figures.update(self.tool_figures(rollout))
        figures.update(
            {
                "train/loss": update["loss"],
                "train/grad_norm": update["grad_norm"],
                "grpo/ratio_dev_first": update["ratio_dev_first"],
                "grpo/gen_time_frac": gen_time / (time.perf_counter() - started),
            }
        )
        figures.update(mismatch)
        if (self.step + 1) % cfg.train.log_steps == 0:
            self.tracker.log_text(
                "grpo/samples",
                self.sample_text(texts, rollout.responses, total, cfg.grpo.samples_logged, "completion"),
                self.step + 1,
            )
        self.last_rollout = {"rollout": rollout, "rewards": total, "advantages": advantages, "parts": parts}
        return figures

    def mismatch(self, rollout, scored: dict) -> dict[str, float]:
        """The engine-trainer log-prob diff (mean, max over sampled tokens) as figures, and the
        correction's weights into `scored['is_weight']` (generation.correction)."""
        gen = self.cfg.generation
        mask = rollout.response_mask.float()
        mean, worst = mismatch_diff(scored["old"], rollout.engine_logp, mask)
        weight = correction_weights(
            gen.correction_name, scored["old"], rollout.engine_logp, mask, gen.correction_cap, gen.correction_floor
        )
        if weight is not None:
            scored["is_weight"] = weight
        return {"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": worst}

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """eval/reward (mean summed reward) and eval/reward/<source> of one sampled completion per
        held-out prompt, under a forked RNG seeded the same way at every evaluation (as PPO's). A
        source's mean is over the completions it scored (a None, "no opinion", is left out as in
        the summed reward; NaN where it scored none)."""
        if not self.eval_samples:
            return None

        def figures(indices: list[int]) -> dict:
            batch = [self.eval_samples[i] for i in indices]
            total, parts, _ = self.rewards(batch, self.rollout(batch, 1), tag=self.step)
            return {
                "n": (~total.isnan()).sum(),  # the scored completions (unscorable: NaN, left out)
                "eval/reward": total.nansum(),
                **{f"eval/reward/{k}": v.nansum() for k, v in parts.items()},
                **{f"scored/{k}": (~v.isnan()).sum() for k, v in parts.items()},
            }

        with seeded_fork(self.cfg.train.seed + 1), full_parameters(self.accelerator, self.model):
            sums = self.held_out(figures)
        if self.judge is not None:
            self.judge.take_figures()  # the step figures count training's requests only
        out = {"eval/reward": ratio(sums, "eval/reward", "n")}
        sources = [key.removeprefix("scored/") for key in sums if key.startswith("scored/")]
        return out | {f"eval/reward/{k}": ratio(sums, f"eval/reward/{k}", f"scored/{k}") for k in sources}

    def manifest_extras(self) -> dict:
        """The rewards the policy was optimised for (the RM's path and weights hash, if any)."""
        return {
            "reward_funcs": list(self.cfg.grpo.reward_funcs),
            **self.reward_model_record(),
            **self.cfg.judge.manifest_record(),
        }

    def release(self) -> None:
        super().release()
        self.last_rollout = None

    def progress(self, figures: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{figures['grpo/reward']:.3f}", "loss": f"{figures['train/loss']:.4f}"}

    def summary(self) -> dict:
        return {
            **self.history.pick(
                reward_first="grpo/reward:first",
                reward_last="grpo/reward",
                kl_last="grpo/kl",
                eval_reward_first="eval/reward:first",
                eval_reward_last="eval/reward",
            ),
            **self.run_figures(),
        }


if __name__ == "__main__":
    raise SystemExit(main(GRPOStage))
