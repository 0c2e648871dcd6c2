"""Smoke tests of the benchmark harness: every comparison in bench/comparisons runs `--quick`
(a tiny random model, a few steps) and appends one well-formed row; bench/scaling.py --quick
writes its section, points and PNG. The figures are never checked (speed lives in bench/, never
in timed tests); the equal-work check (same first loss on both sides) is, since a row is only
written when it holds.

A quick row runs both sides in the harness's own process (the ppo peer in its own environment), and
every comparison's quick run shares one process here (`quick_runs`), forked from the tests'
preloaded interpreter (tests/forkserver.py) as the scaling run and the GPU check's script are: the
imports are paid once, not once per comparison. One case per comparison runs."""

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from forkserver import python_for_tests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

COMPARISONS = sorted(p.stem for p in (ROOT / "bench" / "comparisons").glob("*.py") if not p.stem.startswith("_"))


def run(args, tmp_path, timeout=300):
    """`args` run by the project's interpreter (forked from the tests' preloaded one: tests/forkserver.py)."""
    return subprocess.run(
        [python_for_tests(), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )


def test_every_comparison_is_smoke_tested():
    assert {"sft", "ppo", "dpo", "grpo"} <= set(COMPARISONS)


QUICK_RUNS = """
import contextlib, io, json, sys, traceback
sys.path.insert(0, sys.argv[1])
import run
out = {}
for name, argv in json.loads(sys.argv[2]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = run.main(argv)
        except BaseException:
            traceback.print_exc()
            code = 99
    out[name] = {"returncode": code, "stderr": err.getvalue()}
print(json.dumps(out))
"""
"""Each comparison's `bench/run.py` main, one after another in one process (its stderr kept apart)."""


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """{name: (returncode, stderr, results file, case) or a skip reason}: every comparison's quick
    run of its first case, all in one process with one thread."""
    import importlib

    root, jobs, done = tmp_path_factory.mktemp("quick"), {}, {}
    for name in COMPARISONS:
        module = importlib.import_module(f"bench.comparisons.{name}")
        if module.PEER_PYTHON == "trl-1.12":
            try:
                harness.ensure_trl_112()
            except harness.HarnessError as error:  # no package registry reachable: nothing to compare against
                done[name] = str(error)
                continue
        case = module.cases(True)[0]["case"]
        results = root / name / "RESULTS.md"
        results.parent.mkdir()
        results.write_text("# Benchmarks\n\n## Other section\nkept\n")
        jobs[name] = (case, results)
    argv = {
        name: [name, "--quick", "--case", case, "--threads", "1", "--results", str(results)]
        + ["--workdir", str(results.parent / "work")]
        for name, (case, results) in jobs.items()
    }
    proc = run(["-c", QUICK_RUNS, str(ROOT / "bench"), json.dumps(argv)], root, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (case, results) in jobs.items():
        done[name] = (ran[name]["returncode"], ran[name]["stderr"], results, case)
    return done


@pytest.mark.parametrize("name", COMPARISONS)
def test_quick_comparison_appends_one_well_formed_row(name, quick_runs):
    import importlib

    module = importlib.import_module(f"bench.comparisons.{name}")
    if isinstance(quick_runs[name], str):
        pytest.skip(quick_runs[name])
    returncode, stderr, results, case = quick_runs[name]
    assert returncode == 0, stderr[-2000:]
    text = results.read_text()
    assert "## Other section\nkept\n" in text and text.count(harness.SECTION) == 1
    rows = [line for line in text.splitlines() if line.startswith("| 20")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert len(cells) == harness.HEADER.count("|") - 1
    date, comparison, label, ours, theirs, time_ratio, our_rss, their_rss, rss_ratio, loss, machine, versions = cells
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date) and comparison == name and label == f"{case} (quick)"
    unit = re.escape(module.UNIT)
    assert re.fullmatch(rf"[\d,.]+ {unit}", ours) and re.fullmatch(rf"{re.escape(module.PEER)}: [\d,.]+ {unit}", theirs)
    assert re.fullmatch(r"\d+\.\d\dx", time_ratio) and re.fullmatch(r"\d+\.\d\dx", rss_ratio)
    assert float(our_rss) > 0 and float(their_rss) > 0
    if module.LOSS_TOLERANCE is not None:
        a, b = (float(x) for x in loss.split(" / "))
        assert abs(a - b) <= module.LOSS_TOLERANCE
    assert "cores" in machine and "Relay: torch" in versions and "peer: torch" in versions
    detail = [json.loads(line) for line in results.with_suffix(".jsonl").read_text().splitlines()]
    assert len(detail) == 1 and detail[0]["relay"]["step_seconds"] and detail[0]["peer"]["step_seconds"]


def test_a_row_is_refused_when_the_two_sides_do_not_do_equal_work(tmp_path, monkeypatch):
    """The harness compares first losses before it records anything."""
    sys.path.insert(0, str(ROOT / "bench"))
    import run as bench_run

    fake = type(sys)("bench.comparisons.fake")
    fake.PEER, fake.PEER_PYTHON, fake.UNIT, fake.LOSS_TOLERANCE = "Peer", "relay", "s/step", 1e-4
    fake.cases = lambda quick: [{"case": "c", "warmup": 0}]
    results = iter([harness.SideResult(2.0, [1.0], 100.0), harness.SideResult(2.5, [1.0], 100.0)])
    monkeypatch.setattr(bench_run, "comparison", lambda name: fake)
    monkeypatch.setattr(bench_run, "side", lambda *a, **k: next(results))
    monkeypatch.setattr(harness, "quick_model", lambda workdir: tmp_path)
    out = tmp_path / "R.md"
    assert bench_run.main(["fake", "--quick", "--results", str(out), "--workdir", str(tmp_path)]) == 1
    assert not out.exists()


def test_a_quick_side_runs_in_this_process_when_its_interpreter_is_this_environments(monkeypatch):
    """`--quick` runs a side in the harness's own process when the side's interpreter belongs to this
    environment (the project's .venv), whatever path started this process (the tests' forked
    interpreter is a client script); another environment's interpreter (the TRL 1.12 one) gets a
    process of its own."""
    import types

    sys.path.insert(0, str(ROOT / "bench"))
    import run as bench_run

    monkeypatch.setattr(sys, "executable", "/tmp/some-launcher/python")
    monkeypatch.setattr(sys, "prefix", str(harness.PYTHONS["relay"].parent.parent))
    spawned = []
    monkeypatch.setattr(harness, "run_side", lambda *a: spawned.append(a[-1]) or "own process")
    module = types.SimpleNamespace(relay=lambda case, env: "in process", peer=lambda case, env: "in process")
    quick = types.SimpleNamespace(quick=True, name="fake")
    assert bench_run.side(quick, module, "relay", {}, None, harness.PYTHONS["relay"]) == "in process"
    assert bench_run.side(quick, module, "peer", {}, None, harness.PYTHONS["trl-1.12"]) == "own process"
    full = types.SimpleNamespace(quick=False, name="fake")
    assert bench_run.side(full, module, "relay", {}, None, harness.PYTHONS["relay"]) == "own process"
    assert spawned == [harness.PYTHONS["trl-1.12"], harness.PYTHONS["relay"]]


def test_quick_scaling_writes_its_section_points_and_plot(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = run(
        ["bench/scaling.py", "--quick", "--threads", "1", "--results", str(results), "--workdir", str(tmp_path / "w")],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = results.read_text()
    assert "## How cost grows" in text and "R^2" in text
    points = json.loads((tmp_path / "scaling.json").read_text())
    assert points
    png = (tmp_path / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unknown_case_is_one_line_before_anything_runs(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import run as bench_run

    out = tmp_path / "R.md"
    assert (
        bench_run.main(
            ["sft", "--quick", "--case", "lora-padin", "--results", str(out), "--workdir", str(tmp_path / "w")]
        )
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench/run.py: sft has no case lora-padin in --quick; its cases: lora-padding, lora-packing"]
    assert not out.exists() and not (tmp_path / "w").exists()


def test_demo_backends_goal_and_vllm_grpo_ratio_are_read_from_the_figures():
    """bench/demo_backends.py's goal check (issue 34: verdict PASS, PPO's gold phrase rate and fact
    accuracy within 0.05 of the relay backend's) and bench/vllm_grpo.py's step ratio, on hand-made figures."""
    from bench.demo_backends import goal_check, gold_rows
    from bench.vllm_grpo import against_relay

    summary = {
        "gold": {
            "rows": [
                {"model": "sft", "phrase_rate": 0.5, "fact_accuracy": 0.95, "n": 80},
                {"model": "ppo", "phrase_rate": 1.0, "fact_accuracy": 0.9375, "n": 80},
            ]
        }
    }
    relay = {"verdict": "PASS", "gold": gold_rows(summary)}
    assert relay["gold"]["ppo"] == {"phrase_rate": 1.0, "fact_accuracy": 0.9375}
    near = {"verdict": "PASS", "gold": {"ppo": {"phrase_rate": 0.975, "fact_accuracy": 0.9}}}
    assert goal_check(relay, near) == {
        "gaps": {"phrase_rate": 0.025, "fact_accuracy": 0.0375},
        "verdict": "PASS",
        "met": True,
    }
    assert not goal_check(relay, {**near, "verdict": "WARNING"})["met"]
    assert not goal_check(relay, {"verdict": "PASS", "gold": {"ppo": {"phrase_rate": 0.9, "fact_accuracy": 0.9375}}})[
        "met"
    ]
    assert goal_check(relay, {"verdict": "PASS", "gold": {}}) == {"met": False, "why": "no ppo gold row"}
    rows = [
        {"backend": "relay", "s_per_step": 4.0},
        {"backend": "hf", "s_per_step": 6.0},
        {"backend": "vllm", "s_per_step": 9.0},
    ]
    assert against_relay(rows) == {"hf_over_relay": 1.5, "vllm_over_relay": 2.25, "vllm_goal_2x": "missed"}
    assert against_relay(rows[1:]) == {}


def test_demo_backends_names_a_root_without_a_summary_in_one_line(tmp_path, capsys):
    from bench.demo_backends import main

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "a"), str(tmp_path / "b")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"bench/demo_backends.py: {tmp_path / 'b' / 'summary.json'}: not found (a finished demo root holds one)"
    ]


# ------------------------------------------------------------------------------------------
# The GPU check (run_scripts/gpu_check.sh, bench/gpu.py, bench/gpu_report.py), on this CPU
# ------------------------------------------------------------------------------------------


def test_the_gpu_checks_first_run_fits_its_window_and_puts_the_informative_parts_first():
    from bench import gpu

    first = gpu.selected("first")
    assert [p.name for p in first] == ["install", "sft-profile", "gpu-tests", "fsdp-tests", "decode"]
    assert gpu.run_budget(first, 1, {}) <= 480 and gpu.RUN_LIMIT_S == 480
    for run_name in gpu.RUNS:  # every run fits one window, on one GPU and on two
        assert max(gpu.run_budget(gpu.selected(run_name), n, {}) for n in (1, 2)) <= gpu.RUN_LIMIT_S, run_name
    # every part runs in some run, the install in each; a test file in exactly one part
    assert {p.run for p in gpu.PARTS} == {"every", *gpu.RUNS}
    assert [p.name for p in gpu.selected("fsdp-tests, decode")] == ["install", "fsdp-tests", "decode"]
    assert gpu.budget_of(gpu.selected("decode")[1], {"GPU_CHECK_S_DECODE": "12"}) == 12
    with pytest.raises(
        ValueError, match="GPU_CHECK_PARTS: fifth not known; runs: first, second, third, fourth; parts: install, "
    ):
        gpu.selected("fifth")
    two = [p for p in gpu.PARTS if p.gpus > 1]
    assert [p.tests for p in two] == ["tests/test_distributed_stages.py -k fsdp"]
    assert (
        gpu.run_budget(gpu.selected("second"), 1, {}) == gpu.run_budget(gpu.selected("second"), 2, {}) - two[0].budget_s
    )


def test_the_dry_run_prints_each_runs_budget_sum(tmp_path):
    proc = subprocess.run(
        ["bash", "run_scripts/gpu_check.sh", str(tmp_path / "x"), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr
    sums = re.findall(r"budget sum with 10 s of start-up: (\d+) s \(([\d.]+) min\) on one GPU", proc.stdout)
    assert len(sums) == len(("first", "second", "third", "fourth")) and int(sums[0][0]) <= 480, proc.stdout
    assert "first run:" in proc.stdout and "[needs 2 GPUs: not started on fewer]" in proc.stdout
    assert "trainer's [needs vLLM: not started without it]" in proc.stdout  # grpo-vllm
    over = subprocess.run(
        ["bash", "run_scripts/gpu_check.sh", str(tmp_path / "x"), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHON": sys.executable, "GPU_CHECK_S_DECODE": "400"},
    )
    assert over.returncode == 1 and "error: the first run's budgets add up to 790 s, over 480 s" in over.stderr


def test_the_report_is_written_after_each_part_and_says_what_was_cut_off(tmp_path):
    from bench import gpu_report

    state = gpu_report.State(tmp_path)
    state.start("NVIDIA H200", ["install", "sft-profile", "gpu-tests", "fsdp-2gpu-tests"], 470, False)
    state.record("install", "running", 0.0, 50)
    assert "| install | running | 0 | 50 |" in (tmp_path / "gpu_check.md").read_text()
    state.install(tmp_path / "no.log")
    state.record("install", "passed", 21.0, 50)
    text = (tmp_path / "gpu_check.md").read_text()
    assert "## GPU check, " in text and "NVIDIA H200" in text and "| install | passed | 21 | 50 |" in text
    assert re.search(r"Versions: torch [^,]+, transformers [^,]+, accelerate [^,]+, peft [^,]+,", text)
    assert re.search(r"Python 3\.\d+\.\d+ headers: (found|MISSING)", text)
    # a tests part cut off: what pytest reported (the test it interrupted as a nameless case, as
    # pytest 9 wrote it in the first GPU check), and what it collected but never finished or reached
    (tmp_path / "junit").mkdir()
    (tmp_path / "junit" / "gpu-tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu" '
        'name="test_a" time="3.0"/><testcase time="0.001" /></testsuite></testsuites>'
    )
    (tmp_path / "junit" / "gpu-tests.collected").write_text(
        "tests/test_gpu.py::test_a\ntests/test_gpu.py::test_b\ntests/test_gpu.py::test_c\n"
    )
    state.record("gpu-tests", "cut off", 130.0, 130)
    state.bench("sft-profile", {"shape": "qwen2.5-0.5b", "n_params": 494_032_768, "cut_off": "after 90 s (its budget)"})
    state.record("fsdp-2gpu-tests", "not run: needs 2 GPUs", 0.0, 60)
    text = (tmp_path / "gpu_check.md").read_text()
    assert (
        "| gpu-tests | cut off | 130 | 130 |" in text and "| fsdp-2gpu-tests | not run: needs 2 GPUs | 0 | 60 |" in text
    )
    assert "| tests/test_gpu.py::test_b | not run: the part's time budget ran out during this test | 0.0 |" in text
    assert "| tests/test_gpu.py::test_c | not run: the part's time budget was spent | 0.0 |" in text
    assert "None" not in text  # neither a nameless test nor a peak this device has not
    assert (
        "### Tests, gpu-tests: 1 passed, 0 failed, 0 not run (need 2 GPUs), 0 skipped; 2 not run (time budget)" in text
    )
    assert "- Relay SFT full fine-tuning (profiled): cut off after 90 s (its budget)" in text
    assert json.loads((tmp_path / "state.json").read_text())["parts"]["gpu-tests"]["status"] == "cut off"
    assert not list(tmp_path.glob(".*.tmp"))


def test_python_headers_are_looked_up_where_this_python_keeps_them(monkeypatch, tmp_path):
    from bench import gpu_report

    monkeypatch.setattr(gpu_report.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    missing = gpu_report.python_headers()
    assert missing["found"] is False and missing["path"] == str(tmp_path / "Python.h")
    assert "headers: MISSING" in gpu_report.headers_line(missing) and "-dev package" in gpu_report.headers_line(missing)
    (tmp_path / "Python.h").write_text("")
    assert gpu_report.python_headers()["found"] is True


def test_the_profile_breakdown_counts_each_kernel_once_by_category():
    from bench import gpu, gpu_report

    events = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 30.0),
        ("flash_fwd_kernel", 10.0),
        ("multi_tensor_apply_kernel<Adam>", 5.0),
        ("cunn_SoftMaxForward", 3.0),
        ("Memcpy HtoD (Pageable -> Device)", 1.0),
        ("vectorized_elementwise_kernel", 1.0),
    ]
    got = gpu.breakdown(events, step_ms=100.0, on_gpu=True)
    assert got["busy_ms"] == 50.0 and got["idle_share"] == 0.5
    assert {k: v["ms"] for k, v in got["categories"].items()} == {
        "matmul (GEMM)": 30.0,
        "attention": 10.0,
        "optimizer": 5.0,
        "softmax / cross-entropy": 3.0,
        "copies / casts / fills": 1.0,
        "norms / activations / elementwise": 1.0,
    }
    assert got["top"][0] == {"name": "sm90_xmma_gemm_bf16bf16_bf16f32", "ms": 30.0}
    assert gpu.breakdown(events, 100.0, on_gpu=False)["idle_share"] is None
    # names from the first GPU check's profile (torch 2.11, CUDA 13; bench/RESULTS.md): cuBLAS's GEMM,
    # and the profiler's spans over kernels listed on their own, which are not counted (also where
    # the event does not say it is an annotation: its name does)
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    h100 = [
        ("nvjet_sm90_tst_128x216_64x4_1x1_h_bz_coopA_NNT", 5490.0, False),
        ("Optimizer.step#AdamW.step", 5400.0, True),
        ("ProfilerStep#11", 20000.0, False),
        ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", 5210.0, False),
    ]
    averages = [
        SimpleNamespace(key=k, device_type=cuda, self_device_time_total=us, is_user_annotation=a) for k, us, a in h100
    ]
    seen = gpu.breakdown(gpu.profiled_events(SimpleNamespace(key_averages=lambda: averages), True), 20.0, True)
    assert {k: v["ms"] for k, v in seen["categories"].items()} == {"matmul (GEMM)": 5.49, "optimizer": 5.21}
    result = {
        "case": {"precision": "bf16", "seq_length": 2048, "batch_size": 16, "warmup": 2},
        "step_seconds": [4.15, 0.5, 1.9, 0.2, 0.3],
        "tokens_per_s": 51000.0,
        "s_per_step": 0.16,
        "mfu": 0.112,
        "gpu_peak_mb": 20480,
        "losses": [12.0, 11.5],
        "profile": got,
    }
    lines = gpu_report.profile_lines(result)
    assert lines[0].startswith(
        "- Relay SFT full fine-tuning, bf16, seq 2048 packed, 16 samples a step: 51,000 tok/s, 0.16 s/step, "
        "MFU 11.2%, peak 20.0 GiB"
    )
    assert (
        "One profiled step: 100.0 ms wall, 50.0 ms of GPU kernels, GPU idle 50.0% of the step (host-bound time)."
        in lines
    )
    assert "| matmul (GEMM) | 30.0 | 60.0% |" in lines
    assert (
        "- Seconds of each step (the first 2 not timed): [4.15, 0.5, 1.9, 0.2, 0.3]; median of the timed 0.300 s"
        in lines
    )


def test_the_vllm_part_is_not_started_without_vllm_and_reports_the_engine(tmp_path, monkeypatch):
    """grpo-vllm (GRPO sampling on a vLLM server) is reported as not run where vLLM is absent, the
    parts beside it run; its figures render as a line of the report (the values of a --tiny run on
    this CPU's vLLM environment)."""
    from bench import gpu, gpu_report

    ran = []
    monkeypatch.setattr(gpu, "vllm_python", lambda: None)
    monkeypatch.setattr(gpu, "run_part", lambda part, *args: ran.append(part.name) or ("passed", 0.0))
    assert gpu.check(tmp_path / "out", "grpo-vllm", None, True) == 0
    parts = json.loads((tmp_path / "out" / "state.json").read_text())["parts"]
    assert ran == ["install"]
    assert parts["grpo-vllm"]["status"] == "not run: vLLM is absent (bash run_scripts/install_vllm.sh)"
    monkeypatch.setattr(gpu, "vllm_python", lambda: "python")  # where it is installed the part runs
    assert gpu.check(tmp_path / "out", "grpo-vllm", None, True) == 0
    assert ran == ["install", "install", "grpo-vllm"]
    result = {
        "backend": "vllm",
        "start_s": 0.5,
        "s_per_step": 0.398,
        "step_seconds": [17.11, 0.399, 0.397],
        "generation_share": 0.548,
        "gpu_peak_mb": 2048,
        "logprob_diff_mean": [0.0012, 0.001],
        "logprob_diff_max": [0.05, 0.04],
    }
    lines = gpu_report.bench_section({"shape": "qwen2.5-0.5b", "grpo_vllm": result})
    assert (
        "- GRPO (LoRA, bf16, qwen2.5-0.5b) sampling on vLLM, its options the defaults: 17.11 s the first step (the "
        "server starts in it), then 0.398 s/step, generation 54.8% of it, peak 2.0 GiB in the trainer (every step: "
        "[17.11, 0.399, 0.397]; 0.5 s before the first); the engine's log-probs against the trainer's, mean |diff| "
        "[0.0012, 0.001], max [0.05, 0.04]" in lines
    ), lines


def test_a_part_past_its_budget_is_stopped_and_a_spent_run_starts_nothing(tmp_path, monkeypatch):
    import tempfile
    import time

    from bench import gpu

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    started = time.monotonic()
    code, seconds = gpu.run_process(["sleep", "30"], 1, dict(__import__("os").environ), tmp_path / "log")
    assert code is None and seconds < 10 and time.monotonic() - started < 10
    assert gpu.check(tmp_path / "out", "first", None, True, total_s=0) == 0
    parts = json.loads((tmp_path / "out" / "state.json").read_text())["parts"]
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(
        ["install", "sft-profile", "gpu-tests", "fsdp-tests", "decode"], "not run: the run's time budget was spent"
    )
    assert (tmp_path / "out" / "gpu_check.md").is_file()
    assert list((tmp_path / "tmp").iterdir()) == []  # its work folder is gone


def test_gpu_check_on_cpu_writes_its_report_after_the_install_and_when_stopped(tmp_path):
    """The script itself on this CPU (GPU_CHECK_ON_CPU=1): the report exists once the first part has
    finished, and a check stopped mid-part (the device window's end: SIGTERM) rewrites it, naming the
    part it cut off, and exits 124."""
    import os
    import signal
    import time

    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    env = {
        **os.environ,
        "PYTHON": python_for_tests(),
        "GPU_CHECK_ON_CPU": "1",
        "GPU_CHECK_PARTS": "sft-profile",
        "TMPDIR": str(scratch),
    }
    proc = subprocess.Popen(
        ["bash", "run_scripts/gpu_check.sh", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    status = lambda: json.loads((out / "state.json").read_text())["parts"] if (out / "state.json").is_file() else {}
    deadline = time.monotonic() + 240
    while (
        status().get("sft-profile", {}).get("status") != "running"
        and time.monotonic() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.5)
    text = (out / "gpu_check.md").read_text()
    assert "| install | passed |" in text and "| sft-profile | running |" in text, text
    assert (
        re.search(r"Versions: torch [^,]+, transformers [^,]+, accelerate [^,]+, peft [^,]+,", text)
        and " headers: " in text
    )
    assert len(list(scratch.iterdir())) == 1  # the check's cache
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)  # the script passes it on to the check
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 124, output[-2000:]
    assert not list(scratch.iterdir())  # the cache went with the check
    text = (out / "gpu_check.md").read_text()
    assert "| sft-profile | cut off: the check was stopped (SIGTERM) |" in text, text
