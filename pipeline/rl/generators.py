"""Generation behind one small protocol for the RL stages (PPO, GRPO), `relay sample` and the
distillation stage: a `Generator` samples responses to left-padded prompts. The backends are a
registry (`GENERATORS`: transformers' `generate`, Relay's own decode loop, a vLLM server), each
entry carrying its own engine options and config checks, so no caller branches on a backend's name.
What is done with the samples (the padded `Rollout`, log-probs, the actor-critic) is
pipeline/rl/rollout.py."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import torch

from data_formats.collate import left_pad
from pipeline.modeling.decode import generate as decode_generate
from pipeline.rl import vllm_generator

log = logging.getLogger("relay.rollout")


class Generator(Protocol):
    """Anything that samples responses for tokenised prompts (HF `generate` today; a faster
    engine such as vLLM can implement the same call)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: Optional[Sequence[int]] = None
    ) -> list[list[int]]:
        """Raw response ids per prompt (no prompt, no padding; may stop at EOS or run to the limit).
        `max_new_tokens`: each row's own limit (a tool rollout's later turns), at most the
        generator's; None: the generator's for every row. Keyword only: a generator may take more
        options (vLLM's `temperature`), and a list of limits must never land on one of them.

        A generator that samples on an engine of its own may also set `last_logprobs` (the
        engine's log-prob of each returned token; pipeline/algorithms/mismatch.py reads them)."""
        ...


def sampling_config(max_new_tokens: int, temperature: float, pad_id: int, eos_ids: Sequence[int]):
    """A GenerationConfig that samples from exactly softmax(logits / temperature), the
    distribution PPO scores: no top-k/top-p truncation, no repetition penalty, no suppressed or
    forced tokens, no minimum length."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        num_beams=1,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        min_length=0,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(eos_ids),
        pad_token_id=pad_id,
        use_cache=True,
    )


@contextlib.contextmanager
def own_generation_config(model: torch.nn.Module, config):
    """Make `config` the model's generation_config for the body. transformers fills every field a
    passed config leaves unset from `model.generation_config` (a checkpoint's shipped
    `repetition_penalty`, `suppress_tokens`, ...), so swapping it is the only way to be sure
    nothing else shapes the distribution."""
    from peft import PeftModel

    hf = model.get_base_model() if isinstance(model, PeftModel) else model
    saved = hf.generation_config
    hf.generation_config = config
    try:
        yield
    finally:
        hf.generation_config = saved


@dataclass
class HFGenerator:
    """Batched sampling with the model's KV cache through `transformers` `generate`, from exactly
    the distribution the PPO update scores (`sampling_config`), in eval mode (the policy trains
    without dropout, so eval mode changes no number; it only lets generate use its KV cache under
    gradient checkpointing)."""

    model: torch.nn.Module
    pad_id: int
    eos_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    synced_gpus: bool = False
    """Keep stepping until every rank is done (DeepSpeed ZeRO-3 over several ranks: each forward
    gathers parameter shards from every rank, so a rank that stopped early would hang the rest)."""

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: Optional[Sequence[int]] = None
    ) -> list[list[int]]:
        """Rows with their own limit are sampled to the longest and cut to theirs (transformers'
        generate has one limit per call)."""
        from pipeline.modeling.models import eval_mode

        limits = list(max_new_tokens) if max_new_tokens is not None else [self.max_new_tokens] * len(prompts)
        input_ids, attention_mask = left_pad(prompts, self.pad_id)
        device = next(self.model.parameters()).device
        config = sampling_config(max(limits), self.temperature, self.pad_id, self.eos_ids)
        with eval_mode(self.model), own_generation_config(self.model, config):
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=config,
                synced_gpus=self.synced_gpus,
            )
        return [row.tolist()[:limit] for row, limit in zip(out[:, input_ids.shape[1] :].cpu(), limits)]


@dataclass
class RelayGenerator:
    """Sampling through Relay's decode engine (pipeline/modeling/decode.py: static KV cache, one
    forward per token, batch-level early exit), from exactly softmax(logits / temperature), the
    distribution the PPO/GRPO update scores, drawn from torch's default RNG (so a resumed run
    draws what an unbroken one does)."""

    model: torch.nn.Module
    pad_id: int
    eos_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0

    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: Optional[Sequence[int]] = None
    ) -> list[list[int]]:
        limits = list(max_new_tokens) if max_new_tokens is not None else self.max_new_tokens
        return decode_generate(
            self.model,
            prompts,
            max_new_tokens=limits,
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            temperature=self.temperature,
            keep_packed=False,
        ).tokens

    def session(self, rows: int):
        """A decode session over `rows` conversations that keeps their KV cache across a tool
        rollout's turns (pipeline/modeling/decode_session.py: the same samples as `generate` on the
        whole conversations, without prefilling them again); None where the model's cache cannot be
        kept (`decode_session.supported`)."""
        from pipeline.modeling.decode_session import DecodeSession, supported

        if not supported(self.model):
            return None
        return DecodeSession(self.model, rows, eos_ids=self.eos_ids, pad_id=self.pad_id, temperature=self.temperature)


def make_relay(
    model: torch.nn.Module,
    pad_id: int,
    eos_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    *,
    synced_gpus: bool = False,
) -> Generator:
    """Relay's decode engine; under `synced_gpus` (DeepSpeed ZeRO-3 over several ranks, where every
    rank must keep stepping until all are done) transformers' generate, which keeps that contract."""
    if not synced_gpus:
        return RelayGenerator(model, pad_id, list(eos_ids), max_new_tokens, temperature)
    log.info(
        "generation.backend relay: DeepSpeed ZeRO-3 over several ranks samples with the hf backend "
        "(every rank must keep stepping until all are done)"
    )
    return make_hf(model, pad_id, eos_ids, max_new_tokens, temperature, synced_gpus=synced_gpus)


def make_hf(
    model: torch.nn.Module,
    pad_id: int,
    eos_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    *,
    synced_gpus: bool = False,
) -> Generator:
    return HFGenerator(model, pad_id, list(eos_ids), max_new_tokens, temperature, synced_gpus=synced_gpus)


def _no_engine(cfg: Any, model_path: str) -> dict:
    return {}


def _no_problems(cfg: Any, model_path: str) -> list[str]:
    return []


class GeneratorSpec(NamedTuple):
    """The runtime half of a generation backend (its facts: pipeline/config/backends.py)."""

    make: Callable[..., Generator]
    """(model, pad_id, eos_ids, max_new_tokens, temperature, *, synced_gpus, **engine) -> its sampler."""
    engine: Callable[[Any, str], dict] = _no_engine
    """(RL stage config, policy folder) -> the keyword options `make` takes beyond the common ones."""
    problems: Callable[[Any, str], list[str]] = _no_problems
    """(RL stage config, policy folder) -> what keeps it from sampling that stage on this machine,
    one line each (asked before any model loads)."""


GENERATORS: dict[str, GeneratorSpec] = {
    "relay": GeneratorSpec(make_relay),
    "hf": GeneratorSpec(make_hf),
    "vllm": GeneratorSpec(
        vllm_generator.make_vllm, engine=vllm_generator.stage_engine, problems=vllm_generator.stage_problems
    ),
}
"""`generation.backend` -> how it samples; the same names as pipeline/config/backends.py's BACKENDS."""


def make_generator(
    backend: str,
    model: torch.nn.Module,
    pad_id: int,
    eos_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    *,
    synced_gpus: bool = False,
    **engine,
) -> Generator:
    """The sampler `generation.backend` names (`GENERATORS`): 'relay' (the decode engine), 'hf'
    (transformers' `generate`, the reference) or 'vllm' (a vLLM server: pipeline/rl/vllm_generator.py;
    `engine` gives its `base` folder, `workdir` and `max_model_len`, as its `GeneratorSpec.engine` makes
    them from a stage's config). Under `synced_gpus` (DeepSpeed ZeRO-3 over several ranks, where every
    rank must keep stepping until all are done) the relay backend hands over to 'hf', which keeps that
    contract.

    Raises:
        ValueError: an unknown backend.
    """
    spec = GENERATORS.get(backend)
    if spec is None:
        raise ValueError(f"generation.backend: {backend!r} is not one of {tuple(GENERATORS)}")
    return spec.make(model, pad_id, eos_ids, max_new_tokens, temperature, synced_gpus=synced_gpus, **engine)
