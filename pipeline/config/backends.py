"""The generation backends: the samplers `generation.backend` may name, each entry carrying its own
facts (whether it reports engine log-probs, and so the mismatch correction `auto` resolves to;
whether it samples in a server of its own), the `generation.*` options only it reads, and the
checks of those options (their values anywhere; what a machine's CUDA GPUs must offer them).

Everything that asks about a backend asks its entry here: the config checks, `correction: auto`,
the capability table (pipeline/config/capabilities.py). The runtime half, how each entry makes its
sampler and what keeps it from running this stage on this machine, is
pipeline/rl/rollout.py's `GENERATORS`, keyed by the same names (tests/test_backends.py
checks). Adding a backend is one entry here, its `GENERATORS` entry, and its test. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping


def _none(*args: Any) -> list[str]:
    return []


def unread_options(section: Any, entries: Mapping[str, Any], chosen: str, key: str, field: str) -> list[str]:
    """The options of the `entries` other than `chosen` (each entry's `options`: fields of the config
    `section` only it reads) that `section` sets away from their defaults, one line each: the run
    would never read them, so they are refused rather than ignored. [] when `chosen` is no entry
    (a problem of its own)."""
    if chosen not in entries:
        return []
    own = entries[chosen].options
    defaults = {f.name: f.default for f in dataclasses.fields(section)}
    return [
        f"{key}.{option}: only {key}.{field} {name} reads it ({key}.{field} is {chosen!r})"
        for name, entry in entries.items()
        if name != chosen
        for option in entry.options
        if option not in own and getattr(section, option) != defaults[option]
    ]


@dataclass(frozen=True)
class Backend:
    summary: str
    engine_logprobs: bool
    """It reports each sampled token's log-prob from its own kernels (a correction has something to
    weigh against)."""
    own_server: bool
    """It samples in a server process of its own, fed the policy's weights after every update."""
    options: tuple[str, ...] = ()
    """The `generation.*` keys only this backend reads."""
    option_problems: Callable[[Any, str], list[str]] = _none
    """(generation section, its key) -> its options' bad values, one line each (checked whatever the
    chosen backend, as every key of a section is)."""
    device_problems: Callable[[Any, int, str], list[str]] = _none
    """(generation section, CUDA devices on this machine, its key) -> its options this machine cannot
    run (those that need a GPU, or more GPUs), one line each; asked when the backend is chosen."""

    @property
    def default_correction(self) -> str:
        """What `generation.correction: auto` resolves to: tis where the engine reports its own
        log-probs, none where it samples the distribution the trainer scores."""
        return "tis" if self.engine_logprobs else "none"


def _vllm_option_problems(gen: Any, key: str) -> list[str]:
    out = []
    if gen.vllm_tensor_parallel_size < 1:
        out.append(f"{key}.vllm_tensor_parallel_size: must be >= 1, got {gen.vllm_tensor_parallel_size}")
    if not 0 < gen.vllm_gpu_memory_utilization <= 1:
        out.append(f"{key}.vllm_gpu_memory_utilization: must be in (0, 1], got {gen.vllm_gpu_memory_utilization}")
    return out


def _vllm_device_problems(gen: Any, cuda_devices: int, key: str) -> list[str]:
    """Sleep mode needs CUDA (vLLM's CPU build has none); a tensor-parallel size needs that many GPUs."""
    out = []
    if gen.vllm_sleep and cuda_devices == 0:
        out.append(f"{key}.vllm_sleep: vLLM's sleep mode needs a CUDA GPU (its CPU build has none)")
    if gen.vllm_tensor_parallel_size > 1 and gen.vllm_tensor_parallel_size > cuda_devices:
        out.append(
            f"{key}.vllm_tensor_parallel_size: {gen.vllm_tensor_parallel_size} needs as many CUDA GPUs; "
            f"this machine has {cuda_devices}"
        )
    return out


BACKENDS: dict[str, Backend] = {
    "relay": Backend("Relay's decode engine", engine_logprobs=False, own_server=False),
    "hf": Backend("transformers' generate", engine_logprobs=False, own_server=False),
    "vllm": Backend(
        "a vLLM server following the policy",
        engine_logprobs=True,
        own_server=True,
        options=("vllm_tensor_parallel_size", "vllm_sleep", "vllm_gpu_memory_utilization"),
        option_problems=_vllm_option_problems,
        device_problems=_vllm_device_problems,
    ),
}
"""`generation.backend` -> its entry, in the order the capability table lists them."""
