"""The pipeline driver: plan, chaining, skip-when-done, resume after a crash, cross-stage checks.

Most tests run the real bash driver with a fake stage script (it keeps the stage CLI contract:
merged/ + manifest.json + summary.json + TensorBoard events) so they take seconds; the end-to-end
test at the bottom runs the real stages on tiny models.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml
from forkserver import python_for_tests

from pipeline.config import ConfigError
from pipeline.modeling.handoff import fact_problems
from pipeline.modeling.manifest import read_manifest, tokenizer_hash, weights_hash
from pipeline.tools.chain import checks_after, parent_stage, stage_status
from pipeline.tools.chain_config import (
    DriverError,
    GoldConfig,
    PipelineConfig,
    Selection,
    VerdictConfig,
    deep_merge,
    load_pipeline,
    planned_stages,
    stage_config,
)
from pipeline.tools.driver import gold_verdict, verdict

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("pt", "sft", "rm", "ppo")

FAKE_STAGE = textwrap.dedent(
    '''
    """A stand-in stage keeping the stage CLI contract; FAIL_STAGE=<name> makes it crash.

    numpy and tensorboard's own event writer instead of torch: importing torch costs seconds.
    """
    import json, os, shutil, sys, time
    from pathlib import Path
    import numpy as np
    from safetensors.numpy import load_file, save_file
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from pipeline.modeling.manifest import write_manifest

    stage = Path(sys.argv[0]).stem
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    out, parent = Path(args["--output_dir"]), args["--model.path"]
    with open(Path(os.environ["FAKE_LOG"]), "a") as fh:
        fh.write(json.dumps({"stage": stage, "argv": sys.argv[1:]}) + "\\n")
    if os.environ.get("FAIL_STAGE") == stage:
        sys.exit(3)
    if os.environ.get("RELAY_STOP_AFTER_STEP"):  # the stage contract: a checkpoint, no merge, exit 0
        saved = out / "checkpoints" / f"step-{int(os.environ['RELAY_STOP_AFTER_STEP']):07d}"
        saved.mkdir(parents=True)
        (saved / ".complete").write_text("{}")
        sys.exit(0)
    merged = out / "merged"
    shutil.copytree(parent, merged, ignore=shutil.ignore_patterns("manifest.json"))
    weights = merged / "model.safetensors"
    rng = np.random.default_rng(len(stage) + int(os.environ.get("FAKE_SEED", "0")))  # FAKE_SEED: other weights
    tensors = {k: (v + 0.01 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    extra = None
    if stage == "ppo":  # the PPO contract: the reward model it scored with
        from pipeline.modeling.manifest import weights_hash
        rm = args["--reward_model.path"]
        extra = {"reward_model": {"path": rm, "weights_hash": weights_hash(rm)}}
    if "--teacher.path" in args:  # the distill contract: the teacher it learned from
        from pipeline.modeling.manifest import weights_hash
        teacher = args["--teacher.path"]
        extra = {"teacher": {"path": teacher, "weights_hash": weights_hash(teacher)}}
    import yaml
    from pipeline.engine.identity import data_digest
    trained_on = (yaml.safe_load(open(args["--config"])) or {}).get("data", {}).get("train", [])
    extra = {**(extra or {}), "data_digest": data_digest(trained_on)}  # the stage contract: what it trained on
    write_manifest(merged, stage=stage, parent=parent, config={"argv": sys.argv[1:]}, extra=extra)
    writer = EventFileWriter(str(out / "runs" / stage))
    for step in (1, 2, 3):
        second = "ppo/reward_raw" if stage == "ppo" else "eval/loss"
        for tag, value in (("train/loss", 3.0 / step), (second, step / 10)):
            summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
            writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))
    writer.close()
    summary = {
        "train_loss_first": 3.0,
        "train_loss_last": 1.0,
        "eval_loss_first": 0.1,
        "eval_loss_last": 0.3,
        "steps": 3,
        "wall_seconds": 0.5,
    }
    if stage == "reward":
        summary.update(eval_accuracy=0.9, eval_margin=1.5)
    if stage == "ppo":
        summary = {
            "reward_first": -0.25,
            "reward_last": 0.5,
            "kl_last": 0.0625,
            "eval_reward_first": 0.0,
            "eval_reward_last": 0.25,
            "steps": 3,
            "wall_seconds": 0.5,
        }
    (out / "summary.json").write_text(json.dumps(summary))
    '''
)
SCRIPT_NAMES = {"pt": "pretrain", "sft": "sft", "rm": "reward", "ppo": "ppo"}
STAGE_SCRIPTS_REAL = [f"stages/{n}.py" for n in SCRIPT_NAMES.values()]


GOLD_SAMPLE = ROOT / "data" / "sample" / "gold" / "eval.jsonl"


def write_fake_config(tmp: Path, base: Path, report: bool = True, gold: bool = False) -> tuple[Path, Path, Path]:
    """A pipeline config whose stages are the fake script; returns (config path, root, fake log).
    With `gold`, the config names a 4-question gold file (answered by the fake stages' tiny models)."""
    scripts = tmp / "scripts"
    scripts.mkdir(parents=True)
    for name in SCRIPT_NAMES.values():
        (scripts / f"{name}.py").write_text(FAKE_STAGE)
    root = tmp / "out"
    config = {
        "base_model": str(base),
        "output_root": str(root),
        "finetuning": "lora",
        "report": report,
        "all_stages": {"train": {"seed": 7}},
        "stages": {
            s: {
                "config": {"train": {"max_steps": 2}},
                "script": str(scripts / f"{SCRIPT_NAMES[s]}.py"),
                "overrides": {"train": {"max_steps": 3}},
            }
            for s in STAGES
        },
    }
    if gold:
        gold_file = tmp / "gold.jsonl"
        gold_file.write_text("".join(GOLD_SAMPLE.read_text().splitlines(keepends=True)[:4]))
        config["gold"] = {"data": str(gold_file), "max_new_tokens": 3, "batch_size": 2}
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, root, tmp / "fake.log"


def run_driver(config: Path, fake_log: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "FAKE_LOG": str(fake_log),
        "PYTHON": python_for_tests(),
        "PYTHONPATH": str(ROOT),
        **env,
    }
    return subprocess.run(
        ["bash", str(ROOT / "run_scripts/run_pipeline.sh"), str(config), *args],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )


def ran(fake_log: Path) -> list[str]:
    if not fake_log.exists():
        return []
    return [json.loads(line)["stage"] for line in fake_log.read_text().splitlines()]


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    return {
        s: ((root / s / "merged/model.safetensors").stat().st_mtime_ns, weights_hash(root / s / "merged"))
        for s in STAGES
    }


@pytest.fixture(scope="module")
def completed(tmp_path_factory, tiny_model_dir):
    """One complete fake pipeline run: (config, root, fake log, the driver's CompletedProcess)."""
    config, root, fake_log = write_fake_config(tmp_path_factory.mktemp("fake"), tiny_model_dir, gold=True)
    return config, root, fake_log, run_driver(config, fake_log)


@pytest.fixture
def completed_copy(completed, tmp_path):
    """A private copy of the completed run (stage outputs only, no report), to tamper with."""
    config, root, _, _ = completed
    copy_config, copy_root, fake_log = write_fake_config(
        tmp_path, Path(yaml.safe_load(config.read_text())["base_model"]), report=False
    )
    for folder in (*STAGES, "configs"):
        shutil.copytree(root / folder, copy_root / folder)
    return copy_config, copy_root, fake_log


def test_fake_pipeline_chains_stages_and_reports(completed, tiny_model_dir):
    config, root, fake_log, result = completed
    assert result.returncode == 0, result.stderr
    assert ran(fake_log) == ["pretrain", "sft", "reward", "ppo"]
    parents = {
        "pt": Path(tiny_model_dir).resolve(),
        "sft": root / "pt/merged",
        "rm": root / "sft/merged",
        "ppo": root / "sft/merged",
    }
    for stage, parent in parents.items():
        manifest = read_manifest(root / stage / "merged")
        assert manifest["parent_path"] == str(parent.resolve())
        assert manifest["parent_hash"] == weights_hash(parent)
    calls = {json.loads(line)["stage"]: json.loads(line)["argv"] for line in fake_log.read_text().splitlines()}
    assert calls["ppo"][calls["ppo"].index("--reward_model.path") + 1] == str((root / "rm/merged").resolve())
    assert "--reward_model.path" not in calls["reward"]
    written = yaml.safe_load((root / "configs/sft.yaml").read_text())
    assert written == {"train": {"max_steps": 3, "seed": 7}, "model": {"finetuning": "lora"}}
    summary = json.loads((root / "summary.json").read_text())
    assert (
        summary["rm_eval_accuracy"] == 0.9
        and summary["ppo_reward_first"] == -0.25
        and summary["ppo_reward_last"] == 0.5
    )
    assert summary["ppo_kl_last"] == 0.0625 and summary["pt_wall_seconds"] > 0
    assert summary["final_model"] == str((root / "ppo/merged").resolve())
    assert "ppo: mean reward -0.2500 -> 0.5000" in result.stdout
    # the gold table: base, SFT and PPO answer the 4 gold questions; random tiny models never use
    # the phrase, so the verdict (which rests on the table, not on the rising reward) is WARNING
    gold = summary["gold"]
    assert [(r["model"], r["n"], r["path"]) for r in gold["rows"]] == [
        ("base", 4, str(Path(tiny_model_dir).resolve())),
        ("sft", 4, str((root / "sft/merged").resolve())),
        ("ppo", 4, str((root / "ppo/merged").resolve())),
    ]
    assert gold["rl"] == "ppo" and gold["reference"] == "sft" and summary["gold_wall_seconds"] >= 0
    assert summary["verdict"] == "WARNING" and len(summary["verdict_reasons"]) == 1
    assert summary["verdict_reasons"][0].startswith(
        "gold: the ppo model's phrase rate 0.000 is not above the sft model's 0.000 by 0.2"
    )
    assert "| model | phrase rate | fact accuracy | n |" in result.stdout and "| ppo | 0.000 |" in result.stdout
    assert "verdict: WARNING" in result.stdout
    assert len((root / "gold/answers/ppo.jsonl").read_text().splitlines()) == 4
    report = (root / "report.md").read_text()
    assert "## Gold table" in report and "| sft | 0.000 |" in report
    assert (root / "report.md").is_file() and {p.name for p in (root / "plots").iterdir()} == {"losses.png", "ppo.png"}


def test_rerunning_a_complete_pipeline_does_no_work(completed):
    config, root, fake_log, first = completed
    assert first.returncode == 0, first.stderr
    before = snapshot(root)
    again = run_driver(config, fake_log, "--report", "false")
    assert again.returncode == 0, again.stderr
    assert ran(fake_log) == ["pretrain", "sft", "reward", "ppo"]  # nothing new ran
    assert snapshot(root) == before
    log = (root / "driver.log").read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in log if "skipped" in line][-4:] == [
        f"{s}: skipped, already complete ({root / s / 'merged'}/manifest.json)" for s in STAGES
    ]
    gold_lines = [line.split(" ", 2)[2] for line in log if line.split(" ", 2)[2].startswith("gold: ")]
    assert [line.split(" (")[0] for line in gold_lines] == [
        f"gold: {m}: generating greedy answers" for m in ("base", "sft", "ppo")
    ] + [f"gold: {m}: cached" for m in ("base", "sft", "ppo")]


def test_selection_crash_and_resume(tmp_path, tiny_model_dir):
    config, root, fake_log = write_fake_config(tmp_path, tiny_model_dir, report=False)
    refused = run_driver(config, fake_log, "--only", "rm")
    assert (
        refused.returncode == 1
        and f"sft has not run: {(root / 'sft/merged').resolve()} does not exist yet" in refused.stderr
    )
    assert run_driver(config, fake_log, "--only", "pt").returncode == 0
    assert ran(fake_log) == ["pretrain"]
    pt_hash = weights_hash(root / "pt/merged")
    crashed = run_driver(config, fake_log, FAIL_STAGE="reward")
    assert crashed.returncode == 3 and ran(fake_log) == ["pretrain", "sft", "reward"]
    assert not (root / "rm/merged").exists()
    assert json.loads((root / "summary.json").read_text())["verdict_reasons"] == [
        "RM or PPO did not run"
    ]  # from --only pt
    resumed = run_driver(config, fake_log, "--from", "rm")
    assert resumed.returncode == 0, resumed.stderr
    assert ran(fake_log) == ["pretrain", "sft", "reward", "reward", "ppo"]
    assert weights_hash(root / "pt/merged") == pt_hash


def test_tokenizer_mismatch_between_rm_and_policy_is_refused(completed_copy):
    config, root, fake_log = completed_copy
    shutil.rmtree(root / "ppo")
    rm = root / "rm/merged"
    policy_hash = tokenizer_hash(root / "sft/merged")
    tok = json.loads((rm / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 49152, "content": "<|extra|>"})
    (rm / "tokenizer.json").write_text(json.dumps(tok))
    manifest = read_manifest(rm)
    manifest["tokenizer_hash"] = tokenizer_hash(rm)  # a consistent but different RM: only the pairing is wrong
    (rm / "manifest.json").write_text(json.dumps(manifest))
    refused = run_driver(config, fake_log, "--only", "ppo")
    assert refused.returncode == 1
    assert (
        f"tokenizer hash: reward model {rm.resolve()} has {tokenizer_hash(rm)}, policy "
        f"{(root / 'sft/merged').resolve()} has {policy_hash}" in refused.stderr
    )
    assert ran(fake_log) == []


def test_edited_parent_tokenizer_is_refused(completed_copy):
    config, root, fake_log = completed_copy
    shutil.rmtree(root / "sft")
    recorded = read_manifest(root / "pt/merged")["tokenizer_hash"]
    (root / "pt/merged/tokenizer.json").write_text(json.dumps({"model": {"type": "other"}, "added_tokens": []}))
    refused = run_driver(config, fake_log, "--only", "sft")
    assert refused.returncode == 1
    pt = (root / "pt/merged").resolve()
    assert f"tokenizer hash: parent {pt} has {recorded}, {pt} has {tokenizer_hash(pt)}" in refused.stderr
    assert ran(fake_log) == []


def test_stale_stage_is_reported_not_rebuilt(completed_copy):
    config, root, fake_log = completed_copy
    manifest = read_manifest(root / "sft/merged")
    manifest["parent_hash"] = "0" * 64
    (root / "sft/merged/manifest.json").write_text(json.dumps(manifest))
    stale = run_driver(config, fake_log, "--only", "sft")
    assert stale.returncode == 1 and "is stale: built on parent weights " + "0" * 64 in stale.stderr
    assert f"delete {root / 'sft'} to rebuild it" in stale.stderr and ran(fake_log) == []


def rebuild_reward_model(root: Path) -> str:
    """Stand in for a retrained RM: new weights and a manifest consistent with them; its new hash."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from pipeline.modeling.manifest import write_manifest

    rm = root / "rm/merged"
    manifest = read_manifest(rm)
    tensors = {k: (v + np.float32(0.5)).astype(v.dtype) for k, v in load_file(rm / "model.safetensors").items()}
    save_file(tensors, rm / "model.safetensors", metadata={"format": "pt"})
    write_manifest(rm, stage=manifest["stage"], parent=manifest["parent_path"], config=manifest["config"])
    return weights_hash(rm)


def test_rebuilt_reward_model_makes_ppo_stale(completed_copy):
    config, root, fake_log = completed_copy
    recorded = read_manifest(root / "ppo/merged")["reward_model"]["weights_hash"]
    new_hash = rebuild_reward_model(root)
    assert new_hash != recorded
    stale = run_driver(config, fake_log)  # pt, sft, rm are done; PPO must not be skipped
    assert stale.returncode == 1 and ran(fake_log) == []
    rm = (root / "rm/merged").resolve()
    assert (
        f"{root / 'ppo/merged'} is stale: the reward model was rebuilt since PPO ran: PPO scored with reward model "
        f"weights {recorded}" in stale.stderr
    )
    assert f"but {rm} now has {new_hash}; delete {root / 'ppo'} to rebuild it" in stale.stderr
    cfg, _ = load_pipeline(str(config), [])
    with pytest.raises(DriverError, match="the reward model was rebuilt"):
        stage_status(cfg, "ppo")
    assert stage_status(cfg, "rm") == "done"
    assert any("the reward model was rebuilt" in p for p in checks_after(cfg, "ppo"))
    shutil.rmtree(root / "ppo")
    rebuilt = run_driver(config, fake_log)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert ran(fake_log) == ["ppo"] and read_manifest(root / "ppo/merged")["reward_model"] == {
        "path": str(rm),
        "weights_hash": new_hash,
    }


def test_ppo_output_without_reward_model_record_is_stale(completed_copy):
    config, root, fake_log = completed_copy
    cfg, _ = load_pipeline(str(config), [])
    assert stage_status(cfg, "ppo") == "done" and not [p for p in checks_after(cfg, "ppo") if "reward model" in p]
    manifest = read_manifest(root / "ppo/merged")
    del manifest["reward_model"]
    (root / "ppo/merged/manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DriverError, match="does not record the reward model PPO scored with"):
        stage_status(cfg, "ppo")
    assert [p for p in checks_after(cfg, "ppo") if "does not record the reward model" in p]
    stale = run_driver(config, fake_log, "--only", "ppo")
    assert stale.returncode == 1 and f"delete {root / 'ppo'} to rebuild it" in stale.stderr and ran(fake_log) == []


def test_changed_stage_config_is_reported_not_skipped(completed_copy):
    config, root, fake_log = completed_copy
    changed = run_driver(config, fake_log, "--only", "rm", "--stages.rm.overrides", "{train: {max_steps: 9}}")
    assert changed.returncode == 1 and ran(fake_log) == []
    assert (
        f"{root / 'rm/merged'} was built with the config in {root / 'configs/rm.yaml'}, which differs" in changed.stderr
    )
    assert f"(train.max_steps: 3 -> 9); delete {root / 'rm'} to rebuild it\n" in changed.stderr  # the keys, no YAML


# ---------------------------------------------------------------------------------------------
# Pure parts
# ---------------------------------------------------------------------------------------------


def test_plan_and_parents():
    cfg = PipelineConfig()
    assert planned_stages(cfg, Selection()) == list(STAGES)
    assert planned_stages(cfg, Selection(start="rm")) == ["rm", "ppo"]
    assert planned_stages(cfg, Selection(only="sft")) == ["sft"]
    assert [parent_stage(cfg, s) for s in STAGES] == [None, "pt", "sft", "sft"]
    cfg.stages.sft.enabled = False
    assert [parent_stage(cfg, s) for s in STAGES] == [None, "pt", "pt", "pt"]
    cfg.stages.pt.enabled = False
    assert [parent_stage(cfg, s) for s in STAGES] == [None, None, None, None]


def test_config_errors_are_collected(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("output_rot: x\nstages: {pt: {enabld: false}}\n")
    with pytest.raises(ConfigError) as err:
        load_pipeline(str(path), ["--from", "nope"])
    import stages as registry

    assert err.value.problems == [f"--from: 'nope' is not a stage ({', '.join(registry.STAGES)})"]
    with pytest.raises(ConfigError) as err:
        load_pipeline(str(path), [])
    assert err.value.problems == [
        f"{path}:1: output_rot: unknown key; did you mean 'output_root'?",
        f"{path}:2: stages.pt.enabld: unknown key; did you mean 'stages.pt.enabled'?",
    ]
    path.write_text("finetuning: half\nstages: {rm: {enabled: false}}\n")
    with pytest.raises(ConfigError) as err:
        load_pipeline(str(path), ["--only", "rm"])
    assert set(err.value.problems) == {
        "finetuning: 'half' is not one of None, 'full', 'lora', 'qlora'",
        "reward_model: PPO needs a reward model; enable stages.rm or set reward_model",
    }


def test_shipped_pipeline_configs_load():
    for name in ("pipeline.yaml", "demo.yaml"):
        if not all((ROOT / "configs" / f"{s}.yaml").is_file() for s in STAGES):
            pytest.skip("the stage YAMLs (configs/{pt,sft,rm,ppo}.yaml) have not landed yet")
        cfg, _ = load_pipeline(str(ROOT / "configs" / name), [])
        assert all(stage_config(cfg, s) for s in STAGES)


def test_stage_configs_are_checked_before_any_stage_runs():
    from pipeline.tools.chain import stage_config_problems

    cfg, _ = load_pipeline(
        str(ROOT / "configs" / "demo.yaml"),
        ["--stages.ppo.overrides", "{ppo: {kl_cof: 1}}", "--stages.sft.overrides", "{data: {template: nope}}"],
    )
    assert stage_config_problems(cfg, list(STAGES)) == [
        "stages.sft: data.template: 'nope' is not one of 'chat_template', 'role_markers'",
        "stages.ppo: ppo.kl_cof: unknown key; did you mean 'ppo.kl_coef'?",
    ]
    shipped, _ = load_pipeline(str(ROOT / "configs" / "pipeline.yaml"), [])
    assert stage_config_problems(shipped, list(STAGES)) == []


def test_stage_config_merge_order():
    cfg = PipelineConfig(finetuning="full", all_stages={"train": {"precision": "bf16", "seed": 1}})
    cfg.stages.sft.config = {"train": {"seed": 2, "max_steps": 5}, "data": {"train": ["a"], "format": "auto"}}
    cfg.stages.sft.data = {"train": ["b"]}
    cfg.stages.sft.overrides = {"train": {"seed": 3}, "model": {"finetuning": "qlora"}}
    assert stage_config(cfg, "sft") == {
        "train": {"seed": 3, "max_steps": 5, "precision": "bf16"},
        "data": {"train": ["b"], "format": "auto"},
        "model": {"finetuning": "qlora"},
    }
    assert deep_merge({"a": {"b": 1, "c": [1]}}, {"a": {"c": [2]}}) == {"a": {"b": 1, "c": [2]}}


def test_compare_and_verdict():
    assert fact_problems(
        "A", {"vocab_size": 1, "tokenizer_hash": "x"}, "B", {"vocab_size": 2, "tokenizer_hash": "x"}
    ) == ["vocab size: A has 1, B has 2"]
    ok = {"rm_eval_accuracy": 0.8, "ppo_reward_first": 0.2, "ppo_reward_last": 0.1}
    assert verdict(ok, VerdictConfig(), []) == []  # a falling PPO reward is information, not a reason
    assert verdict({**ok, "rm_eval_accuracy": 0.6}, VerdictConfig(), ["gold: x"]) == [
        "RM held-out accuracy 0.600 is below 0.7",
        "gold: x",
    ]
    assert verdict(ok, VerdictConfig(), None) == [
        "no gold table (set gold.data): the RL model was not judged on held-out answers"
    ]


def gold_rows(sft: tuple[float, float], ppo: tuple[float, float]) -> list[dict]:
    return [
        {"model": "base", "phrase_rate": 0.0, "fact_accuracy": 0.0, "n": 80},
        {"model": "sft", "phrase_rate": sft[0], "fact_accuracy": sft[1], "n": 80},
        {"model": "ppo", "phrase_rate": ppo[0], "fact_accuracy": ppo[1], "n": 80},
    ]


def test_gold_verdict():
    cfg = GoldConfig(min_phrase_gain=0.2, max_fact_drop=0.05)
    assert gold_verdict(gold_rows((0.5, 0.6), (0.9, 0.58)), "ppo", "sft", cfg) == []  # pass
    assert gold_verdict(gold_rows((0.5, 0.6), (0.7, 0.55)), "ppo", "sft", cfg) == []  # both exactly at the limits
    assert gold_verdict(gold_rows((0.5, 0.6), (0.65, 0.7)), "ppo", "sft", cfg) == [
        "gold: the ppo model's phrase rate 0.650 is not above the sft model's 0.500 by 0.2 (gain +0.150)"
    ]
    assert gold_verdict(gold_rows((0.5, 0.6), (1.0, 0.5)), "ppo", "sft", cfg) == [
        "gold: the ppo model's fact accuracy 0.500 "
        "fell below the sft model's 0.600 by 0.100, more than the 0.05 allowed"
    ]
    assert len(gold_verdict(gold_rows((0.5, 0.6), (0.4, 0.1)), "ppo", "sft", cfg)) == 2
    assert gold_verdict(gold_rows((0.5, 0.6), (0.9, 0.6))[:2], "ppo", "sft", cfg) == ["gold: no row for ppo"]


def test_gold_config_problems(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("gold: {data: nowhere.jsonl, models: [base, rm], dtype: half}\n")
    with pytest.raises(ConfigError) as err:
        load_pipeline(str(path), [])
    assert err.value.problems == [
        "gold.data: 'nowhere.jsonl' is not a file",
        "gold.models: 'rm' not among base, pt, sft, ppo (rm is not a generator)",
        "gold.dtype: 'half' is not one of 'fp32', 'bf16', 'fp16', 'auto'",
    ]


# ---------------------------------------------------------------------------------------------
# End to end: the real stages on tiny models
# ---------------------------------------------------------------------------------------------

TINY_TRAIN = {
    "max_steps": 2,
    "batch_size": 2,
    "grad_accum": 1,
    "seq_length": 128,
    "eval_steps": 2,
    "eval_batches": 1,
    "precision": "fp32",
    "warmup": 0,
}


def tiny_data(tmp: Path) -> dict[str, dict]:
    """The first records of every sample file, in the sample's layout (both SFT tasks kept)."""
    sample = ROOT / "data" / "sample"
    for path in sample.rglob("*.jsonl"):
        target = tmp / "data" / path.relative_to(sample)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(path.read_text().splitlines(keepends=True)[:4]))
    d = tmp / "data"
    return {
        "pt": {"train": [str(d / "pt/train.jsonl")], "eval": [str(d / "pt/valid.jsonl")]},
        "sft": {"train": [str(d / "sft/train")], "eval": [str(d / "sft/valid")]},
        "rm": {"train": [str(d / "rm/train.jsonl")], "eval": [str(d / "rm/valid.jsonl")]},
        "ppo": {"train": [str(d / "ppo/train.jsonl")], "eval": [str(d / "ppo/valid.jsonl")]},
    }


def stage_yaml(stage: str) -> dict:
    """The shipped configs/<stage>.yaml (includes resolved), or {} (the stage's defaults) until it lands."""
    from pipeline.config import read_yaml

    path = ROOT / "configs" / f"{stage}.yaml"
    return read_yaml(path) if path.is_file() else {}


@pytest.mark.skipif(
    not all((ROOT / s).is_file() for s in STAGE_SCRIPTS_REAL), reason="the stage scripts have not all landed"
)
def test_real_stages_end_to_end_on_tiny_models(tmp_path, tiny_model_dir):
    data = tiny_data(tmp_path)
    root = tmp_path / "out"
    stage_overrides = {
        "ppo": {"generation": {"max_new_tokens": 6}, "train": {"batch_size": 2}, "ppo": {"mini_batch_size": 2}}
    }
    config = {
        "base_model": str(tiny_model_dir),
        "output_root": str(root),
        "finetuning": "lora",
        "all_stages": {"train": TINY_TRAIN, "lora": {"r": 4, "alpha": 8}, "model": {"dtype": "fp32"}},
        "stages": {
            s: {"config": stage_yaml(s), "data": data[s], "overrides": stage_overrides.get(s, {})} for s in STAGES
        },
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_driver(path, tmp_path / "unused.log")
    assert result.returncode == 0, result.stderr[-4000:]
    chain = {
        "pt": Path(tiny_model_dir).resolve(),
        "sft": root / "pt/merged",
        "rm": root / "sft/merged",
        "ppo": root / "sft/merged",
    }
    for stage, parent in chain.items():
        manifest = read_manifest(root / stage / "merged")
        assert manifest["parent_path"] == str(parent.resolve()) and manifest["parent_hash"] == weights_hash(parent), (
            stage
        )
        assert manifest["weights_hash"] == weights_hash(root / stage / "merged")
        assert manifest["tokenizer_hash"] == tokenizer_hash(tiny_model_dir)
    summary = json.loads((root / "summary.json").read_text())
    for key in (
        "pt_train_loss_first",
        "sft_eval_loss_last",
        "rm_eval_accuracy",
        "ppo_reward_first",
        "ppo_reward_last",
        "ppo_kl_last",
        "ppo_wall_seconds",
    ):
        assert isinstance(summary[key], (int, float)), key
    assert summary["final_model"] == str((root / "ppo/merged").resolve())
    assert {p.name for p in (root / "plots").iterdir()} >= {"losses.png", "rm.png", "ppo.png"}
    assert "| sft | `train/loss` |" in (root / "report.md").read_text()

    before = {
        s: ((root / s / "merged/manifest.json").stat().st_mtime_ns, weights_hash(root / s / "merged")) for s in STAGES
    }
    again = run_driver(path, tmp_path / "unused.log", "--report", "false")
    assert again.returncode == 0, again.stderr[-4000:]
    assert {
        s: ((root / s / "merged/manifest.json").stat().st_mtime_ns, weights_hash(root / s / "merged")) for s in STAGES
    } == before
    assert sum("skipped, already complete" in line for line in (root / "driver.log").read_text().splitlines()) == 4


# ---------------------------------------------------------------------------------------------
# Any chain of registered stages (the registry's StageInfo, not stage names in the driver)
# ---------------------------------------------------------------------------------------------

EXTRA_STAGES = {
    "dpo2": dict(
        parents=("sft", "pt"), judged=True, data_kind="preference", summary_keys=("train_loss_first", "eval_accuracy")
    ),
    "grpo2": dict(
        parents=("sft", "pt"), reward_model="optional", judged=True, data_kind="prompt", summary_keys=("reward_first",)
    ),
}


@pytest.fixture
def extra_registry(monkeypatch):
    """The registry with two more stages (a DPO-like and a GRPO-like one) and a pipeline config
    factory whose `stages` section has their entries: what registering a stage gives the driver."""
    import dataclasses

    import stages as registry
    from pipeline.tools.chain_config import StageEntry

    monkeypatch.setattr(
        registry,
        "STAGES",
        {**registry.STAGES, **{n: registry.StageInfo(f"{n}:X", **kw) for n, kw in EXTRA_STAGES.items()}},
    )
    names = list(registry.STAGES)
    cls = dataclasses.make_dataclass(
        "Stages", [(n, StageEntry, dataclasses.field(default_factory=StageEntry)) for n in names]
    )

    def make(chain, **kw):
        cfg = PipelineConfig(chain=list(chain), **kw)
        cfg.stages = cls()
        return cfg

    return make


def test_any_chain_plans_parents_and_reward_models(extra_registry, tmp_path):
    from pipeline.tools.chain import stage_argv, stage_reward_path

    cfg = extra_registry(["pt", "sft", "dpo2"], output_root=str(tmp_path))
    assert planned_stages(cfg, Selection()) == ["pt", "sft", "dpo2"] and cfg.problems() == []
    assert [parent_stage(cfg, s) for s in cfg.chain] == [None, "pt", "sft"]
    assert planned_stages(cfg, Selection(start="sft")) == ["sft", "dpo2"]
    cfg.stages.sft.enabled = False
    assert parent_stage(cfg, "dpo2") == "pt"
    # an optional reward model: the chain's RM when there is one, else none (no --reward_model.path)
    grpo = extra_registry(["pt", "sft", "grpo2"], output_root=str(tmp_path))
    assert grpo.problems() == [] and stage_reward_path(grpo, "grpo2") is None
    (tmp_path / "pt" / "merged").mkdir(parents=True)
    argv = stage_argv(grpo, "grpo2")
    assert "--reward_model.path" not in argv and argv[argv.index("--model.path") + 1] == str(
        (tmp_path / "sft/merged").resolve()
    )
    with_rm = extra_registry(["pt", "sft", "rm", "grpo2"], output_root=str(tmp_path))
    assert (
        stage_reward_path(with_rm, "grpo2") == (tmp_path / "rm/merged").resolve()
        and parent_stage(with_rm, "grpo2") == "sft"
    )
    assert stage_argv(with_rm, "grpo2")[-2:] == ["--reward_model.path", str((tmp_path / "rm/merged").resolve())]
    assert stage_reward_path(with_rm, "dpo2") is None  # DPO reads no reward model


def test_chain_problems(extra_registry):
    from pipeline.tools.chain_config import chain_order_problems

    assert chain_order_problems(["pt", "sft", "rm", "ppo"]) == []
    assert chain_order_problems(["pt", "dpo2", "sft"]) == ["chain: dpo2 comes before sft, which it builds on"]
    assert chain_order_problems(["pt", "grpo2", "rm"]) == ["chain: grpo2 comes before rm, which it builds on"]
    import stages as registry

    assert chain_order_problems(["pt", "nope", "pt"]) == [
        f"chain: 'nope' is not a registered stage ({', '.join(registry.STAGES)})",
        "chain: pt listed more than once",
    ]
    assert list(registry.STAGES)[-2:] == ["dpo2", "grpo2"]
    assert chain_order_problems([]) == ["chain: names no stage"]
    cfg = extra_registry(["pt", "sft", "ppo"])
    cfg.stages.dpo2.overrides = {"train": {"max_steps": 1}}  # configured, but the chain does not run it
    assert cfg.problems() == [
        "stages.dpo2: configured but not in chain (pt, sft, ppo); add it to chain or remove it",
        "reward_model: PPO needs a reward model; put rm in chain before ppo or set reward_model",
    ]
    assert extra_registry(["pt", "sft", "ppo"], reward_model="/some/rm").problems() == []
    gold = extra_registry(["pt", "sft", "dpo2"])
    gold.gold.models = ["base", "ppo", "dpo2"]
    assert gold.problems() == ["gold.models: 'ppo' not among base, pt, sft, dpo2"]


def test_selection_outside_the_chain_is_refused(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("chain: [pt, sft]\n")
    with pytest.raises(ConfigError) as err:
        load_pipeline(str(path), ["--only", "rm"])
    assert err.value.problems == [f"rm: selected on the command line but not in the chain (pt, sft) of {path}"]
    cfg, _ = load_pipeline(str(path), [])
    assert planned_stages(cfg, Selection()) == ["pt", "sft"]


def test_summary_verdict_and_gold_rows_follow_the_chain(extra_registry, tmp_path, monkeypatch):
    """A pt -> sft -> dpo-like chain: figures from the registry's summary keys, no RM check, the
    gold table of base, sft and the judged stage, the verdict on the judged stage against SFT."""
    from pipeline.tools import driver

    cfg = extra_registry(["pt", "sft", "dpo2"], output_root=str(tmp_path), gold=GoldConfig(data=str(GOLD_SAMPLE)))
    for stage in ("pt", "sft", "dpo2"):
        (tmp_path / stage / "merged").mkdir(parents=True)
        (tmp_path / stage / "merged" / "manifest.json").write_text("{}")
        (tmp_path / stage / "summary.json").write_text(
            json.dumps({"train_loss_first": 2.0, "eval_accuracy": 0.75, "reward_first": 9.0})
        )
    monkeypatch.setattr(driver, "resolve_base", lambda path: Path("/base"))
    assert driver.gold_models(cfg, ["pt", "sft", "dpo2"]) == [
        ("base", "/base"),
        ("sft", str((tmp_path / "sft/merged").resolve())),
        ("dpo2", str((tmp_path / "dpo2/merged").resolve())),
    ]
    cfg.gold.models = ["base", "pt", "dpo2"]  # the judged stage's parent is always added
    assert [name for name, _ in driver.gold_models(cfg, ["pt", "sft", "dpo2"])] == ["base", "pt", "sft", "dpo2"]
    rows = lambda models: [
        {
            "model": m,
            "phrase_rate": 0.9 if m == "dpo2" else 0.1,
            "fact_accuracy": 0.8,
            "n": 4,
            "path": "",
            "cached": True,
        }
        for m, _ in models
    ]  # noqa: E731
    monkeypatch.setattr(driver, "gold_table", lambda models, *a, **k: rows(models))
    summary = driver.pipeline_summary(cfg)
    assert summary["verdict"] == "PASS" and summary["verdict_reasons"] == []
    assert summary["gold"]["rl"] == "dpo2" and summary["gold"]["reference"] == "sft" and summary["reward_model"] is None
    assert (
        summary["dpo2_eval_accuracy"] == 0.75
        and "dpo2_reward_first" not in summary
        and "pt_eval_accuracy" not in summary
    )
    assert summary["final_model"] == str((tmp_path / "dpo2/merged").resolve())
    text = driver.format_summary(summary)
    # the final model of this output root (the demo printed outputs/demo's whatever --output_root said)
    compare = f"compare the base and final models: relay chat --model {cfg.base_model} --compare {tmp_path.resolve()}"
    assert f"{compare}/dpo2/merged" in text.splitlines()
    from pipeline.tools import chat, cli

    words = shlex.split(summary["compare"])  # the command `relay chat` itself reads
    assert words[:2] == ["relay", "chat"] and "chat" in cli.COMMANDS
    args = chat.parse_args(words[2:])
    assert (args.model, args.compare) == (cfg.base_model, summary["final_model"])
    assert (
        "dpo2: train loss 2.0000 -> n/a" in text
        and "dpo2: held-out accuracy 0.7500" in text
        and "verdict: the dpo2 model against the sft model" in text
    )
    (tmp_path / "dpo2" / "summary.json").unlink()
    assert driver.pipeline_summary(cfg)["verdict_reasons"] == ["DPO2 did not run"]
    # A chain without a stage the verdict reads, every stage finished: the reason says so (it read
    # "SFT did not run" after SFT had finished).
    sft_only = extra_registry(["pt", "sft"], output_root=str(tmp_path))
    (reason,) = driver.pipeline_summary(sft_only)["verdict_reasons"]
    assert reason.startswith("nothing to judge: the chain has none of the stages a verdict reads (RM, PPO,"), reason


def test_report_plots_follow_the_registry(tmp_path, monkeypatch):
    """A registered stage's declared panels become its plot; its tags head the curve table."""
    from torch.utils.tensorboard import SummaryWriter

    import stages as registry
    from pipeline.tools.report import write_report

    info = registry.StageInfo(
        "x:Y",
        plot=("dpo2", "DPO-like", (registry.Panel("rewards", "implicit reward", {"chosen": "dpo2/rewards_chosen"}),)),
    )
    monkeypatch.setattr(registry, "STAGES", {**registry.STAGES, "dpo2": info})
    writer = SummaryWriter(log_dir=str(tmp_path / "dpo2/runs/a"))
    for step in (1, 2):
        writer.add_scalar("train/loss", 1.0 / step, step)
        writer.add_scalar("dpo2/rewards_chosen", 0.1 * step, step)
    writer.close()
    text = write_report(tmp_path).read_text()
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["dpo2.png", "losses.png"]
    assert "| dpo2 | `dpo2/rewards_chosen` | 2 | 0.1000 | 0.2000 |" in text


def test_fake_dpo_chain_runs_judges_and_reports(tmp_path, tiny_model_dir):
    """chain: [pt, sft, dpo] through the bash driver: DPO starts from SFT with no reward model, the
    summary carries its registry figures, the gold table and verdict judge DPO against SFT."""
    config, root, fake_log = write_fake_config(tmp_path, tiny_model_dir, gold=True)
    data = yaml.safe_load(config.read_text())
    (tmp_path / "scripts" / "dpo.py").write_text(FAKE_STAGE)
    data["chain"] = ["pt", "sft", "dpo"]
    data["stages"] = {s: data["stages"][s] for s in ("pt", "sft")}
    data["stages"]["dpo"] = {"script": str(tmp_path / "scripts" / "dpo.py"), "overrides": {"train": {"max_steps": 3}}}
    data["gold"]["models"] = ["base", "dpo"]
    config.write_text(yaml.safe_dump(data))
    result = run_driver(config, fake_log)
    assert result.returncode == 0, result.stderr
    assert ran(fake_log) == ["pretrain", "sft", "dpo"]
    manifest = read_manifest(root / "dpo/merged")
    assert manifest["parent_path"] == str((root / "sft/merged").resolve())
    calls = {json.loads(line)["stage"]: json.loads(line)["argv"] for line in fake_log.read_text().splitlines()}
    assert "--reward_model.path" not in calls["dpo"]
    summary = json.loads((root / "summary.json").read_text())
    assert summary["dpo_train_loss_last"] == 1.0 and summary["final_model"] == str((root / "dpo/merged").resolve())
    assert summary["reward_model"] is None and "rm_eval_accuracy" not in summary
    gold = summary["gold"]
    assert [r["model"] for r in gold["rows"]] == ["base", "sft", "dpo"] and (gold["rl"], gold["reference"]) == (
        "dpo",
        "sft",
    )
    assert summary["verdict_reasons"] == [
        "gold: the dpo model's phrase rate 0.000 is not above the sft model's 0.000 by 0.2 (gain +0.000)"
    ]
    assert (
        "dpo: train loss 3.0000 -> 1.0000" in result.stdout
        and "verdict: the dpo model against the sft model" in result.stdout
    )
    assert "| dpo | `train/loss` |" in (root / "report.md").read_text()
    again = run_driver(config, fake_log, "--report", "false")
    assert again.returncode == 0 and ran(fake_log) == ["pretrain", "sft", "dpo"]


@pytest.mark.skipif(not (ROOT / "stages/dpo.py").is_file(), reason="the DPO stage has not landed")
def test_real_sft_then_dpo_on_tiny_models(tmp_path, tiny_model_dir):
    data = tiny_data(tmp_path)
    root = tmp_path / "out"
    config = {
        "base_model": str(tiny_model_dir),
        "output_root": str(root),
        "chain": ["sft", "dpo"],
        "finetuning": "lora",
        "report": False,
        "all_stages": {"train": TINY_TRAIN, "lora": {"r": 4, "alpha": 8}, "model": {"dtype": "fp32"}},
        "stages": {
            "sft": {"config": stage_yaml("sft"), "data": data["sft"]},
            "dpo": {
                "config": stage_yaml("dpo"),
                "data": data["rm"],
                "overrides": {"dpo": {"precompute_ref_log_probs": True}},
            },
        },
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_driver(path, tmp_path / "unused.log")
    assert result.returncode == 0, result.stderr[-4000:]
    for stage, parent in (("sft", Path(tiny_model_dir).resolve()), ("dpo", root / "sft/merged")):
        manifest = read_manifest(root / stage / "merged")
        assert manifest["parent_path"] == str(parent.resolve()) and manifest["parent_hash"] == weights_hash(parent), (
            stage
        )
        assert manifest["tokenizer_hash"] == tokenizer_hash(tiny_model_dir)
    summary = json.loads((root / "summary.json").read_text())
    for key in (
        "dpo_train_loss_first",
        "dpo_train_loss_last",
        "dpo_eval_accuracy",
        "dpo_eval_margin",
        "dpo_wall_seconds",
    ):
        assert isinstance(summary[key], (int, float)), key
    assert summary["dpo_eval_loss_first"] == pytest.approx(
        0.6931, abs=1e-3
    )  # policy == reference before the first step
    assert summary["final_model"] == str((root / "dpo/merged").resolve())


def test_a_stage_that_stops_on_its_config_says_to_fix_it_not_to_rerun(tmp_path):
    """A stage that exits on problems in its config or data (listed above the driver's line) is not
    continued by a rerun: the driver's line says to fix them (it said "rerun the same command to
    continue" as after a signal); a stop by a signal still says where the rerun continues from."""
    from pipeline.engine.launch import CONFIG_PROBLEMS
    from pipeline.tools import driver

    path = tmp_path / "p.yaml"
    path.write_text(f"chain: [pt, sft]\noutput_root: {tmp_path / 'out'}\n")
    cfg, _ = load_pipeline(str(path), [])
    driver.cmd_stopped(cfg, "sft", CONFIG_PROBLEMS)
    driver.cmd_stopped(cfg, "sft", 143)
    lines = (tmp_path / "out" / "driver.log").read_text().splitlines()
    assert lines[-2].endswith(
        "sft: its config or data has the problems listed above; fix them and rerun the same command"
    )
    assert lines[-1].endswith("sft: stopped by SIGTERM; it has no checkpoint yet; rerun the same command to continue")


def test_a_stage_stopped_by_relay_stop_after_step_ends_the_pipeline_quietly(tmp_path, tiny_model_dir):
    """RELAY_STOP_AFTER_STEP saves a checkpoint and exits 0 without merging, by design; the driver
    read the missing merged/ as a failed stage ("output checks failed", exit 1). Now it says where
    the stage stopped, exits 0, and the rerun continues."""
    config, root, fake_log = write_fake_config(tmp_path, tiny_model_dir, report=False)
    done = run_driver(config, fake_log, RELAY_STOP_AFTER_STEP="2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert ran(fake_log) == [SCRIPT_NAMES["pt"]]
    checkpoint = root / "pt" / "checkpoints" / "step-0000002"
    assert (
        f"pt: stopped after step 2 (RELAY_STOP_AFTER_STEP); its last checkpoint is {checkpoint}; rerun the same "
        "command (without it) to continue" in (root / "driver.log").read_text()
    )
    again = run_driver(config, fake_log)
    assert again.returncode == 0, again.stderr[-2000:]
    assert ran(fake_log) == [SCRIPT_NAMES[s] for s in ("pt", *STAGES)]


def test_from_and_only_check_the_stages_before_them_and_a_stale_summary_is_not_written(tmp_path, tiny_model_dir):
    """pipeline.md: with --from / --only the stages before must be finished, and a stale output is
    never built on. `--from sft` after PT's config changed skipped every stage and wrote a summary
    and verdict (a plain run refused); `--only pt` rebuilding PT wrote a summary pairing the new PT
    with the SFT, RM and PPO built on the old one. And a key that never changes the trained weights
    (checkpoint.resume_changed, which resume.md has users add to resume) no longer makes a finished
    stage stale."""
    config, root, fake_log = write_fake_config(tmp_path, tiny_model_dir, report=False)
    assert run_driver(config, fake_log).returncode == 0
    changed = ("--stages.pt.overrides", "{train: {max_steps: 3, learning_rate: 0.001}}")
    refused = run_driver(config, fake_log, "--from", "sft", *changed)
    assert refused.returncode == 1 and "pt/merged was built with the config in" in refused.stderr, refused.stderr
    shutil.rmtree(root / "pt")
    summary = (root / "summary.json").read_bytes()
    rebuilt = run_driver(config, fake_log, "--only", "pt", *changed, FAKE_SEED="1")  # new weights, as retraining gives
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    assert (root / "summary.json").read_bytes() == summary  # not rewritten over stale stages
    assert "summary: not written, since" in (root / "driver.log").read_text()
    neutral = ("--stages.sft.overrides", "{train: {max_steps: 3}, checkpoint: {resume_changed: true}}")
    shutil.rmtree(root), fake_log.unlink()
    assert run_driver(config, fake_log, *neutral).returncode == 0
    again = run_driver(config, fake_log)
    assert again.returncode == 0 and ran(fake_log) == [SCRIPT_NAMES[s] for s in STAGES], again.stderr[-2000:]


def test_a_finished_stage_whose_training_data_changed_is_stale(tmp_path, tiny_model_dir):
    """A finished stage whose data.train files were edited was reused ("skipped, already
    complete"): its manifest records what it trained on (data_digest, as a checkpoint's identity
    does), and the driver refuses to build on it."""
    config, root, fake_log = write_fake_config(tmp_path, tiny_model_dir, report=False)
    data = tmp_path / "sft.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    chosen = ("--stages.sft.data", f"{{train: [{data}]}}")
    assert run_driver(config, fake_log, *chosen).returncode == 0
    assert run_driver(config, fake_log, *chosen).returncode == 0  # unchanged: reused
    data.write_text(data.read_text().replace('"b"', '"c"'))
    stale = run_driver(config, fake_log, *chosen)
    assert stale.returncode == 1 and "its training data (data.train's files) changed" in stale.stderr, stale.stderr
