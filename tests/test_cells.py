"""Cells of the capability table (pipeline/config/capabilities.py) no other test trains: QLoRA in
every stage but SFT, and the hf generation backend in the PPO and GRPO stages. Two steps each on the
tiny model, all in this process (starting torch and transformers is most of a tiny run's cost).

Invariants: a QLoRA stage trains its adapter, which moves the merged model away from the base (a stage
whose loss or advantages were all 0 would leave it where it was), and every trained tensor is a LoRA
(or the RM's score head) one; the hf backend draws from the same distribution and RNG stream as
Relay's engine, so the same seeded run samples the same responses and logs the same figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed_stages import stage_argv, write_data

STAGES = ("pt", "rm", "dpo", "kto", "ppo", "grpo")


def kto_rows(path: Path) -> Path:
    rows = [
        (f"What is {i} plus {i}?", f"{i} plus {i} is {2 * i}." if i % 2 else "No idea!", bool(i % 2)) for i in range(16)
    ]
    path.write_text("".join(json.dumps({"prompt": q, "completion": a, "label": g}) + "\n" for q, a, g in rows))
    return path


def argv(stage: str, out: Path, data: dict, model: Path, reward: Path, *extra: str) -> list[str]:
    base = stage_argv({"dpo": "rm", "kto": "rm", "grpo": "rm"}.get(stage, stage), 1, 4, out, data, model, reward)
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
    return base + ["--train.learning_rate", "5e-2", *extra]


def run(stage: str, args: list[str], sampler: str = "scripted") -> list[dict]:
    from distrun import run_one

    spec = {"stage": stage, "argv": args, "sampler": sampler}
    if stage == "kto":  # tests/distrun.py's table lacks KTO
        import distrun as d

        table = d.stage_class

        def with_kto(name):
            from stages.kto import KTOStage

            return KTOStage if name == "kto" else table(name)

        d.stage_class = with_kto
        try:
            run_one(spec)
        finally:
            d.stage_class = table
    else:
        run_one(spec)
    out = Path(args[args.index("--output_dir") + 1])
    return json.loads((out / "history-rank0.json").read_text())["steps"]


@pytest.fixture(scope="module")
def setup(module_folder, tiny_model_dir, tiny_reward_dir):
    root = module_folder
    data = write_data(root / "data")
    data["kto"] = kto_rows(root / "data" / "kto.jsonl")
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


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_the_hf_backend_samples_as_relay_in_the_stage(stage, setup):
    root, data, model, reward = setup
    runs = {
        backend: run(
            stage,
            argv(stage, root / f"{stage}-{backend}", data, model, reward, "--generation.backend", backend),
            "real",
        )
        for backend in ("relay", "hf")
    }
    keys = [
        k
        for k in runs["relay"][0]
        if k.startswith(("grpo/", "ppo/", "train/")) and "time" not in k and "per_s" not in k
    ]
    assert keys
    for relay, hf in zip(runs["relay"], runs["hf"], strict=True):
        for key in keys:
            assert hf[key] == pytest.approx(relay[key], rel=1e-4, abs=1e-6), key
