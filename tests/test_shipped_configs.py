"""Every YAML that ships loads into its typed config with no problem, and opens with its command."""

from pathlib import Path

import pytest

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def _classes():
    """configs/<stage>.yaml: the registered stage's config; pipeline*.yaml and demo.yaml: the driver's."""
    import stages
    from pipeline.tools.driver import PipelineConfig

    pipelines = {p.stem: PipelineConfig for p in SHIPPED if p.stem.startswith("pipeline")}
    return {name: stages.config_class(name) for name in stages.STAGES} | pipelines | {"demo": PipelineConfig}


SHIPPED = sorted(p for p in (ROOT / "configs").glob("*.yaml"))


def test_every_top_level_yaml_has_a_class():
    assert {p.stem for p in SHIPPED} <= set(_classes()), [p.name for p in SHIPPED]
    assert {"pt", "sft", "rm", "ppo", "pipeline"} <= {p.stem for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_yaml_validates(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # data paths in shipped configs are relative to the repository
    cfg = load_config(_classes()[path.stem], ["--config", str(path)])
    assert cfg is not None
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# ") and ("stages/" in first or "run_scripts/" in first), (
        f"{path.name} must open with its command"
    )
