"""Cells of the capability table (pipeline/config/capabilities.py) no other test trains: QLoRA in
every stage but SFT, and the relay and hf generation backends in the PPO, GRPO and distill stages with
every adapter, PPO and GRPO with tools off and on. Two steps each on the tiny model, all in this
process (starting torch and transformers is most of a tiny run's cost).

Invariants: a QLoRA stage trains its adapter, which moves the merged model away from the base (a stage
whose loss or advantages were all 0 would leave it where it was), and every trained tensor is a LoRA
(or the RM's score head) one; the hf backend draws from the same distribution and RNG stream as
Relay's engine, so the same seeded run samples the same responses and logs the same figures."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed_stages import stage_argv, write_data
from tinymodels import make_tiny_model
from tool_distrun import call_length
from transformers import AutoTokenizer

STAGES = ("pt", "rm", "dpo", "kto", "ppo", "grpo")
TOOLS = ("off", "on")


def kto_rows(path: Path) -> Path:
    rows = [
        (f"What is {i} plus {i}?", f"{i} plus {i} is {2 * i}." if i % 2 else "No idea!", bool(i % 2)) for i in range(16)
    ]
    path.write_text("".join(json.dumps({"prompt": q, "completion": a, "label": g}) + "\n" for q, a, g in rows))
    return path


def argv(stage: str, out: Path, data: dict, model: Path, reward: Path, *extra: str) -> list[str]:
    base = stage_argv(
        {"dpo": "rm", "kto": "rm", "grpo": "rm", "distill": "rm"}.get(stage, stage), 1, 4, out, data, model, reward
    )
    if stage == "kto":
        base[base.index("--data.train") + 1] = f"[{data['kto']}]"
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
            "--grpo.reward_funcs",
            "[distrun:group_reward]",
            "--generation.max_new_tokens",
            "6",
        ]
    if stage == "distill":  # on-policy only: every step samples
        base = base[: base.index("--data.train")] + ["--data.train", f"[{data['ppo']}]", "--data.eval", "[]"]
        base += ["--teacher.path", str(data["teacher"]), "--distill.lmbda", "1", "--generation.max_new_tokens", "6"]
    return base + ["--train.learning_rate", "5e-2", *extra]


def run(stage: str, args: list[str], sampler: str = "scripted") -> list[dict]:
    import cells_distrun  # noqa: F401  (adds KTO, distill and the tool callers to tests/distrun.py's runner)
    from distrun import run_one

    run_one({"stage": stage, "argv": args, "sampler": sampler})
    out = Path(args[args.index("--output_dir") + 1])
    return json.loads((out / "history-rank0.json").read_text())["steps"]


@pytest.fixture(scope="module")
def setup(module_folder, tiny_model_dir, tiny_reward_dir):
    root = module_folder
    data = write_data(root / "data")
    data["kto"] = kto_rows(root / "data" / "kto.jsonl")
    data["teacher"] = make_tiny_model(root / "teacher", seed=7, hidden_size=96, intermediate_size=192)
    data["tools"] = root / "data" / "tools.jsonl"
    data["tools"].write_text(
        "".join(json.dumps({"prompt": f"What is 2 + {i}?", "answer": str(2 + i)}) + "\n" for i in range(8))
    )
    return root, data, tiny_model_dir, tiny_reward_dir


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("stage", STAGES)
def test_qlora_trains_the_adapter_of_every_stage(stage, setup):
    root, data, model, reward = setup
    out = root / f"qlora-{stage}"
    steps = run(stage, argv(stage, out, data, model, reward, "--model.finetuning", "qlora"))
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(s["train/grad_norm"])) for s in steps)
    assert all(s["train/grad_norm"] > 0 for s in steps)  # the adapter got a gradient every step
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and all(v.dtype != torch.uint8 for v in adapter.values())  # the adapter, never 4-bit weights
    assert any(float(v.abs().max()) > 0 for v in lora_b), "every lora_B is still 0: the adapter learned nothing"


def tool_args(stage: str, data: dict) -> list[str]:
    """A tool rollout's flags: tests/test_tool_rollout.py's add() and, for GRPO, its reward."""
    args = ["--data.train", f"[{data['tools']}]", "--tools.funcs", "[test_tool_rollout:add]"]
    args += ["--generation.max_new_tokens", "64", "--generation.missing_eos_penalty", "null"]
    return args + (["--grpo.reward_funcs", "[test_tool_rollout:answer_length]"] if stage == "grpo" else [])


LENGTH = {"ppo": "ppo/response_length", "grpo": "grpo/completion_length"}
HF_CELLS = [
    (stage, adapter, tools) for stage in ("ppo", "grpo") for adapter in ("lora", "full", "qlora") for tools in TOOLS
] + [("distill", adapter, "-") for adapter in ("lora", "full", "qlora")]


@pytest.mark.parametrize("stage,adapter,tools", HF_CELLS, ids=["-".join(c).removesuffix("--") for c in HF_CELLS])
def test_the_hf_backend_samples_as_relay_in_the_stage(stage, adapter, tools, setup):
    """Every adapter, tools off and on (after a fixed first call: a random tiny policy writes none),
    and distillation's student: at every sampling call of two seeded steps the stage's own hf
    sampler (transformers' generate, made from its config) draws the ids the relay backend's (Relay's
    engine, made with the same arguments) draws from the same policy and RNG state
    (tests/cells_distrun.py `paired_hf`: the run fails naming the call otherwise; a sampler holding
    stale weights would part at step 2); the stage trains on them, and with tools every completion
    made its call and sampled a turn after its result."""
    root, data, model, reward = setup
    extra = ["--model.finetuning", adapter, *(tool_args(stage, data) if tools == "on" else [])]
    args = argv(stage, root / f"{stage}-{adapter}-{tools}", data, model, reward, *extra)
    steps = run(stage, args + ["--generation.backend", "hf"], "paired-tools" if tools == "on" else "paired")
    out = Path(args[args.index("--output_dir") + 1])
    assert json.loads((out / "history-rank0.json").read_text())["sampler"] == (
        "ForcedFirstCall" if tools == "on" else "Paired"
    )
    assert len(steps) == 2 and all(
        math.isfinite(s["train/loss" if "train/loss" in s else "train/grad_norm"]) for s in steps
    )
    assert all(s["train/grad_norm"] > 0 for s in steps)  # the samples taught something
    if tools == "on":
        assert [s["tools/call_frequency"] for s in steps] == [1.0, 1.0]  # the forced call, once per row
        assert [s["tools/failure_frequency"] for s in steps] == [0.0, 0.0]
        length = LENGTH[stage]  # a turn sampled after the inserted result
        assert all(s[length] > call_length(AutoTokenizer.from_pretrained(model)) for s in steps)


def test_the_paired_sampler_fails_where_the_backends_part(tiny_model_dir):
    """The check above can fail: a relay sampler on other weights (a stale policy's stand-in: the
    head scaled, a sharper distribution) draws other ids on the first call, and `Paired` names it;
    the same policy in both passes."""
    from cells_distrun import Paired
    from transformers import AutoModelForCausalLM

    from pipeline.rl.generators import make_generator

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [[5, 6, 7], [8, 9]]
    hf = make_generator("hf", model, tok.pad_token_id, [tok.eos_token_id], 8)
    same = Paired(make_generator("relay", model, tok.pad_token_id, [tok.eos_token_id], 8), hf, [tok.eos_token_id])
    assert len(same.generate(prompts)) == 2
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.mul_(50.0)
    stale = make_generator("relay", other, tok.pad_token_id, [tok.eos_token_id], 8)
    with pytest.raises(AssertionError, match="sampling call 1: hf and relay drew different ids"):
        Paired(stale, hf, [tok.eos_token_id]).generate(prompts)
