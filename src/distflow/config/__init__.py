"""The typed configuration: nested dataclasses, one per section, constructible in code.

    from distflow.config import Config, TrainerConfig, RolloutConfig
    config = Config(trainer=TrainerConfig(total_steps=20), rollout=RolloutConfig(num_samples=8))

`load_config(path, overrides)` reads the same from YAML and `section.key=value` overrides.
"""

from distflow.config.algorithm import AlgorithmConfig, ClipConfig, CriticConfig, KLConfig
from distflow.config.env import EnvConfig
from distflow.config.loader import load_config, to_dict
from distflow.config.model import LoraConfig, ModelConfig, WarmstartConfig
from distflow.config.pipeline import LayoutSpec, PipelineConfig, PlacementConfig, StageSpec
from distflow.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    FSDPConfig,
    OptimConfig,
    RolloutConfig,
    TrainerConfig,
)
from distflow.config.task import DatasetSpec, ReasoningGymSpec, RewardModelSpec, RewardSpec, TaskConfig

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClipConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DatasetSpec",
    "EnvConfig",
    "FSDPConfig",
    "KLConfig",
    "LayoutSpec",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "PlacementConfig",
    "ReasoningGymSpec",
    "RewardModelSpec",
    "RewardSpec",
    "RolloutConfig",
    "StageSpec",
    "TaskConfig",
    "TrainerConfig",
    "WarmstartConfig",
    "load_config",
    "to_dict",
]
