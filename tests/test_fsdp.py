"""FSDP2 on CPU: two torchrun ranks over gloo shard the model (pipeline/engine/fsdp.py) and train
every stage as one process does, as two DDP ranks do, resume exactly, and merge whole weights;
the data cursor counts samples, so a run resumed with another batch split and another number of
ranks trains every sample of the epoch once.

Two launches in all (tests/distrun.py runs many stages in one interpreter; starting Python,
torch and transformers is most of a tiny run's cost): one plain process (the references), and
two ranks that run the FSDP runs, then the DDP ones. Tolerances are the DDP tests' (tests/test_distributed_stages.py):
per-step figures rel 1e-4, merged weights max |diff| 1e-5 (LoRA) and 1e-4 (full fine-tuning);
a resumed run equals the unbroken one at rel 1e-6.

PPO and GRPO sample with scripted generators against one process (rollouts independent of how
prompts are dealt to ranks), and with the real sampler (the decode engine on gathered weights)
against two DDP ranks (same ranks, same RNG streams).

On a machine with one CUDA GPU (run_scripts/gpu_check.sh) the same tests run with one rank on
CUDA over nccl (NCCL cannot put two ranks on one GPU): FSDP on one rank == one process == DDP,
resumed == unbroken, and the geometry change is a split change only; per-step figures within
rel 1e-3 there (CUDA kernels differ between the sharded and the plain run, as tests/test_gpu.py
measured for FSDP on one rank).

PPO's runs also record every parameter's gradient norm at their first optimizer steps, which must
agree per parameter as the logged figures do: a failure names the first optimizer step at which
gradients part and the parameters furthest apart. (FSDP PPO on one CUDA rank once parted from the
plain run at its first step: the critic was loaded in bf16, `reward_model.dtype` 'auto' on a GPU,
beside the fp32 policy; bf16's rounding parts a run that re-runs the first forward from one that
holds it. 'auto' now follows `model.dtype`: bench/RESULTS.md.)"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed_stages import REL, WEIGHTS_ABS, history, launch, merged_weights, stage_argv, write_data
from test_pt_sft import write_sft

from data_formats.sampling import DataCursor, epoch_order, legacy_cursor, next_micro_batches

CUDA = torch.cuda.is_available()
WORLD = min(2, torch.cuda.device_count()) if CUDA else 2
"""Ranks of the FSDP and DDP launches: two on CPU (gloo), one per GPU (at most two) on CUDA."""
REL_RUN = 1e-3 if CUDA else REL
ABS_OF = {"ppo/policy_loss": 0.1 * REL_RUN}
"""Absolute tolerances beside rel (default 1e-7): PPO's policy loss near ratio 1 is minus a token
mean of whitened advantages, terms of both signs (each about 0.1) that nearly cancel, so it is off
by rel times its terms' scale, not its own value's (bench/RESULTS.md)."""
KEYS = {
    "pt": ("train/loss", "train/grad_norm"),
    "sft": ("train/loss", "train/grad_norm", "train/loss_task/big"),
    "rm": ("train/loss", "train/grad_norm", "train/accuracy"),
    "dpo": ("train/loss", "train/grad_norm", "train/margin"),
    "ppo": ("train/grad_norm", "ppo/kl", "ppo/reward_norm", "ppo/entropy", "ppo/policy_loss", "ppo/value_loss"),
    "grpo": ("train/loss", "train/grad_norm", "grpo/reward", "grpo/completion_length"),
}
RUNS = {
    "sft": ("sft", 2, "lora"),
    "pt-full": ("pt", 1, "full"),
    "rm": ("rm", 1, "lora"),
    "dpo": ("dpo", 1, "lora"),
    "ppo": ("ppo", 1, "lora"),
    "ppo-full": ("ppo", 1, "full"),
    "grpo": ("grpo", 1, "lora"),
    "ppo-real": ("ppo", 1, "lora"),
    "grpo-real": ("grpo", 1, "lora"),
}
"""name: (stage, grad_accum, model.finetuning); '-real' runs sample with the decode engine."""
AGAINST_ONE = ("sft", "pt-full", "rm", "dpo", "ppo", "ppo-full", "grpo")
AGAINST_DDP = ("pt-full", "ppo", "ppo-real", "grpo-real")
"""(LoRA SFT under DDP equals one process in tests/test_distributed_stages.py, as under FSDP here.)
Scripted PPO runs against both: where FSDP parts from the one process, DDP says whether the engine
path (both distributed engines) or the one process's own path (its held scoring forward, policy
and critic run separately) parts."""
GRADIENTS = ("ppo", "ppo-real")
"""Runs that record every parameter's gradient norm at their first optimizer steps (tests/distrun.py):
where the logged grad_norm parts (FSDP PPO on one CUDA rank did, at its first step), a failure
names the parameters whose gradients part, at the first optimizer step they do."""
RESUMED = ("sft", "pt-full")
GEOMETRY = {
    "first": {"train__batch_size": "2", "train__grad_accum": "1"},
    "second": {"train__batch_size": str(4 // WORLD), "train__grad_accum": "1", "checkpoint__resume_changed": "true"},
}
"""The run stopped after 3 steps of 2 samples on one process, resumed on two FSDP ranks (one on a
single GPU) with 4 samples a step: 6 is no multiple of 4 (a cursor counting micro-batches re-read
two samples and never reached the last two)."""


def argv(name: str, world: int, out: Path, data: dict, model: Path, reward: Path) -> list[str]:
    stage, accum, mode = RUNS[name]
    per_rank = {"ppo": 8, "grpo": 4}.get(stage, 4) // world
    # DPO reads the RM's pairs with its settings; GRPO the common settings and PPO's prompts.
    base = stage_argv({"dpo": "rm", "grpo": "rm"}.get(stage, stage), accum, per_rank, out, data, model, reward)
    if stage == "grpo":
        base = base[: base.index("--data.train")] + [
            "--data.train",
            f"[{data['ppo']}]",
            "--data.eval",
            "[]",
            "--train.learning_rate",
            "1e-2",
            "--grpo.num_generations",
            "2",
            "--grpo.beta",
            "0.04",
            "--grpo.reward_funcs",
            "[distrun:group_reward]",
            "--generation.max_new_tokens",
            "6",
        ]
    return base + ["--model.finetuning", mode]


def with_values(argv_: list[str], **values: str) -> list[str]:
    """`argv_` with each --key (underscores for dots) set to its value, replaced where present."""
    out = list(argv_)
    for key, value in values.items():
        flag = "--" + key.replace("__", ".")
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def spec(name: str, world: int, folder: Path, setup, engine: str, **extra) -> dict:
    root, data, model, reward = setup
    out = folder / name
    return {
        "stage": RUNS[name][0],
        "argv": argv(name, world, out, data, model, reward) + ["--distributed.engine", engine],
        "sampler": "real" if name.endswith("-real") else "scripted",
        "grad_norms": name in GRADIENTS,
        **extra,
    }


def geometry_spec(phase: str, setup, engine: str, stop_after=None) -> dict:
    root, data, model, reward = setup
    argv_ = with_values(
        stage_argv("sft", 1, 2, root / "geometry", data, model, reward),
        **GEOMETRY[phase],
        data__train=f"[{data['sft14']}]",
        train__max_steps="5",
        distributed__engine=engine,
        model__finetuning="lora",
    )
    return {"stage": "sft", "argv": argv_, "stop_after": stop_after, "history": phase}


@pytest.fixture(scope="module")
def setup(module_folder, tiny_model_dir, tiny_reward_dir):
    root = module_folder
    data = write_data(root / "data")
    data["sft14"] = write_sft(root / "data" / "sft14", 10, 4)[0]
    return root, data, tiny_model_dir, tiny_reward_dir


@pytest.fixture(scope="module")
def launches(setup):
    """The two launches: one process; two ranks running the FSDP runs (with the stopped-and-resumed
    runs and the geometry change's second half), then the DDP runs (one torchrun: the engine is
    a run's setting, the process group outlives the runs)."""
    root = setup[0]
    one = [spec(n, 1, root / "one", setup, "ddp") for n in AGAINST_ONE] + [
        geometry_spec("first", setup, "ddp", stop_after=3)
    ]
    launch(one, root / "one", 1)
    fsdp = [spec(n, WORLD, root / "fsdp", setup, "fsdp") for n in RUNS]
    for name in RESUMED:
        resumed = spec(name, WORLD, root / "fsdp", setup, "fsdp")
        resumed["argv"] = with_values(resumed["argv"], output_dir=str(root / "fsdp" / f"{name}-resumed"))
        fsdp += [{**resumed, "stop_after": 1}, resumed]
    ddp = [spec(n, WORLD, root / "ddp", setup, "ddp") for n in AGAINST_DDP]
    launch(fsdp + [geometry_spec("second", setup, "fsdp")] + ddp, root / "ranks", WORLD, torchrun=True)
    return root


def differing(got: list[dict], want: list[dict], rel: float) -> dict[str, list]:
    """Every logged figure the two runs disagree on beyond `rel` (got, want per step): a failure
    names where the runs part (the policy's loss or the critic's, the KL, ...), not only the key."""
    keys = sorted({k for s in got + want for k, v in s.items() if isinstance(v, (int, float))})
    return {
        k: [(g.get(k), w.get(k)) for g, w in zip(got, want)]
        for k in keys
        if [g.get(k) for g in got] != pytest.approx([w.get(k) for w in want], rel=rel, abs=ABS_OF.get(k, 1e-7))
    }


def gradient_norms(out: Path) -> list[dict[str, float]]:
    """Rank 0's per-parameter gradient norms at the run's first optimizer steps ([] if not recorded)."""
    return json.loads((out / "history-rank0.json").read_text()).get("grad_norms", [])


def short(name: str) -> str:
    """A parameter's name without peft's wrapper and adapter parts (the GPU check's report shows
    a failure's first 300 characters)."""
    return name.replace("base_model.model.", "").replace(".default.", ".")


def parting_gradients(got: list[dict], want: list[dict], rel: float, most: int = 5) -> str:
    """Where two runs' per-parameter gradient norms first part beyond `rel` (abs 1e-7): the optimizer
    step, how many parameters part, and the `most` furthest apart; '' when none does."""
    if len(got) != len(want):
        return f"gradient norms recorded at {len(got)} optimizer steps against {len(want)}"
    for index, (g, w) in enumerate(zip(got, want)):
        if g.keys() != w.keys():
            return f"optimizer step {index}: parameters with a gradient differ: {sorted(g.keys() ^ w.keys())[:most]}"
        apart = sorted(
            ((abs(g[n] - w[n]) / max(abs(w[n]), 1e-30), n) for n in g if abs(g[n] - w[n]) > max(rel * abs(w[n]), 1e-7)),
            reverse=True,
        )
        if apart:
            named = "; ".join(f"{short(n)} rel {r:.1e} ({g[n]:.6g} vs {w[n]:.6g})" for r, n in apart[:most])
            return f"optimizer step {index} of {len(got)}: {len(apart)} of {len(g)} parameters' gradients part: {named}"
    return ""


def assert_same_run(got_dir: Path, want_dir: Path, stage: str, mode: str, rel: float) -> None:
    got, want = history(got_dir), history(want_dir)
    assert len(got) == len(want) == 2
    parted = parting_gradients(gradient_norms(got_dir), gradient_norms(want_dir), rel)
    if got_dir.name in GRADIENTS:
        assert gradient_norms(got_dir) and gradient_norms(want_dir), "no per-parameter gradient norms recorded"
    for key in KEYS[stage]:
        assert [s[key] for s in got] == pytest.approx([s[key] for s in want], rel=rel, abs=ABS_OF.get(key, 1e-7)), (
            f"{key} parts; {parted or 'no per-parameter gradient norm parts'}; every figure apart: "
            f"{differing(got, want, rel)}"
        )
    assert not parted, parted
    if stage == "ppo":
        # Before any update the policy is its reference (LoRA: the adapter is zero; full: a frozen
        # copy beside the sharded policy, which must take the policy's path: whole rows, the full
        # head), so the first KL is 0 exactly.
        assert got[0]["ppo/kl"] == want[0]["ppo/kl"] == 0.0
    a, b = merged_weights(got_dir), merged_weights(want_dir)
    assert a.keys() == b.keys() and a
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) < WEIGHTS_ABS[mode]


@pytest.mark.parametrize("name", AGAINST_ONE)
def test_two_fsdp_ranks_equal_one_process(name, launches, setup):
    stage, _, mode = RUNS[name]
    two = launches / "fsdp" / name
    assert_same_run(two, launches / "one" / name, stage, mode, REL_RUN)
    assert [s["train/grad_norm"] for s in history(two, WORLD - 1)] == [
        s["train/grad_norm"] for s in history(two)
    ]  # global norm
    assert max(s["train/grad_norm"] for s in history(two)) > 0.05  # clipping was active
    base = load_file(str(setup[2] / "model.safetensors"))
    merged = merged_weights(two)
    # Whole weights, not shards: every merged tensor has the base model's shape; training moved some.
    assert all(merged[k].shape == base[k].shape for k in merged if k in base)
    assert any(not torch.equal(merged[k], base[k]) for k in merged if k in base)
    assert json.loads((two / "merged" / "manifest.json").read_text())["stage"] == stage


@pytest.mark.parametrize("name", AGAINST_DDP)
def test_two_fsdp_ranks_equal_two_ddp_ranks(name, launches):
    """The real sampler (PPO, GRPO): generation on gathered weights draws what DDP's does; scripted
    PPO: the two engines update alike."""
    stage, _, mode = RUNS[name]
    assert_same_run(launches / "fsdp" / name, launches / "ddp" / name, stage, mode, REL_RUN)


@pytest.mark.parametrize("name", RESUMED)
def test_fsdp_stopped_and_resumed_equals_unbroken(name, launches):
    """Stopped after step 1 and resumed on two FSDP ranks: every rank got its shards of the
    weights and of the (gathered) optimizer state back (LoRA SFT with accumulation; full PT)."""
    stage, _, mode = RUNS[name]
    resumed, unbroken = launches / "fsdp" / f"{name}-resumed", launches / "fsdp" / name
    assert json.loads((resumed / f"history-rank{WORLD - 1}.json").read_text())["resumed_at"] == 1
    for rank in range(WORLD):
        got, want = history(resumed, rank), history(unbroken, rank)
        for key in ("train/loss", "train/grad_norm"):
            assert [s[key] for s in got] == pytest.approx([s[key] for s in want], rel=1e-6), key
    a, b = merged_weights(resumed), merged_weights(unbroken)
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) < WEIGHTS_ABS[mode]


def test_resumed_on_more_ranks_with_another_split_trains_every_sample_once(launches):
    """3 steps of 2 samples on one process, then 2 steps of 2 x 2 ranks under FSDP: the 14
    samples of epoch 0 are each trained exactly once (a micro-batch cursor re-read 2 and skipped 2)."""
    folder = launches / "geometry"
    first = json.loads((folder / "first-rank0.json").read_text())
    seconds = [json.loads((folder / f"second-rank{r}.json").read_text()) for r in range(WORLD)]
    assert len(first["batch_ids"]) == 3 and seconds[0]["resumed_at"] == 3 and len(seconds[0]["batch_ids"]) == 2
    trained = [i for step in first["batch_ids"] for group in step for i in group]
    trained += [i for s in seconds for step in s["batch_ids"] for group in step for i in group]
    assert sorted(trained) == list(range(14))


def steps_over_geometries(n: int, seed: int, plan: list[tuple[int, int, int, int]]) -> list[int]:
    """Every sample trained by `plan`'s phases, each (batch_size, grad_accum, world_size, steps),
    the cursor saved and loaded between phases as a checkpoint carries it."""
    cursor, trained = DataCursor(), []
    for batch, accum, world, steps in plan:
        cursor = legacy_cursor(json.loads(json.dumps(cursor.__dict__)), batch * world)  # the checkpoint round trip
        for _ in range(steps):
            after = None
            for rank in range(world):
                groups, after = next_micro_batches(
                    n, cursor, seed=seed, batch_size=batch, grad_accum=accum, world_size=world, rank=rank
                )
                trained += [i for g in groups for i in g]
            cursor = after
    return trained


def test_the_cursor_counts_samples_across_splits_and_world_sizes():
    # The run: 2 x 2 for 10 steps, then 4 x 1; and 2 ranks -> 1 (a node lost) -> 3, each
    # phase ending where the next one's micro-batch does not divide the samples done.
    assert sorted(steps_over_geometries(48, 3, [(2, 2, 1, 10), (4, 1, 1, 2)])) == list(range(48))
    assert sorted(steps_over_geometries(30, 3, [(1, 3, 2, 2), (3, 1, 1, 2), (2, 1, 3, 2)])) == list(range(30))
    # Unchanged geometry draws what the micro-batch cursor drew: consecutive slices of the order.
    assert steps_over_geometries(10, 1, [(2, 2, 1, 2)]) == epoch_order(10, 1, 0)[:8]


def test_a_checkpoint_from_the_micro_batch_cursor_resumes_at_its_sample():
    assert legacy_cursor({"epoch": 2, "position": 3}, 4) == DataCursor(2, 12)
    assert legacy_cursor({"epoch": 2, "samples": 12}, 8) == DataCursor(2, 12)


def test_fsdp_runs_on_cpu_and_refuses_what_it_cannot_shard(tiny_model_dir):
    from pipeline.config import load_config
    from pipeline.engine.accelerator import combination_problems
    from stages.sft import SFTConfig

    def lines(*extra):
        return combination_problems(
            load_config(SFTConfig, ["--model.path", str(tiny_model_dir), "--distributed.engine", "fsdp", *extra])
        )

    assert lines() == []
    assert lines("--model.finetuning", "qlora") == [
        "distributed.engine: fsdp cannot shard QLoRA's "
        "4-bit weights; use distributed.engine ddp, or model.finetuning lora or full"
    ]
    assert [p.split(":")[0] for p in lines("--distributed.fsdp_sharding", "NO_SHARD")] == ["distributed.fsdp_sharding"]


def test_optimizer_state_keys_convert_between_the_engines():
    """A DDP checkpoint (torch's index-keyed optimizer state) resumes under FSDP (keyed by name)
    and back: the names are those torch's distributed-checkpoint API gives the same state, and the
    round trip loads into a fresh optimizer that then steps exactly as the original."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from pipeline.config import TrainConfig
    from pipeline.engine.accelerator import build_optimizer
    from pipeline.engine.fsdp import keyed_by_index, keyed_by_name, parameter_names

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
        return model, build_optimizer(model, TrainConfig(learning_rate=1e-2))

    def step(model, optimizer):
        model(torch.ones(2, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    names = parameter_names(model, optimizer)
    by_name = keyed_by_name(copy.deepcopy(optimizer.state_dict()), names)  # a checkpoint's own copy
    reference = get_optimizer_state_dict(model, optimizer)
    assert sorted(by_name["state"]) == sorted(reference["state"]) == sorted(n for n, _ in model.named_parameters())
    assert [g["params"] for g in by_name["param_groups"]] == [g["params"] for g in reference["param_groups"]]
    for name, state in reference["state"].items():
        assert all(torch.equal(state[k], by_name["state"][name][k]) for k in state)
    again, fresh = model_and_optimizer()
    again.load_state_dict(model.state_dict())
    fresh.load_state_dict(keyed_by_index(by_name, names))
    step(model, optimizer)
    step(again, fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
