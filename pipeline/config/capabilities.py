"""What Relay runs: every combination of stage x generation backend x tools x adapter x distributed
engine x mismatch correction is either run by the test suite (its cell names the tests) or refused
before any model loads, with one line saying why. `refusal` is the one answer; `relay validate`,
every stage's validation and `relay train --nproc N` (before torchrun starts a rank) ask it, and
`relay capabilities` prints the table the README carries.

Axes that do not apply to a stage collapse to "-": only a policy stage (`StageInfo.samples`) has a
generation backend, only one with a `tools:` section (`StageInfo.tools`) has tools, and only one
whose loss weighs tokens by the mismatch correction (`StageInfo.corrects`) has a correction. The
correction is the resolved one (`auto` is tis on an engine that reports its own log-probs, none
otherwise).

A cell is supported when no rule refuses it and `TESTS` names the tests that train it (a scripted
sampler stands in for the relay backend in the multi-rank equivalence runs, so their rollouts do not
depend on how prompts are dealt to ranks); a cell no test trains is refused as such, so the table
never claims what the suite does not run. Adding a cell is one `TESTS` line; lifting a refusal is
its rule. Imports no torch: the CLI asks it before anything heavy loads.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from pipeline.config import engines as engine_facts
from pipeline.config.backends import BACKENDS
from pipeline.config.engines import zero_stage
from pipeline.config.policy import CORRECTIONS
from pipeline.config.sections import FINETUNING

NONE = "-"
"""An axis that does not apply to the cell's stage."""

ZERO_ON_CPU = True
"""Whether DeepSpeed ZeRO cells run without a CUDA GPU. The one switch to flip once ZeRO trains on
CPU and its CPU tests are in the cells' TESTS."""


@dataclass(frozen=True)
class Engine:
    """A column of the table: a `distributed.engine` entry (pipeline/config/engines.py; the tool-rollout
    rule reads its lockstep fact), split by ranks and ZeRO stage where the suite tests them apart.
    tests/test_registries.py checks the facts below agree with the entry's."""

    label: str
    config: str
    """Its `distributed.engine` value (a key of pipeline/config/engines.py's ENGINES)."""
    ranks: str
    """'one' (a single process), 'many' (more than one rank) or 'any'."""
    shards: bool
    """Weights or optimizer state are split over ranks (no rank holds the whole policy)."""
    zero_stage: Optional[int] = None
    """DeepSpeed ZeRO's stage, read from distributed.deepspeed_config (CUDA only unless ZERO_ON_CPU)."""

    @property
    def zero(self) -> bool:
        return self.zero_stage is not None

    @property
    def no_qlora(self) -> str:
        """Why QLoRA's 4-bit weights cannot load under it ("": they load), the engine entry's own line."""
        return engine_facts.ENGINES[self.config].no_qlora(self.zero_stage)


ENGINES: dict[str, Engine] = {
    "single": Engine("one process", "ddp", "one", shards=False),
    "ddp": Engine("DDP", "ddp", "many", shards=False),
    "fsdp": Engine("FSDP2", "fsdp", "any", shards=True),
    "zero2": Engine("ZeRO-2", "deepspeed", "any", shards=True, zero_stage=2),
    "zero3": Engine("ZeRO-3", "deepspeed", "any", shards=True, zero_stage=3),
}
ADAPTERS = FINETUNING
TOOLS = ("off", "on")
AXES = ("stage", "backend", "tools", "adapter", "engine", "correction")


@dataclass(frozen=True)
class Cell:
    stage: str
    backend: str = NONE
    tools: str = NONE
    adapter: str = "lora"
    engine: str = "single"
    correction: str = NONE

    def describe(self) -> str:
        parts = [f"{axis} {getattr(self, axis)}" for axis in AXES if getattr(self, axis) != NONE]
        return " x ".join(parts)


def policy_stages() -> tuple[str, ...]:
    from stages import STAGES

    return tuple(name for name, info in STAGES.items() if info.samples)


def cells() -> Iterator[Cell]:
    """Every cell of the table, in table order (stages as registered)."""
    from stages import STAGES

    for stage, info in STAGES.items():
        if not info.samples:
            for adapter, engine in itertools.product(ADAPTERS, ENGINES):
                yield Cell(stage, adapter=adapter, engine=engine)
            continue
        for backend, tools, correction, adapter, engine in itertools.product(
            BACKENDS, TOOLS if info.tools else (NONE,), CORRECTIONS if info.corrects else (NONE,), ADAPTERS, ENGINES
        ):
            yield Cell(stage, backend, tools, adapter, engine, correction)


# ------------------------------------------------------------------------------------------
# The tests that train each supported cell (pytest node ids; tests/test_capabilities.py checks
# that every one exists)
# ------------------------------------------------------------------------------------------

DS, FSDP, GPU = "tests/test_distributed_stages.py", "tests/test_fsdp.py", "tests/test_distributed_gpu.py"
CELLS = "tests/test_cells.py"
ZC = "tests/test_zero_cpu.py"
RANKS = "tests/test_cells_ddp.py::test_two_ranks_equal_one_process"
ZRANKS = f"{ZC}::test_two_zero_ranks_equal_one_process"
DISTILL = "tests/test_distill.py::test_resume_equals_unbroken_and_the_manifest_names_the_teacher"
VLLM = "tests/test_vllm.py"
VLLM_TESTS: dict[tuple[str, str], str] = {
    ("ppo", "off"): f"{VLLM}::test_ppo_stage_on_vllm_logs_the_mismatch_and_applies_its_correction",
    ("grpo", "off"): f"{VLLM}::test_grpo_stage_on_vllm_applies_its_correction",
    ("ppo", "on"): f"{VLLM}::test_ppo_with_tools_on_vllm",
    ("grpo", "on"): f"{VLLM}::test_grpo_with_tools_on_vllm",
}
"""(stage, tools): the test that trains it on the vllm backend in one process, a case per adapter and correction
(`[adapter-correction]`, auto being vllm's default, tis; QLoRA with tools off is `VLLM_QLORA`'s, GRPO's LoRA with
tis and tools off `VLLM_RESUMED`'s)."""
VLLM_RESUMED = f"{VLLM}::test_grpo_on_vllm_resumed_on_a_fresh_server_samples_as_an_unbroken_run"
VLLM_QLORA = f"{VLLM}::test_a_qlora_policy_samples_on_vllm_as_its_adapter_on_the_unquantized_base"
"""QLoRA on the vllm backend (tools off), a case per `[stage-correction]`."""


def _plain(stage: str, adapter: str, engine: str) -> Cell:
    return Cell(stage, adapter=adapter, engine=engine)


def _policy(
    stage: str, adapter: str, engine: str, backend: str = "relay", tools: str = "off", correction: str = "none"
) -> Cell:
    return Cell(stage, backend, tools, adapter, engine, correction)


def _distill(adapter: str, engine: str, backend: str = "relay") -> Cell:
    """Distillation samples (a backend) but has neither tools nor a correction."""
    return Cell("distill", backend, NONE, adapter, engine, NONE)


HF_ON_RANKS: tuple[tuple[str, str, str], ...] = (
    ("ddp", "lora", "off"),
    ("fsdp", "lora", "off"),
    ("ddp", "full", "off"),
    ("fsdp", "full", "off"),
    ("ddp", "qlora", "off"),
    ("ddp", "lora", "on"),
    ("fsdp", "lora", "on"),
    ("ddp", "full", "on"),
    ("fsdp", "full", "on"),
    ("ddp", "qlora", "on"),
    ("zero2", "lora", "off"),
    ("zero2", "full", "off"),
    ("zero2", "qlora", "off"),
    ("zero3", "lora", "off"),
    ("zero3", "full", "off"),
    ("zero3", "lora", "on"),
    ("zero2", "lora", "on"),
    ("zero2", "full", "on"),
    ("zero2", "qlora", "on"),
    ("zero3", "full", "on"),
)
"""(engine, adapter, tools) of the hf backend's two-rank PPO and GRPO runs (tests/test_cells_ddp.py)."""
HF_DISTILL_ON_RANKS: tuple[tuple[str, str], ...] = (
    ("ddp", "lora"),
    ("fsdp", "lora"),
    ("zero2", "lora"),
    ("ddp", "full"),
    ("fsdp", "full"),
    ("zero2", "full"),
    ("ddp", "qlora"),
    ("zero2", "qlora"),
    ("zero3", "lora"),
    ("zero3", "full"),
)
"""(engine, adapter) of the hf backend's two-rank distill runs (tests/test_cells_ddp.py)."""

TESTS: dict[Cell, tuple[str, ...]] = {
    _plain("pt", "lora", "single"): ("tests/test_pt_sft.py::test_pt_packs_documents_and_merges",),
    _plain("pt", "lora", "ddp"): (
        f"{DS}::test_two_ranks_equal_one_process[ddp-pt-1-lora]",
        "tests/test_streaming.py::test_two_processes_stream_the_same_global_batches",
    ),
    _plain("pt", "lora", "fsdp"): (f"{DS}::test_two_ranks_equal_one_process[fsdp-pt-1-lora]",),
    _plain("pt", "full", "single"): (
        "tests/test_boundaries.py::test_gradient_checkpointing_recomputes_layers_in_every_stage[pt-full]",
        f"{FSDP}::test_two_fsdp_ranks_equal_one_process[pt-full]",
    ),
    _plain("pt", "full", "ddp"): (f"{FSDP}::test_two_fsdp_ranks_equal_two_ddp_ranks[pt-full]",),
    _plain("pt", "full", "fsdp"): (
        f"{FSDP}::test_two_fsdp_ranks_equal_one_process[pt-full]",
        f"{FSDP}::test_fsdp_stopped_and_resumed_equals_unbroken[pt-full]",
    ),
    _plain("pt", "qlora", "single"): (f"{CELLS}::test_qlora_trains_the_adapter_of_every_stage[pt]",),
    _plain("sft", "lora", "single"): ("tests/test_pt_sft.py::test_sft_resume_is_exact_and_ignores_a_torn_checkpoint",),
    _plain("sft", "lora", "ddp"): (f"{DS}::test_two_ranks_equal_one_process[ddp-sft-1-lora]",),
    _plain("sft", "lora", "fsdp"): (f"{FSDP}::test_two_fsdp_ranks_equal_one_process[sft]",),
    _plain("sft", "lora", "zero2"): (
        f"{GPU}::test_zero_equals_one_gpu[zero2-sft-1]",
        f"{ZRANKS}[zero2_offload-sft]",
    ),
    _plain("sft", "lora", "zero3"): (
        f"{GPU}::test_zero_equals_one_gpu[zero3-sft-1]",
        f"{ZRANKS}[zero3-sft]",
    ),
    _plain("sft", "full", "single"): (
        "tests/test_boundaries.py::test_gradient_checkpointing_recomputes_layers_in_every_stage[sft-full]",
    ),
    _plain("sft", "qlora", "single"): (
        f"{DS}::test_two_ranks_equal_one_process[ddp-sft-1-qlora]",
        "tests/test_qlora.py::test_qlora_loss_falls",
    ),
    _plain("sft", "qlora", "ddp"): (f"{DS}::test_two_ranks_equal_one_process[ddp-sft-1-qlora]",),
    _plain("sft", "qlora", "zero2"): (f"{GPU}::test_qlora_trains_under_zero2_and_tracks_one_gpu",),
    _plain("rm", "lora", "single"): ("tests/test_reward.py::test_rm_stage_head_survives_merge_and_stats_recorded",),
    _plain("rm", "lora", "ddp"): (f"{DS}::test_two_ranks_equal_one_process[ddp-rm-1-lora]",),
    _plain("rm", "lora", "fsdp"): (f"{FSDP}::test_two_fsdp_ranks_equal_one_process[rm]",),
    _plain("rm", "lora", "zero2"): (
        f"{GPU}::test_zero_equals_one_gpu[zero2-rm-1]",
        f"{ZRANKS}[zero2-rm]",
    ),
    _plain("rm", "lora", "zero3"): (
        f"{GPU}::test_zero_equals_one_gpu[zero3-rm-1]",
        f"{ZRANKS}[zero3_offload-rm]",
    ),
    _plain("rm", "full", "single"): (
        "tests/test_boundaries.py::test_gradient_checkpointing_recomputes_layers_in_every_stage[rm-full]",
    ),
    _plain("rm", "full", "ddp"): (f"{DS}::test_two_ranks_equal_one_process[ddp-rm-1-full]",),
    _plain("rm", "full", "fsdp"): (
        f"{DS}::test_two_ranks_equal_one_process[fsdp-rm-1-full]",
        f"{DS}::test_fsdp_stopped_and_resumed_continues_exactly[rm-full-resumed-rm-full]",
    ),
    _plain("rm", "qlora", "single"): (f"{CELLS}::test_qlora_trains_the_adapter_of_every_stage[rm]",),
    _plain("dpo", "lora", "single"): (
        "tests/test_dpo.py::test_stage_learns_and_its_reference_is_the_starting_model[lora]",
    ),
    _plain("dpo", "lora", "fsdp"): (f"{FSDP}::test_two_fsdp_ranks_equal_one_process[dpo]",),
    _plain("dpo", "full", "single"): (
        "tests/test_dpo.py::test_stage_learns_and_its_reference_is_the_starting_model[full]",
    ),
    _plain("dpo", "qlora", "single"): (f"{CELLS}::test_qlora_trains_the_adapter_of_every_stage[dpo]",),
    _plain("kto", "lora", "single"): ("tests/test_kto.py::test_lora_stage_learns_from_the_llama_factory_demo",),
    _plain("kto", "full", "single"): ("tests/test_kto.py::test_first_steps_equal_trls_kto_trainer",),
    _plain("kto", "qlora", "single"): (f"{CELLS}::test_qlora_trains_the_adapter_of_every_stage[kto]",),
    _policy("ppo", "lora", "single"): ("tests/test_ppo.py::test_first_step_is_exactly_on_policy",),
    _policy("ppo", "lora", "ddp"): (
        "tests/test_distributed.py::test_ppo_under_ddp_is_on_policy_then_moves",
        f"{DS}::test_two_ranks_equal_one_process[ddp-ppo-1-lora]",
    ),
    _policy("ppo", "lora", "fsdp"): (
        f"{FSDP}::test_two_fsdp_ranks_equal_one_process[ppo]",
        f"{FSDP}::test_two_fsdp_ranks_equal_two_ddp_ranks[ppo-real]",
    ),
    _policy("ppo", "lora", "zero3"): (
        f"{GPU}::test_ppo_under_zero3_equals_one_gpu",
        f"{ZRANKS}[zero3-ppo]",
        f"{ZC}::test_sampling_under_zero3_equals_ddp[zero3-ppo-real]",
        f"{ZC}::test_sampling_under_zero3_equals_ddp[zero3-ppo-lockstep]",
    ),
    _policy("ppo", "full", "single"): ("tests/test_ppo.py::test_reference_and_reward_weights_unchanged[full]",),
    _policy("ppo", "full", "ddp"): (f"{DS}::test_two_ranks_equal_one_process[ddp-ppo-1-full]",),
    _policy("ppo", "full", "fsdp"): (
        f"{FSDP}::test_two_fsdp_ranks_equal_one_process[ppo-full]",
        f"{DS}::test_two_ranks_equal_one_process[fsdp-ppo-1-full]",
    ),
    _policy("ppo", "qlora", "single"): (f"{CELLS}::test_qlora_trains_the_adapter_of_every_stage[ppo]",),
    _policy("ppo", "lora", "single", tools="on"): (
        "tests/test_tool_rollout.py::test_ppo_step_with_tools_masks_inserted_tokens_from_loss_kl_and_values",
    ),
    _policy("grpo", "lora", "single"): (
        "tests/test_grpo.py::test_first_step_on_policy_and_reference_is_the_disabled_adapter",
    ),
    _policy("grpo", "lora", "ddp"): (f"{FSDP}::test_two_fsdp_ranks_equal_two_ddp_ranks[grpo-real]",),
    _policy("grpo", "lora", "fsdp"): (
        f"{FSDP}::test_two_fsdp_ranks_equal_one_process[grpo]",
        f"{FSDP}::test_two_fsdp_ranks_equal_two_ddp_ranks[grpo-real]",
    ),
    _policy("grpo", "lora", "zero3"): (
        f"{ZRANKS}[zero3-grpo]",
        f"{ZRANKS}[zero3_offload-grpo-rm]",
        f"{ZC}::test_sampling_under_zero3_equals_ddp[zero3-grpo-real]",
        f"{ZC}::test_sampling_under_zero3_equals_ddp[zero3-grpo-lockstep]",
    ),
    _policy("grpo", "full", "single"): ("tests/test_grpo.py::test_beta_zero_runs_no_reference_forward[full]",),
    _policy("grpo", "qlora", "single"): (f"{CELLS}::test_qlora_trains_the_adapter_of_every_stage[grpo]",),
    _policy("grpo", "lora", "single", backend="hf"): ("tests/test_grpo.py::test_resume_reproduces_unbroken_run[hf]",),
    _policy("grpo", "lora", "single", tools="on"): (
        "tests/test_tool_rollout.py::test_grpo_step_trains_sampled_tokens_only_and_never_reads_inserted_logprobs",
    ),
    # tests/test_zero_cpu.py: two ZeRO ranks (CPU) equal one process
    _plain("sft", "full", "zero3"): (f"{ZRANKS}[zero3-full]",),
    _plain("sft", "full", "zero2"): (f"{ZRANKS}[zero2-full]",),
    _plain("pt", "lora", "zero3"): (f"{ZRANKS}[zero3-pt]",),
    _plain("pt", "full", "zero2"): (f"{ZRANKS}[zero2-pt-full]",),
    _plain("pt", "full", "zero3"): (f"{ZRANKS}[zero3-pt-full]",),
    _plain("rm", "full", "zero3"): (f"{ZRANKS}[zero3-rm-full]",),
    _plain("rm", "full", "zero2"): (f"{ZRANKS}[zero2_offload-rm-full]",),
    _plain("pt", "lora", "zero2"): (f"{ZRANKS}[zero2-pt]",),
    _plain("dpo", "lora", "zero2"): (f"{ZRANKS}[zero2-dpo]",),
    _plain("dpo", "lora", "zero3"): (f"{ZRANKS}[zero3-dpo]",),
    _plain("dpo", "full", "zero2"): (f"{ZRANKS}[zero2-dpo-full]",),
    _plain("dpo", "full", "zero3"): (f"{ZRANKS}[zero3-dpo-full]",),
    _policy("ppo", "lora", "zero2"): (f"{ZRANKS}[zero2-ppo]",),
    _policy("grpo", "lora", "zero2"): (f"{ZRANKS}[zero2-grpo]",),
    _policy("grpo", "full", "zero3"): (f"{ZRANKS}[zero3-grpo-full]",),
    _policy("ppo", "full", "zero3"): (f"{ZRANKS}[zero3-ppo-full]",),
    _policy("grpo", "full", "zero2"): (f"{ZRANKS}[zero2-grpo-full]",),
    _policy("ppo", "full", "zero2"): (f"{ZRANKS}[zero2-ppo-full]",),
    # tests/test_cells_ddp.py: two ranks equal one process
    _plain("sft", "full", "ddp"): (f"{RANKS}[ddp-sft-full]",),
    _plain("sft", "full", "fsdp"): (f"{RANKS}[fsdp-sft-full]",),
    _plain("pt", "qlora", "ddp"): (f"{RANKS}[ddp-pt-qlora]",),
    **{_plain(stage, "qlora", "zero2"): (f"{RANKS}[zero2-{stage}-qlora]",) for stage in ("pt", "rm", "dpo", "kto")},
    **{_policy(stage, "qlora", "zero2"): (f"{RANKS}[zero2-{stage}-qlora]",) for stage in ("grpo", "ppo")},
    _plain("rm", "qlora", "ddp"): (f"{RANKS}[ddp-rm-qlora]",),
    _plain("dpo", "qlora", "ddp"): (f"{RANKS}[ddp-dpo-qlora]",),
    _plain("kto", "qlora", "ddp"): (f"{RANKS}[ddp-kto-qlora]",),
    _policy("grpo", "qlora", "ddp"): (f"{RANKS}[ddp-grpo-qlora]",),
    _policy("ppo", "qlora", "ddp"): (f"{RANKS}[ddp-ppo-qlora]",),
    _plain("dpo", "lora", "ddp"): (f"{RANKS}[ddp-dpo-lora]",),
    _plain("dpo", "full", "ddp"): (f"{RANKS}[ddp-dpo-full]",),
    _plain("dpo", "full", "fsdp"): (f"{RANKS}[fsdp-dpo-full]",),
    **{
        _plain("kto", adapter, engine): (f"{RANKS}[{engine}-kto-{adapter}]",)
        for adapter in ("lora", "full")
        for engine in ("ddp", "fsdp", "zero2", "zero3")
    },
    _policy("grpo", "full", "ddp"): (f"{RANKS}[ddp-grpo-full]",),
    _policy("grpo", "full", "fsdp"): (f"{RANKS}[fsdp-grpo-full]",),
    **{
        _policy(stage, "lora", engine, tools="on"): (f"{RANKS}[{engine}-{stage}-tools]",)
        for stage in ("ppo", "grpo")
        for engine in ("ddp", "fsdp", "zero2", "zero3")
    },
    **{
        _policy(stage, adapter, engine, tools="on"): (f"{RANKS}[{engine}-{stage}-tools-{adapter}]",)
        for stage in ("ppo", "grpo")
        for adapter, engines in (("full", ("ddp", "fsdp", "zero2", "zero3")), ("qlora", ("ddp", "zero2")))
        for engine in engines
    },
    **{
        _policy(stage, adapter, engine, backend="hf", tools=tools): (
            f"tests/test_cells_ddp.py::test_the_hf_backend_on_two_ranks_samples_as_relay[{engine}-{stage}-{adapter}-{tools}]",
        )
        for stage in ("ppo", "grpo")
        for engine, adapter, tools in HF_ON_RANKS
    },
    _distill("lora", "single"): (f"{DISTILL}[lora]",),
    _distill("full", "single"): (f"{DISTILL}[full]",),
    **{
        _distill(adapter, engine): (f"{RANKS}[{engine}-distill-{adapter}]",)
        for adapter in ("lora", "full")
        for engine in ("ddp", "fsdp", "zero2", "zero3")
    },
    **{_distill("qlora", engine): (f"{RANKS}[{engine}-distill-qlora]",) for engine in ("ddp", "zero2")},
    **{
        _distill(adapter, engine, "hf"): (
            f"tests/test_cells_ddp.py::test_the_hf_backend_on_two_ranks_samples_as_relay[{engine}-distill-{adapter}-off]",
        )
        for engine, adapter in HF_DISTILL_ON_RANKS
    },
}
# tests/test_vllm.py: one process on a vLLM server, LoRA and full weights, tools off and on, every correction
for (_stage, _tools), _node in VLLM_TESTS.items():
    for _adapter, _correction in itertools.product(("lora", "full"), ("auto", "none", "mis")):
        _cell = _policy(_stage, _adapter, "single", "vllm", _tools, "tis" if _correction == "auto" else _correction)
        _resumed = (_stage, _tools, _adapter, _correction) == ("grpo", "off", "lora", "auto")
        TESTS[_cell] = (VLLM_RESUMED,) if _resumed else (f"{_node}[{_adapter}-{_correction}]",)
for _adapter in ADAPTERS:
    TESTS[_distill(_adapter, "single", "vllm")] = (f"{VLLM}::test_distill_samples_the_student_on_vllm[{_adapter}]",)
# the student sampling itself under ZeRO-3 in lockstep (generation.zero3_gather false) as under DDP
TESTS[_distill("lora", "zero3")] += (
    "tests/test_cells_ddp.py::test_distill_samples_under_zero3_in_lockstep_as_under_ddp",
)
for _stage, _correction in itertools.product(("ppo", "grpo"), ("auto", "none", "mis")):
    _name = "tis" if _correction == "auto" else _correction
    TESTS[_policy(_stage, "qlora", "single", "vllm", "off", _name)] = (f"{VLLM_QLORA}[{_stage}-{_correction}]",)
    TESTS[_policy(_stage, "qlora", "single", "vllm", "on", _name)] = (
        f"{VLLM_TESTS[_stage, 'on']}[qlora-{_correction}]",
    )
# tests/test_cells.py: one process, the hf backend draws what the relay backend draws, every adapter, tools off and on
for _stage, _adapter, _tools, _backend in itertools.product(("ppo", "grpo"), ADAPTERS, TOOLS, ("relay", "hf")):
    _cell = _policy(_stage, _adapter, "single", backend=_backend, tools=_tools)
    TESTS[_cell] = TESTS.get(_cell, ()) + (
        f"{CELLS}::test_the_hf_backend_samples_as_relay_in_the_stage[{_stage}-{_adapter}-{_tools}]",
    )
for _adapter, _backend in itertools.product(ADAPTERS, ("relay", "hf")):
    _cell = _distill(_adapter, "single", _backend)
    TESTS[_cell] = TESTS.get(_cell, ()) + (
        f"{CELLS}::test_the_hf_backend_samples_as_relay_in_the_stage[distill-{_adapter}]",
    )

JUDGE = "tests/test_judge.py"
JUDGED = "tests/test_cells_ddp.py::test_a_judge_on_two_ranks_asks_what_one_process_asks"
JUDGE_TESTS: dict[tuple[str, str, str], tuple[str, ...]] = {
    ("ppo", "off", "single"): (f"{JUDGE}::test_ppo_sums_the_judge_with_the_reward_model_and_resumes",),
    ("ppo", "on", "single"): (f"{JUDGE}::test_tool_rollouts_are_judged_by_their_final_answer[ppo]",),
    ("grpo", "off", "single"): (f"{JUDGE}::test_grpo_two_steps_with_judge_and_rule_reward_and_resume",),
    ("grpo", "on", "single"): (f"{JUDGE}::test_tool_rollouts_are_judged_by_their_final_answer[grpo]",),
    **{
        (stage, tools, engine): (f"{RANKS}[{engine}-{run}]", f"{JUDGED}[{engine}-{run}]")
        for stage, tools, engine, run in (
            ("grpo", "off", "ddp", "grpo-full"),
            ("grpo", "off", "fsdp", "grpo-full"),
            ("grpo", "on", "ddp", "grpo-tools"),
            ("grpo", "on", "fsdp", "grpo-tools"),
            ("ppo", "off", "ddp", "ppo-judge"),
            ("ppo", "on", "ddp", "ppo-tools"),
            ("ppo", "on", "fsdp", "ppo-tools"),
            ("grpo", "on", "zero2", "grpo-tools"),
            ("grpo", "on", "zero3", "grpo-tools"),
            ("ppo", "on", "zero2", "ppo-tools"),
            ("ppo", "on", "zero3", "ppo-tools"),
        )
    },
    ("grpo", "off", "zero3"): (
        f"{ZC}::test_sampling_under_zero3_equals_ddp[zero3-grpo-real]",
        f"{ZC}::test_sampling_under_zero3_equals_ddp[zero3-grpo-lockstep]",
    ),
}
"""The LLM judge reward (a stage config's `judge:` section, pipeline/algorithms/judge.py) by stage x
tools x engine: it reads decoded answers, so the backend, adapter and correction do not change what
it does. A config with a judge runs where its cell runs and this table names tests; elsewhere it is
refused in one line (`judge_refusal`)."""


def judge_cells() -> Iterator[tuple[str, str, str]]:
    """Every (stage, tools, engine) of the judge's table: the stages with a `judge:` section."""
    stages = dict.fromkeys(stage for stage, _, _ in JUDGE_TESTS)
    yield from itertools.product(stages, TOOLS, ENGINES)


def judge_refusal(stage: str, tools: str, engine: str) -> Optional[str]:
    """None where the judge reward runs in (stage, tools, engine), else the one line why not."""
    if (stage, tools, engine) in JUDGE_TESTS:
        return None
    return (
        f"judge.base_url: a judge reward in {stage} with tools {tools} under {ENGINES[engine].label} is not run by "
        f"Relay's test suite yet; run it {judged_engines(stage, tools)}"
    )


def judged_engines(stage: str, tools: str) -> str:
    """Where the judge runs in (stage, tools), as a user reads it: 'in one process or under DDP'."""
    engines = [e for s, t, e in JUDGE_TESTS if (s, t) == (stage, tools)]
    return " or ".join("in one process" if e == "single" else f"under {ENGINES[e].label}" for e in engines)


GRPO_OPTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "loss_type": {
        name: (f"tests/test_grpo_variants.py::test_micro_batch_shares_equal_trl_accumulation[{name}]",)
        for name in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
    },
    "advantage_estimator": {
        "grpo": ("tests/test_grpo.py::test_group_advantages_match_trl",),
        **{
            name: (f"tests/test_grpo_variants.py::test_estimators_equal_verl[{name}]",)
            for name in ("rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
        },
    },
}
"""The `grpo:` options that are pure functions on the rollout's tensors: each runs in every
supported GRPO cell (tests/test_grpo_variants.py::test_variants_run_in_the_stage runs them in the
stage), its golden test against the peer named here. Keys equal the registries' (grpo_losses.LOSS_TYPES,
advantages.ESTIMATORS; tests/test_capabilities.py checks)."""


# ------------------------------------------------------------------------------------------
# The refusals: (config key to blame, why) for a cell, None where the rule does not apply
# ------------------------------------------------------------------------------------------

Rule = Callable[[Cell, bool], Optional[tuple[str, str]]]


def _correction_without_engine_logprobs(cell: Cell, cuda: bool):
    if cell.correction != NONE and CORRECTIONS[cell.correction].weighs and not BACKENDS[cell.backend].engine_logprobs:
        return (
            "generation.correction",
            f"{cell.correction} weighs each token by p_trainer / p_engine and the {cell.backend} "
            "backend reports no engine log-probs (it samples the distribution the trainer scores); use none or auto",
        )
    return None


def _server_on_shards(cell: Cell, cuda: bool):
    if cell.backend != NONE and BACKENDS[cell.backend].own_server and ENGINES[cell.engine].shards:
        return (
            "generation.backend",
            f"{cell.backend} syncs weights from one whole policy; distributed.engine "
            f"{ENGINES[cell.engine].config!r} is not supported with it yet (use ddp)",
        )
    return None


def _server_per_rank(cell: Cell, cuda: bool):
    if cell.backend != NONE and BACKENDS[cell.backend].own_server and ENGINES[cell.engine].ranks == "many":
        return (
            "generation.backend",
            f"{cell.backend} with more than one rank is refused until per-rank servers are pinned "
            "to their device (every rank would start its own server on device 0, writing the same adapter folder and "
            "log); run one process, or use backend relay",
        )
    return None


def _tools_in_lockstep(cell: Cell, cuda: bool):
    """With the defaults a cell stands for (`generation.zero3_gather` true); a config that samples in
    lockstep is refused by its own check (pipeline/config/policy.py `sampling_engine_problems`)."""
    column = ENGINES[cell.engine]
    why = engine_facts.tools_refusal(column.config, column.zero_stage, gathers=True) if cell.tools == "on" else None
    return ("tools.funcs", why) if why else None


def _qlora_where_it_cannot_load(cell: Cell, cuda: bool):
    why = ENGINES[cell.engine].no_qlora if cell.adapter == "qlora" else ""
    key, _, line = why.partition(": ")
    return (key, line) if why else None


def _zero_without_cuda(cell: Cell, cuda: bool):
    if ENGINES[cell.engine].zero and not cuda and not ZERO_ON_CPU:
        return (
            "distributed.engine",
            f"{ENGINES[cell.engine].label} (deepspeed) runs on a CUDA GPU only for now "
            "(none is visible); on CPU use distributed.engine ddp or fsdp",
        )
    return None


RULES: tuple[Rule, ...] = (
    _correction_without_engine_logprobs,
    _server_on_shards,
    _server_per_rank,
    _tools_in_lockstep,
    _qlora_where_it_cannot_load,
)
"""Refusals on any machine, first match wins."""
DEVICE_RULES: tuple[Rule, ...] = (_zero_without_cuda,)
"""Refusals on a machine without CUDA, after RULES."""


def refusal(cell: Cell, cuda: bool = True) -> Optional[str]:
    """Whether Relay runs `cell` (on a machine with CUDA or without): None, or the one line why not,
    "config.key: reason" (what `relay validate` prints).

    Raises:
        KeyError: a value no axis has.
    """
    for rule in RULES + (() if cuda else DEVICE_RULES):
        found = rule(cell, cuda)
        if found:
            return f"{found[0]}: {found[1]}"
    if cell not in TESTS:
        return (
            f"combination {cell.describe()}: not run by Relay's test suite yet, so refused "
            "(`relay capabilities` lists every combination that is)"
        )
    return None


# ------------------------------------------------------------------------------------------
# A config's cell
# ------------------------------------------------------------------------------------------


def world_size() -> int:
    """Ranks of this run (torchrun's WORLD_SIZE; 1 outside it)."""
    text = os.environ.get("WORLD_SIZE", "1")
    return int(text) if text.isdigit() and int(text) > 0 else 1


def config_cell(stage: str, cfg: Any, ranks: Optional[int] = None) -> tuple[Optional[Cell], Optional[str]]:
    """(the cell a stage config runs in with `ranks` processes (default: this run's), or None
    with the one line why it has none (a ZeRO stage without a cell)). Values the config's own checks
    refuse (an unknown engine, a missing DeepSpeed file) give (None, None)."""
    from stages import STAGES

    ranks = world_size() if ranks is None else ranks
    dist, model = cfg.distributed, cfg.model
    kinds = {name: e for name, e in ENGINES.items() if e.config == dist.engine}
    zero = None
    if any(e.zero for e in kinds.values()):
        zero = zero_stage(dist.deepspeed_config)
        if zero is None:
            return None, None
    fits = [
        name
        for name, e in kinds.items()
        if e.zero_stage == zero and e.ranks in ("any", "one" if ranks == 1 else "many")
    ]
    if not fits:
        if zero is None:  # an engine the config's own check refuses
            return None, None
        stages = ", ".join(str(e.zero_stage) for e in ENGINES.values() if e.zero)
        return None, (
            f"distributed.deepspeed_config: ZeRO stage {zero} is not run by Relay's test suite (stages {stages} are)"
        )
    engine = fits[0]
    if model.finetuning not in ADAPTERS:
        return None, None
    if not STAGES[stage].samples:
        return Cell(stage, adapter=model.finetuning, engine=engine), None
    gen = cfg.generation
    if gen.backend not in BACKENDS:
        return None, None
    correction = gen.correction
    if not STAGES[stage].corrects:
        if correction in CORRECTIONS and CORRECTIONS[correction].weighs:
            return None, (
                f"generation.correction: {correction} weighs a policy loss's tokens by p_trainer / p_engine and "
                f"{stage}'s loss has no per-token weight, so it would not be applied; leave it at auto or set none"
            )
        correction = NONE
    elif correction not in CORRECTIONS:  # auto, or a value its own check refuses: the backend's default
        correction = BACKENDS[gen.backend].default_correction
    tools = NONE if not STAGES[stage].tools else "on" if cfg.tools.funcs else "off"
    return Cell(stage, gen.backend, tools, model.finetuning, engine, correction), None


def cuda_visible() -> bool:
    """Whether a CUDA GPU is visible, asked of torch only where torch is already imported (a stage);
    the CLI, which must not pay for torch, counts CUDA_VISIBLE_DEVICES / nvidia device files."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible.strip() not in ("", "-1")
    return Path("/dev/nvidia0").exists()


def config_refusals(stage: str, cfg: Any, ranks: Optional[int] = None, cuda: Optional[bool] = None) -> list[str]:
    """The one line refusing the combination `cfg` runs (with `ranks` processes), or []."""
    from stages import STAGES

    if stage not in STAGES:
        return []
    cell, problem = config_cell(stage, cfg, ranks)
    if problem:
        return [problem]
    if cell is None:
        return []
    line = refusal(cell, cuda_visible() if cuda is None else cuda)
    judge = getattr(cfg, "judge", None)
    if line is None and cell.tools != NONE and getattr(judge, "base_url", None):
        line = judge_refusal(cell.stage, cell.tools, cell.engine)
        return [line] if line else judge.rank_problems(world_size() if ranks is None else ranks)
    return [line] if line else []
