"""`PolicyStage`: the shared half of the RL stages that tune a policy by sampling it (PPO, GRPO):
the prompt data, the reward model they read (checked before anything loads), the sampler and a
rollout of a batch of prompts, frozen copies, the manifest's record of the reward model, and
what export saves (the policy inside the stage's module). The stages add their own model, step,
evaluation and summary."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, ClassVar, Optional

import torch

from data_formats.prompt_data import build_prompt_data
from data_formats.render import template_jinja
from pipeline.algorithms import rewards as rw
from pipeline.algorithms.judge import JudgeReward
from pipeline.algorithms.mismatch import engine_logprob_matrix
from pipeline.config import RewardModelConfig
from pipeline.config.backends import BACKENDS
from pipeline.engine.accelerator import is_zero3, sampling_weights
from pipeline.engine.stage import Stage, resolved_path
from pipeline.engine.steps import all_reduce_sum
from pipeline.modeling.embedded import is_embedded
from pipeline.modeling.handoff import reward_pairing_problems
from pipeline.modeling.manifest import weights_hash
from pipeline.modeling.models import remote_code_problems
from pipeline.modeling.preflight import model_problems
from pipeline.rl.generators import GENERATORS, Generator, make_generator
from pipeline.rl.rollout import ActorCritic, Rollout, assemble
from pipeline.rl.tool_rollout import ToolEnv, layout_problem, load_tools, tool_rollout

log = logging.getLogger("relay.policy")

GeneratorFactory = Callable[[torch.nn.Module], Generator]
"""generator_factory(policy) -> a Generator: swaps the sampler (tests, a faster engine)."""


def reward_model_problems(rm: RewardModelConfig, reward_path: str, policy_path: str, stage: str) -> list[str]:
    """What keeps `rm` (resolved to `reward_path`) from scoring `policy_path`'s samples: the
    embedded model without `allow_untrained` (a random head), no folder, not a reward model
    (preflight), code it may not run, another tokenizer (pipeline.modeling.handoff). One line each."""
    if is_embedded(rm.path):
        if not rm.allow_untrained:
            return [
                f"reward_model.path: {stage} needs a trained reward model: give the RM stage's merged/ folder "
                "(or set reward_model.allow_untrained: true to smoke-test with a random reward head)"
            ]
        log.warning("reward_model.path is the embedded model: its reward head is random (smoke runs only)")
    if not Path(reward_path).is_dir():
        return [f"reward_model.path: {rm.path!r} is not a model folder (give the RM stage's merged/)"]
    found = model_problems(reward_path, "reward_model.path", need="any" if rm.allow_untrained else "reward")
    found += remote_code_problems(rm, "reward_model")
    return found or reward_pairing_problems(policy_path, reward_path)


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """`model` without gradients, in eval mode (a reference or reward copy)."""
    model.requires_grad_(False)
    return model.eval()


def device_problems(gen, cuda_devices: Optional[int] = None) -> list[str]:
    """The chosen backend's options this machine's CUDA GPUs cannot run (`cuda_devices`: torch's
    count by default), one line each (pipeline/config/backends.py's `device_problems`)."""
    entry = BACKENDS.get(gen.backend)
    if entry is None:
        return []
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return entry.device_problems(gen, cuda_devices, "generation")


vllm_gpu_problems = device_problems
"""The name tests/test_mismatch.py asks for the vLLM engine's GPU options by."""


class PolicyStage(Stage):
    """A subclass sets `self.inner`'s layout in `build_model` (an `ActorCritic`) and calls
    `build_prompts` from `build_data`."""

    evaluates_at_start = True
    reward_model_required: ClassVar[bool] = True
    """PPO needs a reward model (its critic starts from it); GRPO may run on reward functions alone."""

    def __init__(self, cfg, *, generator_factory: Optional[GeneratorFactory] = None):
        super().__init__(cfg)
        self.reward_path: Optional[str] = (
            resolved_path("reward_model.path", cfg.reward_model.path)
            if cfg.reward_model.path or self.reward_model_required
            else None
        )
        self.generator_factory = generator_factory
        self._generator: Optional[Generator] = None
        self.tools: dict = {}
        """The tools a tool rollout may call (cfg.tools, pipeline/rl/tool_rollout.py); empty: none."""

    def problems(self) -> list[str]:
        found = []
        spec = GENERATORS.get(self.cfg.generation.backend)  # an unknown name is the config's own problem
        if spec is not None:
            found += spec.problems(self.cfg, self.model_path) + device_problems(self.cfg.generation)
        if self.reward_path is None:
            return found
        return found + reward_model_problems(
            self.cfg.reward_model, self.reward_path, self.model_path, self.name.upper()
        )

    def build_prompts(self) -> list[str]:
        """Prompts (eval prompts only when evaluation is on), each short enough that a response of
        generation.max_new_tokens still fits train.seq_length; the problem when too few to fill a
        rollout batch."""
        cfg, tok = self.cfg, self.tokenizer
        template = self.data_template()
        limits = {
            "data.max_prompt_length": cfg.data.max_prompt_length,
            "train.seq_length - generation.max_new_tokens": cfg.train.seq_length - cfg.generation.max_new_tokens,
        }
        limit = min(limits.values())
        tools_cfg = getattr(cfg, "tools", None)
        if tools_cfg is not None and tools_cfg.enabled:
            problem = layout_problem(tok, template)
            if problem:
                return [f"tools.funcs: {problem}"]
            self.tools = load_tools(tools_cfg)
            # merged/ must render tool conversations as the rollouts did (the layout in front)
            self.chat_template = template_jinja(template, tok, tools=True)
        self.template = template
        schemas = [t.schema for t in self.tools.values()] or None
        self.train_samples = build_prompt_data(cfg.data, tok, template, "train", limit, schemas, limits)
        if cfg.train.eval_steps > 0 and cfg.data.has_eval:
            self.eval_samples = build_prompt_data(cfg.data, tok, template, "eval", limit, schemas, limits)
        # all skipped, dropped overlong, or too few
        return self.fill_problems(len(self.train_samples), "usable prompt(s)", "rollout batch")

    def frozen_copies(self) -> list[torch.nn.Module]:
        """The reference and reward copies beside the actor-critic (full fine-tuning; GRPO's reward model)."""
        return [m for m in (self.inner.reference, self.inner.reward) if m is not None]

    def train_mode(self) -> None:
        """build_model left every trained module in train mode with dropout off; keep it so."""

    @property
    def inner(self) -> ActorCritic:
        return self.accelerator.unwrap_model(self.model)

    def linear_models(self) -> list:
        """The actor-critic and, with full fine-tuning, the frozen reference and reward copies."""
        inner = self.inner
        return [inner, inner.reference, inner.reward]

    @property
    def generator(self) -> Generator:
        if self._generator is None:
            policy, gen, tok = self.inner.policy, self.cfg.generation, self.tokenizer
            if self.generator_factory:
                self._generator = self.generator_factory(policy)
            else:
                engine = GENERATORS[gen.backend].engine(self.cfg, self.model_path)
                self._generator = make_generator(
                    gen.backend,
                    policy,
                    tok.pad_token_id,
                    [tok.eos_token_id],
                    gen.max_new_tokens,
                    gen.temperature,
                    synced_gpus=is_zero3(self.accelerator) and not gen.zero3_gather,
                    **engine,
                )
        return self._generator

    def sampling_weights(self):
        """The policy whole on every rank for a rollout (FSDP; DeepSpeed ZeRO-3 with
        generation.zero3_gather: pipeline/engine/accelerator.py `sampling_weights`)."""
        return sampling_weights(self.model, self.inner.policy, self.cfg.generation.zero3_gather)

    def rollout(self, prompts: list[dict], copies: int = 1) -> Rollout:
        """`copies` sampled responses of each prompt, consecutive (a group per prompt), laid out for
        scoring; with tools, multi-turn tool rollouts (pipeline/rl/tool_rollout.py). Under
        FSDP and ZeRO-3 the weights are gathered for the sampling (`sampling_weights`: ranks stop at
        different lengths, so the decode's forwards must not all-gather block by block)."""
        if self.tools:
            tok, gen = self.tokenizer, self.cfg.generation
            env = ToolEnv(
                tok, self.template, self.tools, self.cfg.tools, tok.eos_token_id, tok.pad_token_id, gen.max_new_tokens
            )
            with self.sampling_weights():
                return tool_rollout(self.generator, prompts, env, copies)
        ids = [p["prompt_ids"] for p in prompts for _ in range(copies)]
        with self.sampling_weights():
            responses = self.generator.generate(ids)
        rollout = assemble(ids, responses, self.tokenizer.pad_token_id, [self.tokenizer.eos_token_id])
        engine = getattr(self.generator, "last_logprobs", None)  # an engine that reports its log-probs (vLLM)
        if engine:
            rollout.engine_logp = engine_logprob_matrix(rollout.responses, engine, rollout.response_mask.shape[1])
        return rollout

    def tool_figures(self, rollout: Rollout) -> dict[str, float]:
        """A tool rollout's calls over every rank's completions, as TRL's GRPOTrainer logs them:
        `tools/call_frequency` (calls answered per completion) and `tools/failure_frequency` (the
        share of them answered with an error text; 0 without calls). {}: no tool rollout."""
        if rollout.tool_calls is None:
            return {}
        asked, failed = (sum(column) for column in zip(*rollout.tool_calls))
        local = torch.tensor([len(rollout.tool_calls), asked, failed], dtype=torch.float64)
        rows, asked, failed = all_reduce_sum(local, self.accelerator).tolist()
        return {"tools/call_frequency": asked / rows, "tools/failure_frequency": failed / asked if asked else 0.0}

    def reward_inputs(self, samples: list[dict], rollout: Rollout) -> tuple[list, list, list[dict]]:
        """(prompts, completions, columns) of a rollout as its reward functions and judge read them: a tool
        rollout's conversations, else each response decoded without special tokens."""
        texts = (
            None
            if rollout.conversations
            else [self.tokenizer.decode(r, skip_special_tokens=True) for r in rollout.responses]
        )
        return rw.reward_inputs(samples, texts, rollout.conversations)

    def opened_judge(self) -> JudgeReward:
        """This rank's LLM judge (the config's `judge:`), opened at its first use: its disk cache then
        holds what an unbroken run had cached by this step (a resumed run included), and it keeps
        this rank's share of judge.max_concurrency."""
        if getattr(self, "judge", None) is None:
            acc = self.accelerator
            self.judge = rw.open_judge(
                self.cfg.judge, self.cfg.output_dir, acc.process_index, acc.num_processes, self.step
            )
        return self.judge

    def sample_text(self, prompts: list[str], responses: list, rewards, count: int, answer: str = "response") -> str:
        """The first `count` prompt / answer / reward triples as markdown, for the tracker (`answer`
        names the answer's field: PPO's response, GRPO's completion)."""
        parts = []
        for i in range(min(count, len(prompts))):
            text = self.tokenizer.decode(responses[i], skip_special_tokens=False)
            parts.append(f"**prompt**: {prompts[i]}\n\n**{answer}**: {text}\n\n**reward**: {float(rewards[i]):.4f}")
        return "\n\n---\n\n".join(parts)

    def input_models(self) -> dict[str, str]:
        """The reward model: the policy learns its scores, so new weights at reward_model.path
        change the run as a changed setting does (a resume refuses them)."""
        return {"reward_model.path": self.reward_path} if self.reward_path else {}

    def reward_model_record(self) -> dict:
        """The reward model the policy was optimised against (the driver re-runs the stage when it changes)."""
        if self.reward_path is None:
            return {}
        return {"reward_model": {"path": self.reward_path, "weights_hash": weights_hash(self.reward_path)}}

    def export_module(self) -> torch.nn.Module:
        """The policy alone, without the critic and the reference and reward copies."""
        return self.inner.policy

    def release(self) -> None:
        close = getattr(self._generator, "close", None)  # a server the generator started (vLLM)
        if close is not None:
            close()
        self._generator = None
        self.frozen_engines = []
