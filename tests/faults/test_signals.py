"""SIGTERM / SIGINT (issue 12, point 1): the stage finishes the step it is in (its evaluation, its
PPO generation), every rank stops at the same step boundary with one complete checkpoint, the
process exits 128 + the signal with one line, and the restart's later losses equal an unbroken
run's. Also as a real process, and under the launcher with SIGTERM to one rank of two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from forkserver import python_for_tests
from stagerun import run_stage
from test_pt_sft import fresh_accelerate_state, run_sft, sft_args, write_sft  # noqa: F401 (autouse fixture)

from pipeline.engine.interrupt import Stopped

ROOT = Path(__file__).resolve().parents[2]


def test_sigterm_stops_at_the_step_boundary_and_the_restart_matches_an_unbroken_run(tiny_model_dir, tmp_path):
    train, valid = write_sft(tmp_path / "data", 10, 4)
    args = ["--train.max_steps", "5", "--train.eval_steps", "0"]
    unbroken = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "a", *args))
    from stagerun import recording

    from stages.sft import SFTStage

    def kill_at_2(stage, record):
        if stage.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Stopped) as stopped:
        run_stage(recording(SFTStage), sft_args(tiny_model_dir, train, valid, tmp_path / "b", *args), on_step=kill_at_2)
    checkpoint = tmp_path / "b" / "checkpoints" / "step-0000002"
    assert (
        str(stopped.value)
        == f"stopped by SIGTERM at step 2; checkpoint {checkpoint}; rerun the same command to continue"
    )
    assert stopped.value.exit_code == 143 and (checkpoint / ".complete").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers given back
    resumed = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "b", *args))
    assert len(resumed.batch_ids) == 3 and resumed.batch_ids == unbroken.batch_ids[2:]
    assert [r["train/loss"] for r in resumed.history.steps] == [r["train/loss"] for r in unbroken.history.steps]


def test_sigint_during_evaluation_finishes_it_saves_and_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    from stages.sft import SFTStage

    train, valid = write_sft(tmp_path / "data", 10, 4)
    args = ["--train.max_steps", "4", "--train.eval_steps", "2"]
    unbroken = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "a", *args))
    real, calls = SFTStage.evaluate, {"n": 0}

    def interrupted_evaluate(self):
        calls["n"] += 1
        if calls["n"] == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the step-2 evaluation
        return real(self)

    monkeypatch.setattr(SFTStage, "evaluate", interrupted_evaluate)
    with pytest.raises(Stopped, match="stopped by SIGINT at step 2") as stopped:
        run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "b", *args))
    assert stopped.value.exit_code == 130
    monkeypatch.setattr(SFTStage, "evaluate", real)
    resumed = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "b", *args))
    assert resumed.history.evals == unbroken.history.evals  # the step-2 evaluation completed before the save
    assert [r["train/loss"] for r in resumed.history.steps] == [r["train/loss"] for r in unbroken.history.steps]


def test_sigterm_during_ppo_generation(tiny_model_dir, tiny_reward_dir, tmp_path, monkeypatch):
    from stages import ppo

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(8)))

    def cfg(out):
        c = ppo.PPOConfig(output_dir=str(out))
        c.model.path, c.reward_model.path = str(tiny_model_dir), str(tiny_reward_dir)
        c.data.train, c.data.eval = [str(prompts)], []
        c.train.max_steps, c.train.eval_steps, c.train.batch_size, c.lora.r = 3, 0, 4, 4
        c.train.lr_schedule, c.train.warmup, c.train.learning_rate = "constant", 0, 5e-3
        c.generation.max_new_tokens, c.tracking.trackers = 4, []
        return c

    def record(into):
        return lambda st, m: into.__setitem__(st.step, (m["ppo/reward_raw"], st.last_experience.rollout.responses))

    unbroken = {}
    run_stage(ppo.PPOStage, cfg(tmp_path / "a"), on_step=record(unbroken))
    real, calls = ppo.PPOStage.rollout, {"n": 0}

    def rollout(self, prompts):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 2 generates
        return real(self, prompts)

    monkeypatch.setattr(ppo.PPOStage, "rollout", rollout)
    before, after = {}, {}
    with pytest.raises(Stopped, match="stopped by SIGTERM at step 2"):
        run_stage(ppo.PPOStage, cfg(tmp_path / "b"), on_step=record(before))
    monkeypatch.setattr(ppo.PPOStage, "rollout", real)
    run_stage(ppo.PPOStage, cfg(tmp_path / "b"), on_step=record(after))
    assert sorted(before) == [1, 2] and sorted(after) == [3]
    assert {**before, **after} == unbroken


def _env():
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "RELAY_LOG_LEVEL": "WARNING",
    }


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _relay_lines(stderr: str) -> list[str]:
    """stderr without progress bars and log records."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip() and "%|" not in line and " WARNING " not in line and " INFO " not in line
    ]


def test_a_real_process_stops_on_sigterm_with_one_line_and_the_rerun_continues(tiny_model_dir, tmp_path):
    train, valid = write_sft(tmp_path / "data", 10, 4)
    out = tmp_path / "sft"

    def cmd(steps):
        return [
            python_for_tests(),
            str(ROOT / "stages" / "sft.py"),
            *sft_args(
                tiny_model_dir,
                train,
                valid,
                out,
                "--train.max_steps",
                str(steps),
                "--train.eval_steps",
                "0",
                "--tracking.trackers",
                "[]",
            ),
        ]

    # Started as a user starts it: `relay train` becomes the stage, so the signal reaches the stage
    # (run as relay's child, the stage went on alone once SIGTERM had ended relay).
    relay = [str(Path(sys.executable).with_name("relay")), "train", "--stage", "sft", *cmd(400)[2:]]
    proc = subprocess.Popen(relay, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "config.yaml", proc)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    (line,) = _relay_lines(stderr)
    step = int(line.split(" at step ")[1].split(";")[0])
    assert 0 < step < 400
    assert (
        line == f"sft: stopped by SIGTERM at step {step}; checkpoint {out / 'checkpoints' / f'step-{step:07d}'}; "
        "rerun the same command to continue"
    )
    done = subprocess.run(cmd(step + 2), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 2


def _started_with(process: psutil.Process, **variables: str) -> bool:
    """Whether `process` was started with these environment variables (its environment at exec)."""
    try:
        environ = process.environ()
    except (psutil.Error, OSError):
        return False
    return all(environ.get(k) == v for k, v in variables.items())


def test_sigterm_to_one_rank_of_two_stops_both_at_the_same_step(tiny_model_dir, tmp_path):
    train, valid = write_sft(tmp_path / "data", 10, 4)
    out = tmp_path / "sft"
    cmd = [
        python_for_tests(),
        "-m",
        "pipeline.engine.launch",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29561",
        str(ROOT / "stages" / "sft.py"),
        *sft_args(
            tiny_model_dir,
            train,
            valid,
            out,
            "--train.max_steps",
            "400",
            "--train.eval_steps",
            "0",
            "--tracking.trackers",
            "[]",
            "--train.batch_size",
            "1",
        ),
    ]
    env = {**_env(), "PYTHONPATH": str(ROOT), "RELAY_TEST_MARK": str(tmp_path)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "config.yaml", proc)
    time.sleep(4)
    rank1 = [p for p in psutil.process_iter() if _started_with(p, RELAY_TEST_MARK=str(tmp_path), RANK="1")]
    assert len(rank1) == 1  # the rank torchrun started (forked: its client, which passes the signal on)
    rank1[0].send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr
    lines = _relay_lines(stderr)
    assert lines[0].startswith("sft: stopped by SIGTERM at step ") and lines[0].endswith(
        "rerun the same command to continue"
    )
    assert lines[-1].startswith("launch: rank ") and "stopped by SIGTERM" in lines[-1]
    step = int(lines[0].split(" at step ")[1].split(";")[0])
    saved = out / "checkpoints" / f"step-{step:07d}"
    assert sorted(p.name for p in saved.glob("rng-rank*.json")) == [
        "rng-rank0.json",
        "rng-rank1.json",
    ]  # both ranks, one step
    assert [p.name for p in (out / "checkpoints").iterdir()] == [saved.name]


SLEEPER = '''
"""A stand-in stage that waits; on SIGTERM it saves a "checkpoint" and exits as Relay's stages do."""
import os, signal, sys, time
from pathlib import Path

args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
out = Path(args["--output_dir"])


def stop(signum, frame):
    (out / "checkpoints" / "step-0000003").mkdir(parents=True)
    (out / "checkpoints" / "step-0000003" / ".complete").write_text("{}")
    print("sft: stopped by SIGTERM at step 3; ...", file=sys.stderr)
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, stop)
out.mkdir(parents=True, exist_ok=True)
(out / "ready").write_text("")
time.sleep(120)
'''


@pytest.mark.parametrize("entry", ["script", "relay pipeline"])
def test_the_driver_forwards_sigterm_and_records_which_stage_stopped(tmp_path, tiny_model_dir, entry):
    """SIGTERM to the driver script, or to `relay pipeline` (which becomes the script: as its
    child, the script and the stage went on alone once the signal had ended relay)."""
    from test_driver import write_fake_config

    config, root, fake_log = write_fake_config(tmp_path, tiny_model_dir, report=False)
    (tmp_path / "scripts" / "sft.py").write_text(SLEEPER)
    env = {**_env(), "FAKE_LOG": str(fake_log), "PYTHON": python_for_tests()}
    script = ["bash", str(ROOT / "run_scripts/run_pipeline.sh")]
    command = script if entry == "script" else [str(Path(sys.executable).with_name("relay")), "pipeline"]
    proc = subprocess.Popen(
        [*command, str(config)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(root / "sft" / "ready", proc)
    proc.send_signal(signal.SIGTERM)  # to the script only, as a scheduler would
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    log = (root / "driver.log").read_text()
    assert (
        f"sft: stopped by SIGTERM; its last checkpoint is {root / 'sft' / 'checkpoints' / 'step-0000003'}; "
        f"rerun the same command to continue" in log
    )
    assert not (root / "rm").exists()  # nothing after the stopped stage ran


def test_a_sigterm_between_stages_stops_the_pipeline_before_the_next(tmp_path, tiny_model_dir):
    """A SIGTERM that reaches the script while the driver works between stages (no stage to forward
    it to) was dropped: the pipeline ran on to its end and exited 0. Now the next stage does not
    start: exit 143, a line in driver.log, and the rerun continues. (The driver's `finish` of PT is
    held for a moment so the signal lands there.)"""
    from test_driver import SCRIPT_NAMES, STAGES, ran, write_fake_config

    config, root, fake_log = write_fake_config(tmp_path, tiny_model_dir, report=False)
    marker, python = tmp_path / "in-finish", python_for_tests()
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$*" == *"pipeline.tools.driver finish "*" pt"* ]]; then touch {marker}; sleep 3; fi\n'
        f'exec {python} "$@"\n'
    )
    wrapper.chmod(0o755)
    env = {**_env(), "FAKE_LOG": str(fake_log), "PYTHON": str(wrapper)}
    command = ["bash", str(ROOT / "run_scripts/run_pipeline.sh"), str(config)]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(marker, proc)
    proc.send_signal(signal.SIGTERM)  # to the script only, as a scheduler would
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert ran(fake_log) == [SCRIPT_NAMES["pt"]]
    log = (root / "driver.log").read_text()
    assert "pt: finished" in log and "pipeline: stopped by SIGTERM between stages; rerun the same command" in log
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert ran(fake_log) == [SCRIPT_NAMES[s] for s in STAGES]
