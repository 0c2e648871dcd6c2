"""Running a stage in process for the tests: `run_stage(StageClass, cfg)` returns the stage, whose
`step`, `history` and state the tests read; `recording(StageClass)` also records the sample
indices of every step's micro-batches on this rank (`batch_ids`), for the resume tests."""

from __future__ import annotations

from pipeline.config import load_config


def recording(stage_class):
    """A subclass of `stage_class` that records the sample indices each step draws."""

    class Recording(stage_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.batch_ids: list = []

        def next_sample_indices(self, grad_accum=None):
            groups = super().next_sample_indices(grad_accum)
            self.batch_ids.append(groups)
            return groups

    Recording.__name__ = Recording.__qualname__ = stage_class.__name__
    return Recording


def run_stage(stage_class, cfg, on_step=None, **kwargs):
    """Run `stage_class` on `cfg` (a config object, or an argv list to parse) and return the stage."""
    if isinstance(cfg, list):
        cfg = load_config(stage_class.config_class, cfg)
    stage = stage_class(cfg, **kwargs)
    stage.run(on_step=on_step)
    return stage
