"""The stage engine: the `Stage` flow every stage is a subclass of (stage.py), the shared
token-loss half of PT and SFT (language_modeling.py), one optimizer step and accumulation
(steps.py), the accelerator and optimizer (accelerator.py), export (export.py), checkpoints,
schedules and tracking. It never imports a stage."""
