"""The driver's side of a run checkpoint: which one to resume, whether it fits the recipe, and the save.

A save stages everything (:mod:`.layout` names each part), then commits by rename with
``latest`` written last (:mod:`.commit`), then prunes. The trainer ranks write their own parts
through a callback, so this module needs neither Megatron nor Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from megatron_rl.checkpoint.commit import commit_checkpoint, latest_checkpoint, prune_checkpoints, staging_dir
from megatron_rl.checkpoint.layout import HF_EXPORT_DIR, HF_METADATA_DIR
from megatron_rl.checkpoint.trainer_state import TrainerState, save_trainer_state
from megatron_rl.config import RunConfig, read_architecture
from megatron_rl.models.hf_files import copy_hf_metadata


class Tokenizer(Protocol):
    """What a save needs of the run's tokenizer."""

    def save_pretrained(self, directory: str | Path, /) -> object: ...


def checkpoint_to_resume(cfg: RunConfig) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names: ``latest`` for auto (None when there is none), a path, or None."""
    if cfg.checkpoint.resume == "none":
        return None
    if cfg.checkpoint.resume == "auto":
        return latest_checkpoint(cfg.checkpoint_dir)
    return Path(cfg.checkpoint.resume)


def check_same_model(cfg: RunConfig, checkpoint: Path) -> None:
    """Raise ValueError naming the differing fields when ``checkpoint`` holds another model than the recipe's."""
    saved = read_architecture(str(checkpoint / HF_METADATA_DIR), None)
    wanted = read_architecture(cfg.model.path, cfg.model.random_init)
    differing = [
        f"{field.name}: {getattr(saved, field.name)} saved, {getattr(wanted, field.name)} in the recipe"
        for field in dataclasses.fields(saved)
        if getattr(saved, field.name) != getattr(wanted, field.name)
    ]
    if differing:
        raise ValueError(
            f"checkpoint.resume: {checkpoint} holds another model ({'; '.join(differing)}); "
            "resume with the recipe it was saved with, or set checkpoint.resume=none (or another checkpoint.dir)"
        )


def save_run_checkpoint(
    root: str | Path,
    state: TrainerState,
    *,
    hf_dir: Path,
    tokenizer: Tokenizer,
    write_rank_state: Callable[[Path], None],
    export_hf: Callable[[Path], None] | None,
    keep_last: int,
) -> Path:
    """Stage trainer state, HF metadata, every rank's part (and ``hf/``), commit, prune; the committed path.

    ``write_rank_state(staging)`` has every trainer rank write its shards and generator states;
    ``export_hf(directory)``, when given, has them write a Hugging Face model directory, complete
    in the staging directory before the commit, so a committed checkpoint never holds a partial
    one. Keeps the newest ``keep_last`` checkpoints.
    """
    staging = staging_dir(root, state.step)
    save_trainer_state(staging, state)
    copy_hf_metadata(hf_dir, staging / HF_METADATA_DIR)
    tokenizer.save_pretrained(staging / HF_METADATA_DIR)
    write_rank_state(staging)
    if export_hf is not None:
        export_hf(staging / HF_EXPORT_DIR)
        tokenizer.save_pretrained(staging / HF_EXPORT_DIR)
    committed = commit_checkpoint(root, state.step)
    prune_checkpoints(root, keep_last)
    return committed
