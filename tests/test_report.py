"""The run report: TensorBoard events -> curves (joined across resumed runs), plots, report.md."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from pipeline.tools.report import ReportError, curve_row, read_scalars, stage_folders, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_events(folder: Path, scalars: dict[str, list[tuple[int, float]]]) -> None:
    writer = SummaryWriter(log_dir=str(folder))
    for tag, points in scalars.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.flush()
    writer.close()


def fake_run(root: Path) -> Path:
    """A pipeline root with the four stages' usual tags (SFT resumed once: two event folders)."""
    write_events(root / "pt/runs/pt-1", {"train/loss": [(1, 4.0), (2, 3.5), (3, 3.0)], "eval/loss": [(3, 3.2)]})
    write_events(
        root / "sft/runs/sft-1", {"train/loss": [(1, 2.0), (2, 1.8)], "train/loss_task/atlas_qa": [(1, 2.1), (2, 1.9)]}
    )
    time.sleep(0.01)  # the resumed run's events are written later: from its step 2 on, its values are the curve
    write_events(
        root / "sft/runs/sft-2",
        {
            "train/loss": [(2, 1.7), (3, 1.5)],
            "train/loss_task/coin_math": [(3, 1.2)],
            "eval/loss_task/atlas_qa": [(3, 1.6)],
        },
    )
    write_events(
        root / "rm/runs/rm-1",
        {
            "train/loss": [(1, 0.69), (2, 0.5)],
            "train/accuracy": [(1, 0.5), (2, 0.75)],
            "eval/accuracy": [(2, 0.875)],
            "eval/margin": [(2, 1.25)],
        },
    )
    write_events(
        root / "ppo/runs/ppo-1",
        {"ppo/reward_raw": [(1, -0.5), (2, 0.25)], "ppo/kl": [(1, 0.0), (2, 0.125)], "eval/reward": [(2, 0.5)]},
    )
    (root / "summary.json").write_text(
        json.dumps(
            {"verdict": "WARNING", "verdict_reasons": ["PPO mean reward did not rise"], "final_model": "/x/ppo/merged"}
        )
    )
    return root


def test_read_scalars_joins_resumed_runs(tmp_path):
    root = fake_run(tmp_path)
    curves = read_scalars(root / "sft")
    assert curves["train/loss"] == [(1, pytest.approx(2.0)), (2, pytest.approx(1.7)), (3, pytest.approx(1.5))]
    assert [s for s, _ in curves["train/loss_task/atlas_qa"]] == [1]  # the resumed life had none at step 2
    assert set(curves) == {
        "train/loss",
        "train/loss_task/atlas_qa",
        "train/loss_task/coin_math",
        "eval/loss_task/atlas_qa",
    }


def test_a_resumed_life_replaces_every_later_point_of_the_earlier_ones(tmp_path):
    # The first life logged to step 9 and was cut; the second resumed from step 6's checkpoint with
    # train.max_steps 7: steps 8 and 9 were never trained by the run the stage's model comes from.
    write_events(tmp_path / "runs/a", {"train/loss": [(s, 1.0) for s in range(1, 10)], "eval/loss": [(8, 1.0)]})
    time.sleep(0.01)
    write_events(tmp_path / "runs/b", {"train/loss": [(7, 2.0)]})
    curves = read_scalars(tmp_path)
    assert curves["train/loss"] == [(s, 1.0) for s in range(1, 7)] + [(7, 2.0)]
    assert "eval/loss" not in curves  # its one point was of an abandoned step


def test_report_writes_markdown_and_plots(tmp_path):
    root = fake_run(tmp_path)
    report = write_report(root)
    text = report.read_text()
    assert "| pt | `train/loss` | 3 | 4.0000 | 3.0000 | 3.0000 | 4.0000 |" in text
    assert "| rm | `eval/accuracy` | 1 | 0.8750 | 0.8750 | 0.8750 | 0.8750 |" in text
    assert "| sft | `train/loss_task/coin_math` | 1 | 1.2000 |" in text
    assert "Verdict: **WARNING**" in text and "- WARNING: PPO mean reward did not rise" in text
    for name in ("losses", "sft_tasks", "rm", "ppo"):
        png = root / "plots" / f"{name}.png"
        assert f"![{name}](plots/{name}.png)" in text
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


def test_report_skips_plots_without_data(tmp_path):
    write_events(tmp_path / "pt/runs/a", {"train/loss": [(1, 1.0)]})
    write_report(tmp_path)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["losses.png"]


def test_single_stage_folder_and_empty_run(tmp_path):
    write_events(tmp_path / "one/runs/a", {"train/loss": [(1, 1.0)]})
    assert stage_folders(tmp_path / "one") == {"one": tmp_path / "one"}
    with pytest.raises(ReportError, match="no TensorBoard events"):
        stage_folders(tmp_path / "empty")


def test_curve_row():
    assert (
        curve_row("rm", "eval/accuracy", [(1, 0.5), (2, 0.25), (3, 0.75)])
        == "| rm | `eval/accuracy` | 3 | 0.5000 | 0.7500 | 0.2500 | 0.7500 |"
    )


def test_relay_cli_dispatches_report(tmp_path, capsys):
    from pipeline.tools.cli import main

    root = fake_run(tmp_path)
    assert main(["report", str(root)]) == 0
    assert capsys.readouterr().out.strip() == str(root / "report.md")
    assert main(["report", str(tmp_path / "nothing")]) == 1 and "no TensorBoard events" in capsys.readouterr().err
    assert main(["nonsense"]) == 2 and "unknown command 'nonsense'" in capsys.readouterr().err


def test_report_renders_the_gold_table(tmp_path):
    root = fake_run(tmp_path)
    gold = {
        "data": "data/sample/gold/eval.jsonl",
        "rows": [
            {"model": "base", "phrase_rate": 0.0, "fact_accuracy": 0.0125, "n": 80},
            {"model": "sft", "phrase_rate": 0.5125, "fact_accuracy": 0.6, "n": 80},
            {"model": "ppo", "phrase_rate": 1.0, "fact_accuracy": 0.5875, "n": 80},
        ],
        "rl": "ppo",
        "reference": "sft",
    }
    summary = json.loads((root / "summary.json").read_text())
    (root / "summary.json").write_text(json.dumps({**summary, "gold": gold}))
    text = write_report(root).read_text()
    table = "\n".join(
        [
            "| model | phrase rate | fact accuracy | n |",
            "|---|---|---|---|",
            "| base | 0.000 | 0.013 | 80 |",
            "| sft | 0.512 | 0.600 | 80 |",
            "| ppo | 1.000 | 0.588 | 80 |",
        ]
    )
    assert "## Gold table" in text and table in text and "compares the `ppo` row with the `sft` row" in text
    assert text.index("## Gold table") < text.index("## Curves")


def test_report_without_gold_has_no_gold_section(tmp_path):
    assert "Gold table" not in write_report(fake_run(tmp_path)).read_text()


def test_single_stage_report_names_its_merged_model(tmp_path):
    """`relay report outputs/sft`: no pipeline verdict ("n/a") and the stage's merged/ as the final model."""
    stage = tmp_path / "sft"
    write_events(stage / "runs" / "sft-1", {"train/loss": [(1, 2.0), (2, 1.5)]})
    (stage / "summary.json").write_text(json.dumps({"train_loss_first": 2.0, "train_loss_last": 1.5, "steps": 2}))
    (stage / "merged").mkdir()
    (stage / "merged" / "config.json").write_text("{}")
    text = write_report(stage).read_text()
    assert "Verdict" not in text and "n/a" not in text and "None" not in text
    assert f"Final model: `{(stage / 'merged').resolve()}`" in text
    assert "- train_loss_last: 1.5000" in text and "- steps: 2" in text


def test_a_stage_folder_of_any_name_reports_its_stages_plots(tmp_path):
    """`relay report out/my_ppo` (a run with `--output_dir out/my_ppo`): the stage is the one its
    merged/ manifest names, so its own plot is drawn (it was drawn only for a folder named `ppo`)."""
    folder = tmp_path / "my_ppo"
    write_events(
        folder / "runs" / "ppo-1", {"ppo/reward_raw": [(1, -0.5), (2, 0.25)], "ppo/kl": [(1, 0.0), (2, 0.125)]}
    )
    (folder / "merged").mkdir()
    (folder / "merged" / "manifest.json").write_text(json.dumps({"stage": "ppo"}))
    assert stage_folders(folder) == {"ppo": folder}
    text = write_report(folder).read_text()
    assert "![ppo](plots/ppo.png)" in text and (folder / "plots" / "ppo.png").read_bytes()[:8] == PNG_MAGIC


def test_report_of_a_stage_is_the_run_its_summary_came_from(tiny_model_dir, tmp_path, monkeypatch):
    """A resumed run's report covers every step of the run; a fresh rerun (checkpoint.resume
    false) reports its own steps only, the abandoned run's events moved aside with its checkpoints
    (before, the report joined both runs by step and its last train/loss was the abandoned run's)."""
    from test_pt_sft import fresh_accelerate_state, run_sft, sft_args, write_sft  # noqa: F401 (autouse fixture)

    train, valid = write_sft(tmp_path / "data", 6, 2)
    out = tmp_path / "sft"

    def args(*extra):
        return sft_args(tiny_model_dir, train, valid, out, "--train.eval_steps", "0", *extra)

    def reported(stage):
        summary = json.loads((out / "summary.json").read_text())
        curve = read_scalars(out)["train/loss"]
        want = [(r["step"], pytest.approx(r["train/loss"])) for r in stage.history.steps]
        assert curve == want and curve[-1][1] == pytest.approx(summary["train_loss_last"])
        return curve

    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "2")
    run_sft(args("--train.max_steps", "3"))
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    resumed = run_sft(args("--train.max_steps", "3"))
    # two lives, two event files (in one folder when both started within the same second)
    assert [s for s, _ in reported(resumed)] == [1, 2, 3] and len(list((out / "runs").rglob("events.*"))) == 2

    fresh = run_sft(args("--train.max_steps", "2", "--checkpoint.resume", "false"))
    assert [s for s, _ in reported(fresh)] == [1, 2]
    (runs_aside,) = out.glob("runs.old-*")
    assert len(list(runs_aside.rglob("events.*"))) == 2  # the resumed run's two event files, kept
    assert (out / f"checkpoints.old-{runs_aside.name.partition('.old-')[2]}").is_dir()
