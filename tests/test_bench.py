"""Smoke tests of the benchmark harness: every comparison in bench/comparisons runs `--quick`
(a tiny random model, a few steps) and appends one well-formed row; bench/scaling.py --quick
writes its section, points and PNG. The figures are never checked (speed lives in bench/, never
in timed tests); the equal-work check (same first loss on both sides) is, since a row is only
written when it holds.

Each side is a fresh process (a few seconds of imports), so one case per comparison runs here."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

COMPARISONS = sorted(p.stem for p in (ROOT / "bench" / "comparisons").glob("*.py") if not p.stem.startswith("_"))


def run(args, tmp_path, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def test_every_comparison_is_smoke_tested():
    assert {"sft", "ppo", "dpo", "grpo"} <= set(COMPARISONS)


@pytest.mark.parametrize("name", COMPARISONS)
def test_quick_comparison_appends_one_well_formed_row(name, tmp_path):
    import importlib

    module = importlib.import_module(f"bench.comparisons.{name}")
    if module.PEER_PYTHON == "trl-1.12":
        try:
            harness.ensure_trl_112()
        except harness.HarnessError as error:  # no package registry reachable: nothing to compare against
            pytest.skip(str(error))
    case = module.cases(True)[0]["case"]
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmarks\n\n## Other section\nkept\n")
    proc = run(["bench/run.py", name, "--quick", "--case", case, "--threads", "1", "--results", str(results),
                "--workdir", str(tmp_path / "work")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
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


def test_quick_scaling_writes_its_section_points_and_plot(tmp_path):
    results = tmp_path / "RESULTS.md"
    proc = run(["bench/scaling.py", "--quick", "--threads", "1", "--results", str(results), "--workdir", str(tmp_path / "w")],
               tmp_path)
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
    assert bench_run.main(["sft", "--quick", "--case", "lora-padin", "--results", str(out), "--workdir", str(tmp_path / "w")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench/run.py: sft has no case lora-padin in --quick; its cases: lora-padding, lora-packing"]
    assert not out.exists() and not (tmp_path / "w").exists()


def test_demo_backends_goal_and_vllm_grpo_ratio_are_read_from_the_figures():
    """bench/demo_backends.py's goal check (issue 34: verdict PASS, PPO's gold phrase rate and fact
    accuracy within 0.05 of the relay backend's) and bench/vllm_grpo.py's step ratio, on hand-made figures."""
    from bench.demo_backends import gold_rows, goal_check
    from bench.vllm_grpo import against_relay

    summary = {"gold": {"rows": [{"model": "sft", "phrase_rate": 0.5, "fact_accuracy": 0.95, "n": 80},
                                 {"model": "ppo", "phrase_rate": 1.0, "fact_accuracy": 0.9375, "n": 80}]}}
    relay = {"verdict": "PASS", "gold": gold_rows(summary)}
    assert relay["gold"]["ppo"] == {"phrase_rate": 1.0, "fact_accuracy": 0.9375}
    near = {"verdict": "PASS", "gold": {"ppo": {"phrase_rate": 0.975, "fact_accuracy": 0.9}}}
    assert goal_check(relay, near) == {"gaps": {"phrase_rate": 0.025, "fact_accuracy": 0.0375}, "verdict": "PASS", "met": True}
    assert not goal_check(relay, {**near, "verdict": "WARNING"})["met"]
    assert not goal_check(relay, {"verdict": "PASS", "gold": {"ppo": {"phrase_rate": 0.9, "fact_accuracy": 0.9375}}})["met"]
    assert goal_check(relay, {"verdict": "PASS", "gold": {}}) == {"met": False, "why": "no ppo gold row"}
    rows = [{"backend": "relay", "s_per_step": 4.0}, {"backend": "hf", "s_per_step": 6.0}, {"backend": "vllm", "s_per_step": 9.0}]
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
        f"bench/demo_backends.py: {tmp_path / 'b' / 'summary.json'}: not found (a finished demo root holds one)"]
