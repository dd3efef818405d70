"""Recipe configuration: schema, loading with overrides, cross-field validation.

Imports neither Megatron nor Ray, so a recipe is checked in a second, before
anything expensive starts.
"""

from megatron_rl.config.checks import Finding, check_recipe
from megatron_rl.config.layout import (
    EngineLayout,
    JudgeLayout,
    TrainerLayout,
    describe_layout,
    engine_layout,
    judge_layout,
    layout_record,
    trainer_layout,
)
from megatron_rl.config.loading import RecipeError, load_recipe, recipe_to_yaml, validate_recipe_tree
from megatron_rl.config.model_source import ModelSourceError, read_architecture
from megatron_rl.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
    WeightSyncConfig,
)

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "EngineLayout",
    "JudgeLayout",
    "Finding",
    "LoggingConfig",
    "ModelConfig",
    "ModelSourceError",
    "ParallelConfig",
    "RecipeError",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "TrainerLayout",
    "WeightSyncConfig",
    "check_recipe",
    "describe_layout",
    "engine_layout",
    "judge_layout",
    "layout_record",
    "load_recipe",
    "read_architecture",
    "recipe_to_yaml",
    "trainer_layout",
    "validate_recipe_tree",
]
