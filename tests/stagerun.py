"""Running a stage in process for the tests: `run_stage(StageClass, cfg)` returns the stage, whose
`step`, `history` and state the tests read; `recording(StageClass)` also records the sample
indices of every step's micro-batches on this rank (`batch_ids`), for the resume tests;
`fresh_accelerate()` forgets accelerate's per-process state between in-process runs."""

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


def fresh_accelerate() -> None:
    """Forget accelerate's process-wide state (its mixed precision, the gradient accumulation
    state): a stage launched alone starts without them, and accelerate refuses a second
    Accelerator whose precision differs from the first one's in the same process."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run_stage(stage_class, cfg, on_step=None, **kwargs):
    """Run `stage_class` on `cfg` (a config object, or an argv list to parse) as a launch of its
    own would (accelerate's state fresh) and return the stage."""
    if isinstance(cfg, list):
        cfg = load_config(stage_class.config_class, cfg)
    fresh_accelerate()
    stage = stage_class(cfg, **kwargs)
    stage.run(on_step=on_step)
    return stage
