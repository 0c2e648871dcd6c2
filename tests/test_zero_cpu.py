"""DeepSpeed ZeRO on CPU: two torchrun ranks over gloo (DeepSpeed's CPU accelerator) train as one
process does, under ZeRO-2 and ZeRO-3, with and without the optimizer offloaded to the CPU (on a CPU
the offloaded step is Relay's torch AdamW, `zero_force_ds_cpu_optimizer` false: DeepSpeedCPUAdam
would be compiled on first use, minutes on a 2-core machine; on a GPU it is DeepSpeed's): LoRA PT,
SFT, RM, PPO (ActorCritic has no `config`: the "auto" ZeRO sizes come from the policy's), GRPO and
DPO (GRPO also with a reward model), full-weight PT, SFT, RM, DPO, PPO and GRPO (under ZeRO-3 their
frozen references, and GRPO's reward model, are partitioned too); GRPO and PPO sampling with the
policy itself (GRPO with an LLM judge among its rewards, tests/judgestub.py) under ZeRO-3, the
policy gathered for each rollout or not (`generation.zero3_gather`), equals DDP's. Per step:
the loss and grad_norm (every rank logs the same); the exported adapter, merged model and checkpoint
equal the one-process ones, whole: ZeRO-3 partitions every parameter above
stage3_param_persistence_threshold (10 x hidden size = 640 elements for the tiny model), so the LoRA
runs use r 16 (16 x 64 = 1024 elements) and a saved partition would be an empty tensor. QLoRA under
ZeRO-3 is refused up front.

Two launches (tests/distrun.py runs many stages in one interpreter): one plain process with the
references, and two ranks running every ZeRO run. Tolerances are the DDP tests'
(tests/test_distributed_stages.py); the per-step figures differ by ~1e-7.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from forkserver import python_for_tests
from judgestub import judge_flags, judge_stub  # noqa: F401  (a fixture)
from safetensors.torch import load_file
from test_distributed_stages import (
    ABS,
    LOSS_KEYS,
    REL,
    STEPS,
    WEIGHTS_ABS,
    history,
    launch,
    merged_weights,
    stage_argv,
    write_data,
)
from test_fsdp import KEYS as FSDP_KEYS
from test_fsdp import argv as fsdp_argv
from test_fsdp import with_values
from tinymodels import make_eos_prone, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "deepspeed_configs"
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="ZeRO on CPU ranks (gloo); on CUDA: tests/test_distributed_gpu.py"
)
PERSISTENCE = 10 * 64
"""accelerate's "auto" stage3_param_persistence_threshold for the tiny model (hidden size 64)."""
REFERENCES = {
    "sft": ("sft", "lora"),
    "rm": ("rm", "lora"),
    "full": ("sft", "full"),
    "ppo": ("ppo", "lora"),
    "grpo": ("grpo", "lora"),
    "dpo": ("dpo", "lora"),
    "pt": ("pt", "lora"),
    "pt-full": ("pt", "full"),
    "rm-full": ("rm", "full"),
    "dpo-full": ("dpo", "full"),
    "grpo-full": ("grpo", "full"),
    "ppo-full": ("ppo", "full"),
    "grpo-rm": ("grpo", "lora"),
    "full-noclip": ("sft", "full"),
}
"""The one-process runs: name -> (stage, model.finetuning); '-noclip': train.max_grad_norm 0 (the
tiny model's full gradient norm is about 4, so clipping at 1 would part the runs)."""
ZERO = {
    "zero2-rm": "rm",
    "zero2_offload-sft": "sft",
    "zero3-sft": "sft",
    "zero3_offload-rm": "rm",
    "zero3-full": "full",
    "zero3-ppo": "ppo",
    "zero2-ppo": "ppo",
    "zero3-grpo": "grpo",
    "zero2-grpo": "grpo",
    "zero3-dpo": "dpo",
    "zero2-dpo": "dpo",
    "zero3-pt": "pt",
    "zero2-pt-full": "pt-full",
    "zero3-pt-full": "pt-full",
    "zero2-full": "full",
    "zero3-rm-full": "rm-full",
    "zero2-pt": "pt",
    "zero2_offload-rm-full": "rm-full",
    "zero2-dpo-full": "dpo-full",
    "zero3-dpo-full": "dpo-full",
    "zero3-grpo-full": "grpo-full",
    "zero2-grpo-full": "grpo-full",
    "zero3-ppo-full": "ppo-full",
    "zero2-ppo-full": "ppo-full",
    "zero3_offload-grpo-rm": "grpo-rm",
    "zero2-full-noclip": "full-noclip",
}
"""The two-rank runs: '<DeepSpeed config>-<reference>'."""
KEYS = {**LOSS_KEYS, "grpo": FSDP_KEYS["grpo"], "dpo": FSDP_KEYS["dpo"]}
SAMPLED = {
    "zero3-grpo-real": ("grpo", "zero3", ()),
    "zero3-grpo-lockstep": ("grpo", "zero3", ("--generation.zero3_gather", "false")),
    "ddp-grpo-real": ("grpo", None, ()),
    "zero3-ppo-real": ("ppo", "zero3", ()),
    "zero3-ppo-lockstep": ("ppo", "zero3", ("--generation.zero3_gather", "false")),
    "ddp-ppo-real": ("ppo", None, ()),
}
"""GRPO's and PPO's sampling with the policy itself on the two ranks (not scripted; PPO scored by
tests/distrun.py's scripted reward), a policy that ends its completions often (tests/tinymodels.py
`make_eos_prone`), so the ranks finish sampling at different steps: under ZeRO-3 the policy's
partitions are gathered once per rollout and Relay's decode engine samples on each rank alone, as
under DDP; with generation.zero3_gather false every rank's forwards gather the partitioned weights,
so a rank that is done keeps stepping until all are (`synced_gpus`, the hf sampler; PPO's policy is
a module of its actor-critic, whose other parts stay partitioned). The same prompts and RNG streams
give the same completions and figures: name -> (stage, DeepSpeed config or None for DDP, flags)."""
SAMPLERS = {
    "zero3-grpo-real": "RelayGenerator",
    "zero3-grpo-lockstep": "HFGenerator",
    "zero3-ppo-real": "RelayGenerator",
    "zero3-ppo-lockstep": "HFGenerator",
}
"""The ZeRO-3 sampled runs -> the sampler each ran (DDP's: RelayGenerator)."""
LENGTH = {"grpo": "grpo/completion_length", "ppo": "ppo/response_length"}
"""Each sampled stage's mean completion length."""
JUDGED = ("grpo/reward/judge", "judge/requests", "judge/cache_hits", "judge/failures")
"""The LLM judge's figures (the sampled runs score with a stub judge too, tests/judgestub.py): every
rank's requests, summed."""
TRAINED_ABS = 3e-4
"""The trained tensors themselves (checkpoint, adapter), max |difference|: Adam divides each
gradient by its own RMS, so the two runs' reduction-order noise on near-zero gradients becomes a
few % of one step (lr 5e-3), as for full fine-tuning's weights (WEIGHTS_ABS); the measured spread
is in bench/RESULTS.md (the largest: ZeRO-3 with the optimizer offloaded, RM's score head).
The merged LoRA weights hold the product of two such tensors, within WEIGHTS_ABS['lora']."""
SAMPLED_MERGED_ABS = 5e-5
"""The sampled GRPO runs' merged LoRA weights, max |difference|. They train at GRPO's learning rate
(1e-2, tests/test_fsdp.py), where Adam's step moves each B entry by about the learning rate whatever
its gradient's size: the two engines' reduction-order noise on B's near-zero gradients reaches the
merged weights just above WEIGHTS_ABS['lora'] on some CPUs (bench/RESULTS.md; the adapters
themselves agree within TRAINED_ABS). A lost or stale update parts them by the step's own size,
lr * |A| * r, orders of magnitude above it."""


def argv(name: str, world: int, out: Path, setup) -> list[str]:
    root, data, model, reward = setup
    stage, mode = REFERENCES[name]
    if stage in ("grpo", "dpo"):  # tests/test_fsdp.py's: DPO on the RM's pairs, GRPO on PPO's prompts
        args = with_values(fsdp_argv(stage, world, out, data, model, reward), lora__r="16", model__finetuning=mode)
        return with_values(args, reward_model__path=str(reward)) if name.endswith("-rm") else args
    per_rank = (8 if stage == "ppo" else 4) // world
    # RM starts from a reward model: a fresh head's initial draw is not the same under zero.Init.
    args = stage_argv(stage, 1, per_rank, out, data, reward if stage == "rm" else model, reward)
    args[args.index("--lora.r") + 1] = "16"
    if name == "sft":  # held-out evaluation every step: forwards without a backward before each save
        args = with_values(args, train__eval_steps="1")
    if name.endswith("-noclip"):  # 0 disables clipping; accelerate's plugin read it as unset and clipped at 1
        args = with_values(args, train__max_grad_norm="0")
    return args + ["--model.finetuning", mode]


def deepspeed(config: str) -> list[str]:
    return ["--distributed.engine", "deepspeed", "--distributed.deepspeed_config", str(CONFIGS / f"{config}.json")]


@pytest.fixture(scope="module")
def setup(module_folder, tiny_model_dir, tiny_reward_dir):
    root = module_folder
    return root, write_data(root / "data"), tiny_model_dir, tiny_reward_dir


@pytest.fixture(scope="module")
def eos_prone(module_folder):
    """An untied tiny policy that ends a completion at each token with probability one half (T 1, the stage's)."""
    from transformers import AutoTokenizer

    untied = make_tiny_model(module_folder / "untied", seed=0, tie_word_embeddings=False)
    tok = AutoTokenizer.from_pretrained(untied)
    chats = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(4)]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    return make_eos_prone(untied, module_folder / "eos-prone", prompts, temperature=1.0, share=0.5)


@pytest.fixture(scope="module")
def launches(setup, eos_prone, judge_stub):  # noqa: F811  (the fixture imported from judgestub)
    root = setup[0]
    refs = [{"stage": REFERENCES[n][0], "argv": argv(n, 1, root / "one" / n, setup)} for n in REFERENCES]
    launch(refs, root / "one", 1)
    held_out = root / "data" / "prompts_eval.jsonl"  # 5 prompts: one rank samples a padding batch
    held_out.write_text("".join(setup[1]["ppo"].read_text().splitlines(keepends=True)[-5:]))
    runs = []
    for name, ref in ZERO.items():
        flags = deepspeed(name.split("-")[0])
        runs.append({"stage": REFERENCES[ref][0], "argv": argv(ref, 2, root / "zero" / name, setup) + flags})
    for name, (stage, config, options) in SAMPLED.items():
        flags = [*(deepspeed(config) if config else ["--distributed.engine", "ddp"]), *options]
        args = with_values(argv(stage, 2, root / "zero" / name, setup), model__path=str(eos_prone))
        if stage == "grpo":  # held-out prompts and a judge too
            args = with_values(args, data__eval=f"[{held_out}]", train__eval_steps="2")
            flags += judge_flags(judge_stub.url, 2)
        runs.append({"stage": stage, "sampler": "real", "argv": args + flags})
    launch(runs, root / "zero", 2, torchrun=True)
    return root


def test_the_ranks_build_no_deepspeed_extension(launches):
    """DeepSpeed on a CPU compiles its shared-memory all-reduce at its process group's start in
    every new environment (bench/RESULTS.md has its cost); Relay keeps its collectives on gloo."""
    log = (launches / "zero" / "launch.log").read_text()
    assert "deepspeed_shm_comm" not in log, [line for line in log.splitlines() if "shm" in line]


def tensors(folder: Path, pattern: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob(pattern)):
        out.update(load_file(str(file)))
    return out


def assert_whole_and_equal(got: dict, want: dict, tol: float) -> None:
    assert got and got.keys() == want.keys()
    assert all(got[k].numel() > 0 and got[k].shape == want[k].shape for k in got), (
        "a saved tensor is a ZeRO-3 partition"
    )
    assert max(float((got[k].float() - want[k].float()).abs().max()) for k in got) < tol


@pytest.mark.parametrize("name", list(ZERO))
def test_two_zero_ranks_equal_one_process(name, launches):
    ref = ZERO[name]
    stage, mode = REFERENCES[ref]
    got_dir, want_dir = launches / "zero" / name, launches / "one" / ref
    got, want = history(got_dir), history(want_dir)
    assert len(got) == len(want) == STEPS
    for key in KEYS[stage]:
        assert [s[key] for s in got] == pytest.approx([s[key] for s in want], rel=REL, abs=ABS), key
    assert [s["train/grad_norm"] for s in history(got_dir, 1)] == [s["train/grad_norm"] for s in got]
    assert max(s["train/grad_norm"] for s in got) > 0.05  # clipping was active
    if ref.endswith("-noclip"):
        assert max(s["train/grad_norm"] for s in want) > 1  # clipping at 1 would have changed the steps
    evals = [json.loads((d / "history-rank0.json").read_text())["evals"] for d in (got_dir, want_dir)]
    assert len(evals[0]) == len(evals[1]) and (ref != "sft" or len(evals[0]) >= STEPS)  # LoRA SFT: every step
    for mine, reference in zip(*evals):
        assert mine == pytest.approx(reference, rel=REL, abs=ABS)
    # The RM's merged score head is itself a trained tensor (modules_to_save), not a LoRA product.
    assert_whole_and_equal(
        merged_weights(got_dir), merged_weights(want_dir), TRAINED_ABS if stage == "rm" else WEIGHTS_ABS[mode]
    )
    # The checkpoint's trainable weights (gathered from every rank's partitions).
    assert_whole_and_equal(
        tensors(got_dir / "checkpoints", "*/model.safetensors"),
        tensors(want_dir / "checkpoints", "*/model.safetensors"),
        TRAINED_ABS,
    )
    if mode == "lora":
        assert_whole_and_equal(
            tensors(got_dir / "adapter", "*.safetensors"), tensors(want_dir / "adapter", "*.safetensors"), TRAINED_ABS
        )


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_sampling_under_zero3_equals_ddp(name, launches, judge_stub):  # noqa: F811  (the fixture imported from judgestub)
    """The policy samples its own completions on two ranks, ending them at different lengths:
    under ZeRO-3, with the policy gathered for each rollout (Relay's decode engine on each rank
    alone) or without (generation.zero3_gather false: each rank's forwards gather the partitioned
    weights and the hf sampler steps every rank until all are done), the completions, rewards,
    updates and merged weights are DDP's (Relay's decode engine), for GRPO and PPO. Stale or
    partitioned weights in the sampler would part the completions; hooks left off after it, the
    updates."""
    stage = SAMPLED[name][0]
    got_dir, want_dir = launches / "zero" / name, launches / "zero" / f"ddp-{stage}-real"
    got, want = history(got_dir), history(want_dir)
    assert len(got) == len(want) == STEPS
    length = LENGTH[stage]
    assert [s[length] for s in got] == [s[length] for s in want]
    assert got[0][length] < 3  # the first step's completions ended early, at different lengths
    samplers = [json.loads((d / "history-rank0.json").read_text())["sampler"] for d in (got_dir, want_dir)]
    assert samplers == [SAMPLERS[name], "RelayGenerator"]
    for key in KEYS[stage] + (JUDGED if stage == "grpo" else ()):
        assert [s[key] for s in got] == pytest.approx([s[key] for s in want], rel=REL, abs=ABS), key
    if stage == "grpo":
        # the held-out prompts (5 on two ranks: one samples a padding batch), at steps 0 and 2
        evals = [json.loads((d / "history-rank0.json").read_text())["evals"] for d in (got_dir, want_dir)]
        assert [e["step"] for e in evals[0]] == [0, 2] and len(evals[0]) == len(evals[1])
        for mine, reference in zip(*evals):
            assert mine == pytest.approx(reference, rel=REL, abs=ABS)
        assert sum(s["judge/requests"] for s in want) > 0 and judge_stub.max_in_flight <= 2
    assert_whole_and_equal(
        tensors(got_dir / "adapter", "*.safetensors"), tensors(want_dir / "adapter", "*.safetensors"), TRAINED_ABS
    )
    assert_whole_and_equal(merged_weights(got_dir), merged_weights(want_dir), SAMPLED_MERGED_ABS)


def test_the_lora_runs_save_tensors_zero3_partitions(launches):
    """Negative control for the exports above: the adapters hold tensors over the persistence
    threshold, which ZeRO-3 partitions, so a save without the gather would hold empty ones."""
    adapter = tensors(launches / "zero" / "zero3-sft" / "adapter", "*.safetensors")
    assert max(t.numel() for t in adapter.values()) > PERSISTENCE


def test_qlora_under_zero3_is_refused_up_front(tiny_model_dir, tmp_path):
    """One line, with the other config problems, before the tokenizer or any model loads:
    transformers refuses the device_map that places bitsandbytes' 4-bit weights under zero.Init."""
    from pipeline.config import ConfigError, load_config
    from stages.sft import SFTStage

    argv_ = [
        "--model.path",
        str(tiny_model_dir),
        "--output_dir",
        str(tmp_path / "out"),
        "--model.finetuning",
        "qlora",
        "--distributed.engine",
        "deepspeed",
        "--distributed.deepspeed_config",
        str(CONFIGS / "zero3.json"),
    ]
    stage = SFTStage(load_config(SFTStage.config_class, argv_))
    with pytest.raises(ConfigError) as err:
        stage.validate()
    lines = [
        p for p in err.value.problems if p.startswith("model.finetuning: qlora cannot load under DeepSpeed ZeRO-3")
    ]
    assert len(lines) == 1 and "zero2" in lines[0], err.value.problems
    assert stage.tokenizer is None
    ok = SFTStage(load_config(SFTStage.config_class, argv_[:-1] + [str(CONFIGS / "zero2.json")]))
    assert not any(p.startswith("model.finetuning: qlora") for p in _problems(ok))


def _problems(stage) -> list[str]:
    from pipeline.config import ConfigError

    try:
        stage.validate()
    except ConfigError as err:
        return err.problems
    return []


def test_sampling_weights_gathers_the_policy_once_and_puts_the_hooks_back(tiny_model_dir):
    """`sampling_weights` on one CPU rank of a ZeRO-3 engine (tests/zero3_sampling.py): inside it the
    policy is whole, DeepSpeed's hooks are off and its logits are the unpartitioned model's; after it,
    after an error in the body too, the hooks are back, the weights partitioned again and a hooked
    forward still equal; neither settling nor a rollout runs a garbage collection (DeepSpeed's engine
    call does, at every checkpoint, export and rollout)."""
    done = subprocess.run(
        [
            python_for_tests(),
            str(ROOT / "tests" / "zero3_sampling.py"),
            str(tiny_model_dir),
            str(CONFIGS / "zero3.json"),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result == {
        "partitioned_before": True,
        "hooks_before": True,
        "whole": True,
        "hooks_off": True,
        "gathered_logits_diff": 0.0,
        "hooks_back": True,
        "partitioned_again": True,
        "hooks_back_after_error": True,
        "hooked_logits_diff": 0.0,
        "gc_passes": 0,
    }


class _Holder(torch.nn.Module):
    """ActorCritic's shape: the policy inside, no `config` of its own."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy


def test_zero3_auto_sizes_are_filled_from_the_policy_inside(tiny_model_dir):
    """accelerate fills these three "auto" values from `model.config.hidden_size` and raises for
    a model without a `config` (PPO's and GRPO's ActorCritic); they come from the policy's."""
    from transformers import AutoModelForCausalLM

    from pipeline.engine.accelerator import fill_hidden_size_autos

    config = json.loads((CONFIGS / "zero3.json").read_text())
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))
    holder = _Holder(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert not hasattr(holder, "config")
    fill_hidden_size_autos(accelerator, holder)
    zero = config["zero_optimization"]
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_prefetch_bucket_size"],
        zero["stage3_param_persistence_threshold"],
    ) == (4096, 3686, 640)


def test_the_pad_check_reads_a_partitioned_embedding_whole(tiny_model_dir):
    """Under zero.Init the embedding weight is this rank's (empty) partition: the pad check reads
    `ds_shape`, and does not resize an embedding that already has a row per token (it resized
    Qwen's 151936 rows to the tokenizer's 151665, and drew random numbers doing so)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.modeling import models

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    weight = model.get_input_embeddings().weight
    weight.ds_shape = tuple(weight.shape)
    weight.data = torch.empty(0)

    def refuse(*args, **kwargs):
        raise AssertionError("resized a partitioned embedding")

    model.resize_token_embeddings = refuse
    models._set_pad(model, tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_a_deepspeed_json_that_cannot_configure_a_run_is_one_line_each(tmp_path):
    """accelerate and DeepSpeed read the JSON on every rank, and raised there (a JSONDecodeError, an
    AttributeError for an array, int('three') in the config check itself); and a gradient_clipping
    in the file silently replaced train.max_grad_norm. Each is one line among the config's problems."""
    from pipeline.config.engines import deepspeed_json_problems, zero_stage

    key = "distributed.deepspeed_config"
    cases = {
        '{"zero_optimization": {"stage": 3}': ":1: not JSON (Expecting ',' delimiter)",
        "[1, 2]": ": the top level must be a JSON object, got list",
        '{"zero_optimization": {"stage": "three"}}': ": zero_optimization.stage must be 0, 1, 2 or 3, got 'three'",
        '{"gradient_clipping": 5.0}': ": gradient_clipping 5.0 contradicts train.max_grad_norm 1.0 (which sets it; "
        'write "auto" or leave it out)',
    }
    for i, (text, problem) in enumerate(cases.items()):
        path = tmp_path / f"ds{i}.json"
        path.write_text(text)
        assert deepspeed_json_problems(str(path), key, 1.0) == [f"{key}: {path}{problem}"]
        assert zero_stage(str(path)) in (None, 0)
    for name in ("zero2.json", "zero3_offload.json"):
        assert deepspeed_json_problems(str(CONFIGS / name), key, 0.0) == []
