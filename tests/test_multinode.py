"""Multi-node: two torchrun agents on this machine (`--nnodes 2 --node_rank 0/1 --nproc_per_node
1`, static rendezvous on 127.0.0.1) run the pipeline driver's SFT stage exactly as README's
"Multi-GPU and multi-node" section says, and the result equals one node with two processes: the
same per-step losses and grad_norms, the same merged model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from forkserver import python_for_tests
from safetensors.torch import load_file
from test_pt_sft import write_sft

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pipeline_config(folder: Path, model: Path, data: tuple[Path, Path]) -> Path:
    sft = {
        "train": {
            "max_steps": 2,
            "batch_size": 2,
            "grad_accum": 2,
            "seq_length": 48,
            "learning_rate": 5e-3,
            "eval_steps": 0,
            "lr_schedule": "constant",
            "warmup": 0,
            "max_grad_norm": 0.05,
        },
        "lora": {"r": 4, "dropout": 0.0},
        "checkpoint": {"save_interval": "1000h"},
        "multitask": {"weighted_loss_mode": "case3"},
    }
    config = {
        "base_model": str(model),
        "output_root": str(folder / "out"),
        "chain": ["sft"],
        "report": False,
        "stages": {"sft": {"config": sft, "data": {"train": [str(data[0])], "eval": [str(data[1])]}}},
    }
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def driver(config: Path, **env: str) -> subprocess.Popen:
    environment = {
        **os.environ,
        "PYTHON": python_for_tests(),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MASTER_ADDR": "127.0.0.1",
        **env,
    }
    return subprocess.Popen(
        ["bash", "run_scripts/run_pipeline.sh", str(config)],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(*procs: subprocess.Popen) -> None:
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]


def curve(out: Path) -> list[dict]:
    trainer = json.loads((out / "sft" / "checkpoints" / "step-0000002" / "trainer.json").read_text())
    return [{k: s[k] for k in ("train/loss", "train/grad_norm")} for s in trainer["history"]["steps"]]


def test_two_nodes_equal_one_node(tiny_model_dir, tmp_path):
    data = write_sft(tmp_path / "data", 12, 4)
    nodes, single = tmp_path / "nodes", tmp_path / "single"
    nodes.mkdir(), single.mkdir()
    port = str(free_port())
    # README "Multi-GPU and multi-node": the same command on every node, NODE_RANK its rank.
    config = pipeline_config(nodes, tiny_model_dir, data)
    finished(*(driver(config, NNODES="2", NODE_RANK=str(rank), NPROC="1", MASTER_PORT=port) for rank in (0, 1)))
    finished(driver(pipeline_config(single, tiny_model_dir, data), NPROC="2", MASTER_PORT=str(free_port())))
    got, want = curve(nodes / "out"), curve(single / "out")
    assert len(got) == 2
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-6)
    a, b = (
        load_file(str(nodes / "out/sft/merged/model.safetensors")),
        load_file(str(single / "out/sft/merged/model.safetensors")),
    )
    assert a.keys() == b.keys()
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) < 1e-6
    marker = json.loads((nodes / "out/sft/checkpoints/step-0000002/.complete").read_text())
    assert marker["world_size"] == 2
