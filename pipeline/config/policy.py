"""The config sections the policy (RL) stages share, PPO and GRPO: the reward model they read
and how they sample (`generation`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from pipeline.config.backends import BACKENDS, unread_options
from pipeline.config.engines import ENGINES, tools_refusal, zero_stage
from pipeline.config.sections import DistributedConfig, ModelConfig


@dataclass
class RewardModelConfig(ModelConfig):
    """The reward model: a merged RM folder (sequence classifier with one output). Its
    `finetuning` and `gradient_checkpointing` are ignored: the critic trained on it follows
    `model.finetuning` and `model.gradient_checkpointing`."""

    dtype: str = "auto"
    """Dtype the reward model (and PPO's critic) is loaded in: auto|fp32|bf16|fp16. 'auto' is
    `model.dtype`'s: the critic trains beside the policy in one precision (a policy set to fp32 on
    a GPU gets an fp32 critic, not a bf16 one)."""
    path: str = ""
    """Required: the RM stage's merged/ folder (the pipeline driver sets it). 'embedded' (a
    random reward head) only with allow_untrained."""
    allow_untrained: bool = False
    """Allow a reward model with an untrained head ('embedded'): PPO then optimises noise, so
    only for smoke runs of the machinery."""

    def beside(self, model: ModelConfig, **fields) -> "RewardModelConfig":
        """This config as a stage loads it beside the policy `model`: `dtype` 'auto' resolved to
        `model.dtype`, `fields` (finetuning, gradient_checkpointing) replaced."""
        return dataclasses.replace(self, dtype=model.dtype if self.dtype == "auto" else self.dtype, **fields)


@dataclass(frozen=True)
class Correction:
    """What the config checks and the capability table know of one train-inference mismatch
    correction (`generation.correction`); its weights are pipeline/algorithms/mismatch.py's
    CORRECTIONS entry of the same name."""

    weighs: bool
    """It weighs each token's loss by p_trainer / p_engine, so it needs a backend that reports the
    engine's log-probs of what it sampled."""
    options: tuple[str, ...] = ()
    """The `generation.*` keys it reads."""
    doc: str = ""


CORRECTIONS: dict[str, Correction] = {
    "none": Correction(False, doc="no weight"),
    "tis": Correction(True, ("correction_cap", "correction_floor"), "token-level truncated importance weights"),
    "mis": Correction(True, ("correction_cap", "correction_floor"), "tokens whose weight leaves [floor, cap] drop out"),
}
"""`generation.correction`'s entries (beside `auto`, the backend's `default_correction`)."""
AUTO = "auto"


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
    """The sampler: relay (Relay's decode engine, pipeline/modeling/decode.py: static KV cache,
    batch-level early exit), hf (transformers' generate, the reference; both draw from the same
    distribution and RNG stream) or vllm (a vLLM server from bench/.venv-vllm, made by
    run_scripts/install_vllm.sh, following the policy's LoRA adapter: pipeline/rl/vllm_generator.py);
    pipeline/config/backends.py's BACKENDS."""
    zero3_gather: bool = True
    """Under DeepSpeed ZeRO-3: gather the policy's partitioned weights once for each rollout, so that
    every rank samples alone with the whole policy (TRL's ds3_gather_for_generation, on by default
    there too). false: for a policy too large for one device; each forward then gathers layer by
    layer, every rank steps until all are done (transformers' generate with synced_gpus, slower),
    and tool rollouts are refused (their ranks take different numbers of turns). Read under ZeRO-3
    only."""
    correction: str = "auto"
    """Train-inference mismatch correction of the GRPO and PPO policy losses (pipeline/algorithms/mismatch.py):
    none, tis (token-level truncated importance weights) or mis (tokens whose weight leaves
    [correction_floor, correction_cap] drop out); auto: the backend's `default_correction` (tis for
    vllm, which reports engine log-probs; none for relay and hf, which sample the distribution the
    trainer scores)."""
    correction_cap: float = 3.0
    """Upper bound of the importance weight p_trainer / p_engine (TRL's default 3.0)."""
    correction_floor: Optional[float] = None
    """Lower bound (tis: clamp; mis: band); None: none."""
    vllm_tensor_parallel_size: int = 1
    """backend vllm on GPUs: the engine's tensor-parallel size (its --tensor-parallel-size)."""
    vllm_sleep: bool = False
    """backend vllm on a GPU: the engine sleeps during each update (vLLM's sleep mode, level 1: its
    weights move to CPU memory and its KV cache is freed) and wakes before the next rollout."""
    vllm_gpu_memory_utilization: float = 0.3
    """backend vllm on a GPU: the share of GPU memory the engine may take. It runs on the trainer's
    GPU, so the default is TRL's for an engine colocated with the trainer (0.3); vLLM's own 0.9
    would leave the trainer nothing. Raise it with vllm_sleep (the engine frees its memory during
    each update). Not passed on a CPU."""

    @property
    def correction_name(self) -> str:
        """`correction` with auto resolved for the backend."""
        if self.correction != AUTO:
            return self.correction
        entry = BACKENDS.get(self.backend)
        return entry.default_correction if entry is not None else "none"

    def problems(self, key: str = "generation") -> list[str]:
        out: list[str] = []
        if self.max_new_tokens < 1:
            out.append(f"{key}.max_new_tokens: must be >= 1")
        if self.temperature <= 0:
            out.append(f"{key}.temperature: must be > 0")
        if self.backend not in BACKENDS:
            out.append(f"{key}.backend: {self.backend!r} is not one of {tuple(BACKENDS)}")
        if self.correction != AUTO and self.correction not in CORRECTIONS:
            out.append(f"{key}.correction: {self.correction!r} is not one of {(AUTO, *CORRECTIONS)}")
        if self.correction_cap <= 0 or (
            self.correction_floor is not None and not 0 <= self.correction_floor < self.correction_cap
        ):
            out.append(
                f"{key}.correction_cap/correction_floor: need "
                f"0 <= floor < cap, got {self.correction_floor} and {self.correction_cap}"
            )
        for entry in BACKENDS.values():
            out += entry.option_problems(self, key)
        out += unread_options(self, BACKENDS, self.backend, key, "backend")
        if self.top_k != 0 or self.top_p != 1.0:
            out.append(
                f"{key}.top_k/top_p: RL stages sample from the full distribution (top_k 0, top_p 1.0), because the "
                "ratio scores log-probs of softmax(logits / temperature); use temperature to sharpen sampling"
            )
        return out

    def room_problems(self, seq_length: int) -> list[str]:
        """A prompt and its response must fit train.seq_length."""
        if 1 <= self.max_new_tokens and seq_length <= self.max_new_tokens:
            return [
                f"train.seq_length: {seq_length} leaves no room for a prompt before generation.max_new_tokens "
                f"{self.max_new_tokens}"
            ]
        return []


@dataclass
class ToolsConfig:
    """Tool rollouts (pipeline/rl/tool_rollout.py): the policy may call Python tools while it
    answers; Relay runs each call, shows the result as the chat template renders tool results and
    lets the policy go on, until an answer without calls or a limit. Only the tokens the policy
    sampled train. Empty `funcs`: single-answer rollouts."""

    funcs: list[str] = field(default_factory=list)
    """Tools as "module:function" of the project or an installed package, or "path/to/file.py:function"
    (as grpo.reward_funcs).
    Each runs in a thread of the trainer's process: it must not touch the model, torch's RNG or
    Python's `random` (a resumed run would sample differently), and must be safe to abandon when
    it runs past `timeout` (its thread keeps running; its result is dropped)."""
    schemas: Optional[str] = None
    """A JSON file with tool schemas (a list of {"type": "function", "function": {...}} or function
    objects) for tools whose schema is not read from their signature and docstring
    (transformers' get_json_schema: type hints and a Google-style Args section); null: all read."""
    max_tool_calls: int = 4
    """Most calls run per rollout; later calls get an error text as their result."""
    max_turns: int = 4
    """Most assistant turns per rollout (the final answer included); a rollout whose last allowed
    turn still calls tools ends there."""
    timeout: float = 10.0
    """Seconds one call may run; past it the call's result is an error text."""

    @property
    def enabled(self) -> bool:
        return bool(self.funcs)

    def problems(self, key: str = "tools") -> list[str]:
        out: list[str] = []
        if self.max_tool_calls < 1:
            out.append(f"{key}.max_tool_calls: must be >= 1, got {self.max_tool_calls}")
        if self.max_turns < 2:
            out.append(f"{key}.max_turns: must be >= 2 (a call, then an answer), got {self.max_turns}")
        if self.timeout <= 0:
            out.append(f"{key}.timeout: must be > 0 seconds, got {self.timeout}")
        if self.schemas is not None and not self.funcs:
            out.append(f"{key}.schemas: given without {key}.funcs")
        return out


def sampling_engine_problems(gen: GenerationConfig, dist: DistributedConfig, tools: bool) -> list[str]:
    """A policy stage's sampling against its distributed engine, one line each: `generation.zero3_gather`
    set false where no ZeRO-3 reads it, and tool rollouts (`tools`: the stage has tools) where the
    engine's ranks would sample in lockstep (pipeline/config/engines.py's `lockstep`)."""
    facts = ENGINES.get(dist.engine)
    if facts is None:  # the distributed section's own problem
        return []
    zero = zero_stage(getattr(dist, facts.config_file)) if facts.config_file else None
    if facts.config_file and zero is None:  # no readable file: the distributed section's own problem
        return []
    out = []
    if not gen.zero3_gather and zero != 3:
        under = f"distributed.engine is {dist.engine!r}" + (f", ZeRO stage {zero}" if zero is not None else "")
        out.append(f"generation.zero3_gather: only DeepSpeed ZeRO-3 reads it ({under})")
    if tools and (why := tools_refusal(dist.engine, zero, gen.zero3_gather)):
        out.append(f"tools.funcs: {why}")
    return out
