"""Run checkpoints: the staging/commit/latest protocol, trainer state, per-rank generator states."""

from megatron_rl.checkpoint.commit import (
    CheckpointError,
    commit_checkpoint,
    committed_steps,
    latest_checkpoint,
    prune_checkpoints,
    staging_dir,
    step_dir_name,
    step_of,
)
from megatron_rl.checkpoint.layout import LATEST_FILE
from megatron_rl.checkpoint.rng import (
    capture_rng_state,
    load_rng_state,
    reseed_generators,
    restore_rng_state,
    save_rng_state,
)
from megatron_rl.checkpoint.trainer_state import TrainerState, load_trainer_state, save_trainer_state

__all__ = [
    "LATEST_FILE",
    "CheckpointError",
    "TrainerState",
    "capture_rng_state",
    "commit_checkpoint",
    "committed_steps",
    "latest_checkpoint",
    "load_rng_state",
    "load_trainer_state",
    "prune_checkpoints",
    "reseed_generators",
    "restore_rng_state",
    "save_rng_state",
    "save_trainer_state",
    "staging_dir",
    "step_dir_name",
    "step_of",
]
