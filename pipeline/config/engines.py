"""The distributed engines: what `distributed.engine` may name, each entry carrying the facts the
config checks read (the optional package it runs on, the config file it needs, the `distributed.*`
options only it reads and their checks, whether its runs resume exactly, whether its ranks sample in
lockstep, whether QLoRA's 4-bit weights load under it).

Everything that asks about an engine asks its entry here: `DistributedConfig.problems`, which
packages a stage keeps unloaded (pipeline/engine/stage.py), PPO's tool-rollout check, the capability
table (pipeline/config/capabilities.py). The runtime half, each entry's Accelerator options, how it
prepares the model and optimizer and what keeps it from running a config on this machine, is
pipeline/engine/engines.py's `RUNTIMES`, keyed by the same names (tests/test_registries.py checks).
Adding an engine is one entry here, its `RUNTIMES` entry, and its test. Imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional


def _none(*args: Any) -> list[str]:
    return []


def _loads(zero_stage: Optional[int]) -> str:
    return ""


def _samples_alone(zero_stage: Optional[int], gathers: bool) -> str:
    return ""


@dataclass(frozen=True)
class EngineFacts:
    summary: str
    package: Optional[str] = None
    """The optional package it runs on: kept unloaded unless this engine is chosen, and its absence a
    config problem."""
    config_file: Optional[str] = None
    """The `distributed.*` key naming a file it cannot run without (DeepSpeed's JSON, which also sets
    the ZeRO stage: `zero_stage`)."""
    options: tuple[str, ...] = ()
    """The `distributed.*` keys only this engine reads."""
    option_problems: Callable[[Any, str], list[str]] = _none
    """(distributed section, its key) -> its options' bad values, one line each (checked whatever the
    chosen engine, as every key of a section is)."""
    no_resume: str = ""
    """Why a run of it cannot resume exactly ("": it resumes exactly)."""
    lockstep: Callable[[Optional[int], bool], str] = _samples_alone
    """(ZeRO stage of its config file, None without one; whether the policy's weights are gathered for
    sampling, `generation.zero3_gather`) -> why its ranks then sample in lockstep ("": each samples on
    its own); tool rollouts, whose ranks take different numbers of turns, are refused there."""
    no_qlora: Callable[[Optional[int]], str] = _loads
    """(ZeRO stage of its config file, None without one) -> why QLoRA's 4-bit weights cannot load under
    it, as the one line the config check and the capability table both print ("": they load)."""


SHARDING_NAMES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
"""The `distributed.fsdp_sharding` names the config accepts (FSDP1's; which of them FSDP2 has is
pipeline/engine/fsdp.py's SHARDING, asked with the combination problems)."""


def _fsdp_option_problems(dist: Any, key: str) -> list[str]:
    if dist.fsdp_sharding in SHARDING_NAMES:
        return []
    return [f"{key}.fsdp_sharding: {dist.fsdp_sharding!r} is not one of {', '.join(map(repr, SHARDING_NAMES))}"]


QLORA_UNDER_ZERO3 = (
    "model.finetuning: qlora cannot load under DeepSpeed ZeRO-3 (its 4-bit weights are placed through a "
    "device_map, which ZeRO-3's partitioned loading refuses); use a ZeRO-2 config "
    "(deepspeed_configs/zero2.json), distributed.engine ddp, or model.finetuning lora"
)
QLORA_UNDER_FSDP = (
    "distributed.engine: fsdp cannot shard QLoRA's 4-bit weights; use distributed.engine ddp, "
    "or model.finetuning lora or full"
)


ENGINES: dict[str, EngineFacts] = {
    "ddp": EngineFacts("data parallel through accelerate (one process without a launcher)"),
    "deepspeed": EngineFacts(
        "DeepSpeed ZeRO through accelerate (a CUDA GPU, or CPU ranks over gloo)",
        package="deepspeed",
        config_file="deepspeed_config",
        options=("deepspeed_config",),
        no_resume="ZeRO shards the optimizer state over ranks; the checkpoint holds rank 0's share",
        lockstep=lambda zero_stage, gathers: (
            ""
            if zero_stage != 3 or gathers
            else "under DeepSpeed ZeRO-3 with generation.zero3_gather false every rank samples in lockstep; set it true"
        ),
        # transformers refuses a device_map under ZeRO-3's zero.Init, and bitsandbytes places the
        # 4-bit weights only through one; ZeRO-2 keeps whole weights.
        no_qlora=lambda zero_stage: "" if zero_stage != 3 else QLORA_UNDER_ZERO3,
    ),
    "fsdp": EngineFacts(
        "torch's FSDP2 (fully_shard), on CPU over gloo or on CUDA over nccl",
        options=("fsdp_sharding",),
        option_problems=_fsdp_option_problems,
        no_qlora=lambda zero_stage: QLORA_UNDER_FSDP,  # bitsandbytes' 4-bit weights are no tensors FSDP2 can shard
    ),
}
"""`distributed.engine` -> its entry."""


def zero_stage(path: Optional[str]) -> Optional[int]:
    """The ZeRO stage of a DeepSpeed JSON (0 where it has no zero_optimization; None: no readable
    file or no stage 0-3, its own config problem: `deepspeed_json_problems`)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8")) if path else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    zero = data.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return stage if type(stage) is int and 0 <= stage <= 3 else None


def deepspeed_json_problems(path: str, key: str, max_grad_norm: Optional[float] = None) -> list[str]:
    """Why the DeepSpeed JSON at `path` cannot configure a run, one line each (accelerate and
    DeepSpeed would raise on each rank): not JSON (at its line), not an object, a ZeRO stage that is
    not 0-3, and a gradient_clipping that contradicts `max_grad_norm` (train.max_grad_norm sets it:
    the file may say "auto" or leave it out)."""
    where = f"{key}: {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        return [f"{key}: {path}:{err.lineno}: not JSON ({err.msg})"]
    except (OSError, UnicodeDecodeError) as err:
        return [f"{where}: cannot be read ({err})"]
    if not isinstance(data, dict):
        return [f"{where}: the top level must be a JSON object, got {type(data).__name__}"]
    out = []
    zero = data.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if not (type(stage) is int and 0 <= stage <= 3):
        out.append(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    clip = data.get("gradient_clipping", "auto")
    if max_grad_norm is not None and clip != "auto" and clip != max_grad_norm:
        out.append(
            f"{where}: gradient_clipping {clip!r} contradicts train.max_grad_norm {max_grad_norm!r} (which sets it; "
            'write "auto" or leave it out)'
        )
    return out


def package_wanted(engine: str) -> dict[str, bool]:
    """Every package an engine runs on -> whether `engine` (the chosen one) runs on it."""
    chosen = ENGINES.get(engine)
    return {f.package: f is chosen for f in ENGINES.values() if f.package is not None}


def missing_package(engine: str, installed: Callable[[str], bool]) -> Optional[str]:
    """The one line refusing `engine` when the package it runs on is not installed, or None."""
    package = ENGINES[engine].package
    if package is None or installed(package):
        return None
    plain = " or ".join(name for name, f in ENGINES.items() if f.package is None)
    return f"distributed.engine: {engine} needs the {package} package (pip install {package}); or use {plain}"


def resume_refusal(engine: str) -> Optional[str]:
    """The one line refusing to resume a run of `engine`, or None where it resumes exactly."""
    why = ENGINES[engine].no_resume
    if not why:
        return None
    exact = " or ".join(name for name, f in ENGINES.items() if not f.no_resume)
    return (
        f"checkpoint.resume: this folder's checkpoint was written by a distributed.engine {engine} run, which "
        f"does not resume ({why}); set checkpoint.resume false to start again (its checkpoints are moved aside, "
        f"not deleted). Runs under distributed.engine {exact} resume exactly"
    )


def resumes(engine: str) -> bool:
    """Whether a run of `engine` resumes from its checkpoints (an unknown name: its own problem)."""
    return engine not in ENGINES or not ENGINES[engine].no_resume


def stop_advice(engine: str) -> str:
    """What a stopped run of `engine` tells the user to do next: rerun to continue, or (where the
    engine's checkpoints do not resume) start again."""
    if resumes(engine):
        return "rerun the same command to continue"
    why = ENGINES[engine].no_resume
    return (
        f"a distributed.engine {engine} run does not resume ({why}): rerun with checkpoint.resume false to start again"
    )


def tools_refusal(engine: str, zero_stage: Optional[int] = None, gathers: bool = True) -> Optional[str]:
    """Why tool rollouts cannot run under `engine` with the ZeRO stage of its config file and
    `generation.zero3_gather` (the reason after `tools.funcs: `), or None."""
    facts = ENGINES.get(engine)
    why = facts.lockstep(zero_stage, gathers) if facts is not None else ""
    if not why:
        return None
    return f"tool rollouts need ranks that sample on their own, taking different numbers of turns: {why}"
