"""What the pipeline driver refuses, where it says so, and that `relay validate` refuses the same.

In process, on a tiny model: a finished stage is a copy of it with a manifest, as a stage's merged
folder is; the stages name a `script`, so no stage config is loaded.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError
from pipeline.modeling.manifest import write_manifest
from pipeline.tools import cli, driver
from pipeline.tools.chain import stage_argv
from pipeline.tools.chain_config import load_pipeline


def pipeline_config(tmp_path: Path, base: Path) -> tuple[Path, Path]:
    """A [pt, sft] pipeline config on `base` whose stages name a script; (config path, output root)."""
    root = tmp_path / "out"
    config = {
        "base_model": str(base),
        "output_root": str(root),
        "report": False,
        "chain": ["pt", "sft"],
        "stages": {
            s: {"config": {"train": {"max_steps": 3}}, "script": str(tmp_path / f"{s}.py")} for s in ("pt", "sft")
        },
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, root


def finish(config: Path, stage: str, base: Path) -> None:
    """Leave `stage` finished as the driver would find it: its resolved config written and a merged
    folder (a copy of its parent) with a manifest."""
    cfg, _ = load_pipeline(str(config), [])
    stage_argv(cfg, stage)  # writes output_root/configs/<stage>.yaml, the record of what it ran with
    merged = Path(cfg.output_root) / stage / "merged"
    shutil.copytree(base, merged)
    write_manifest(merged, stage=stage, parent=str(base))


def run(args: list[str]) -> int:
    return driver.run_command(args, io.StringIO())


def test_a_stale_stage_is_one_console_line_and_is_recorded_in_driver_log(tmp_path, tiny_model_dir, capsys):
    """A stage whose config changed since it finished stops the pipeline: the console's error was
    the reason followed by the stage's whole resolved YAML, and driver.log (which the README's
    failure table sends the user to) had only "skipped" lines. Now one line names the stage, the
    keys that differ and what to do, and driver.log records it."""
    config, root = pipeline_config(tmp_path, tiny_model_dir)
    finish(config, "pt", tiny_model_dir)
    changed = ["--stages.pt.overrides", "{train: {max_steps: 9}}"]
    assert run(["prepare", str(config), "pt", *changed]) == 1
    err = capsys.readouterr().err
    reason = (
        f"{root / 'pt/merged'} was built with the config in {root / 'configs/pt.yaml'}, which differs from what "
        f"the pipeline config now gives this stage (train.max_steps: 3 -> 9); delete {root / 'pt'} to rebuild it"
    )
    assert err == f"error: {reason}\n"
    assert (root / "driver.log").read_text().splitlines()[-1].endswith(f"pt: the pipeline stopped here: {reason}")


def test_a_selection_the_stages_before_cannot_serve_is_refused_by_the_plan_and_logged(tmp_path, tiny_model_dir, capsys):
    """`--from sft` before PT ran: the plan (`driver stages`, the pipeline's first call) refuses it
    before any stage starts, and creates no output folder to say so; once PT has run and its config
    changed, driver.log records why the pipeline stopped."""
    config, root = pipeline_config(tmp_path, tiny_model_dir)
    assert run(["stages", str(config), "--from", "sft"]) == 1
    merged = (root / "pt/merged").resolve()
    assert f"pt has not run: {merged} does not exist yet; run the pipeline from pt (--from pt)" in (
        capsys.readouterr().err
    )
    assert not root.exists()
    finish(config, "pt", tiny_model_dir)
    assert run(["stages", str(config), "--from", "sft", "--stages.pt.overrides", "{train: {max_steps: 9}}"]) == 1
    reason = f"{root / 'pt/merged'} was built with the config in {root / 'configs/pt.yaml'}, which differs"
    assert reason in capsys.readouterr().err
    log = (root / "driver.log").read_text()
    assert "pipeline: stopped before any stage ran: 1 problem(s) in" in log and reason in log


def test_validate_refuses_the_selection_the_run_refuses(tmp_path, tiny_model_dir):
    """`relay validate PIPELINE --from sft` said OK where `relay pipeline` with the same arguments
    stopped at once ("pt has not run"): both now ask chain.plan_problems."""
    config, root = pipeline_config(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError) as refused:
        cli.validate_pipeline(str(config), ["--from", "sft"])
    assert refused.value.problems == [
        f"pt has not run: {(root / 'pt/merged').resolve()} does not exist yet; run the pipeline from pt (--from pt)"
    ]
    finish(config, "pt", tiny_model_dir)
    assert cli.validate_pipeline(str(config), ["--from", "sft"]).endswith("stages sft into " + str(root))
    with pytest.raises(ConfigError, match=r"differs from what the pipeline config now gives this stage \(train"):
        cli.validate_pipeline(str(config), ["--only", "sft", "--stages.pt.overrides", "{train: {max_steps: 9}}"])
