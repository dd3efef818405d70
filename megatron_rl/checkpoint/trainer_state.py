"""The driver's own state in a checkpoint: step, data position, weight version, carried-over rollouts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.checkpoint.layout import TRAINER_STATE_FILE

_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TrainerState:
    """What the RL driver needs, besides model and optimizer, to continue exactly.

    ``step`` is the number of completed optimizer steps; ``sampler`` the prompt sampler's
    ``state_dict()``; ``weight_version`` the version last synced to the engines;
    ``carried_over`` names a file (relative to the checkpoint) of rollout groups generated
    but not yet trained on and of unfinished partial-rollout groups, or is None. ``layout`` is the trainer's rank layout at save
    (:func:`megatron_rl.config.layout_record`), None in checkpoints that predate it. ``lora`` is the recipe's
    ``lora:`` section the model was trained with (its JSON form), None for a run that trains every weight.
    """

    step: int
    sampler: dict[str, int]
    weight_version: int
    carried_over: str | None = None
    layout: dict[str, int] | None = None
    lora: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def save_trainer_state(checkpoint_dir: str | Path, state: TrainerState) -> Path:
    """Write ``trainer_state.json`` into the (staging) checkpoint directory."""
    path = Path(checkpoint_dir) / TRAINER_STATE_FILE
    path.write_text(json.dumps({"format_version": _FORMAT_VERSION} | asdict(state), indent=1, sort_keys=True) + "\n")
    return path


def load_trainer_state(checkpoint_dir: str | Path) -> TrainerState:
    """Read ``trainer_state.json``; a missing file or another format version is a clear error."""
    path = Path(checkpoint_dir) / TRAINER_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {checkpoint_dir} is not a megatron-rl run checkpoint")
    record = json.loads(path.read_text())
    version = record.pop("format_version", None)
    if version != _FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {version!r}, this megatron-rl reads {_FORMAT_VERSION}")
    return TrainerState(**record)


def saved_lora(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """The ``lora:`` section a run checkpoint was trained with (:attr:`TrainerState.lora`), None for a checkpoint
    that trains every weight or is no run checkpoint (``convert hf-to-mcore``'s output has no trainer state)."""
    if not (Path(checkpoint_dir) / TRAINER_STATE_FILE).is_file():
        return None
    return load_trainer_state(checkpoint_dir).lora
