"""Typed configuration shared by every stage.

Each stage declares one dataclass tree built from the sections below; YAML files map onto it 1:1
(with ``!include`` for shared sections) and dotted CLI flags override the YAML::

    python stages/sft.py --config configs/sft.yaml --train.max_steps 20 --lora.r 8

Parsing is draccus (what Levanter uses): it gives typed decoding, ``!include`` and ``--help``
built from the field docstrings. We add one thing it lacks: every unknown key in the YAML and on
the command line is reported together, with its full key path and a "did you mean" suggestion,
before anything is decoded. Semantic checks (``problems()``) are likewise collected, never raised
one by one, so a user fixes a config in one pass.
"""

from pipeline.config.loading import load_config, read_yaml, save_config, to_dict, unknown_keys
from pipeline.config.policy import GenerationConfig, RewardModelConfig, ToolsConfig
from pipeline.config.sections import (
    ATTENTION,
    DTYPES,
    FINETUNING,
    SCHEDULES,
    ChatDataConfig,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DistributedConfig,
    KeepPolicy,
    LoraConfig,
    ModelConfig,
    PreferenceDataConfig,
    PromptDataConfig,
    StageConfig,
    TextDataConfig,
    TrackingConfig,
    TrainConfig,
    parse_duration,
)

__all__ = [
    "ATTENTION",
    "DTYPES",
    "FINETUNING",
    "SCHEDULES",
    "ChatDataConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "GenerationConfig",
    "KeepPolicy",
    "LoraConfig",
    "ModelConfig",
    "PreferenceDataConfig",
    "PromptDataConfig",
    "RewardModelConfig",
    "StageConfig",
    "ToolsConfig",
    "TextDataConfig",
    "TrackingConfig",
    "TrainConfig",
    "load_config",
    "parse_duration",
    "read_yaml",
    "save_config",
    "to_dict",
    "unknown_keys",
]
