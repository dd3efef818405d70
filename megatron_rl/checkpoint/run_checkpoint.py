"""The driver's side of a run checkpoint: which one to resume, whether it fits the recipe, and the save.

A save stages everything (:mod:`.layout` names each part), then commits by rename with
``latest`` written last (:mod:`.commit`), then prunes. The trainer ranks write their own parts
through a callback, so this module needs neither Megatron nor Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

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


_ADAPTER_SHAPE = ("rank", "alpha", "target_modules", "experts_shared_outer")
"""The ``lora:`` fields that make an adapter another function (dropout is 0 and slots are the engines')."""


def _adapter_shape(lora: dict[str, Any] | None) -> dict[str, Any] | None:
    if lora is None:
        return None
    return {key: sorted(lora[key]) if key == "target_modules" else lora[key] for key in _ADAPTER_SHAPE}


def check_same_adapter(cfg: RunConfig, state: TrainerState, checkpoint: Path) -> None:
    """Raise ValueError when ``checkpoint`` (whose state is ``state``) holds another adapter than the recipe's
    ``lora:`` section trains, or an adapter the recipe lacks, or none where the recipe has one."""
    saved = _adapter_shape(state.lora)
    wanted = _adapter_shape(cfg.lora.model_dump(mode="json") if cfg.lora is not None else None)
    if saved == wanted:
        return
    if saved is None:
        raise ValueError(
            f"checkpoint.resume: {checkpoint} trained every weight, the recipe's lora: section trains an adapter; "
            "to train an adapter on those weights, convert the checkpoint (megatron-rl convert mcore-to-hf) and set "
            "model.path to it with checkpoint.resume=none, or remove the lora section to continue the run"
        )
    if wanted is None:
        raise ValueError(
            f"checkpoint.resume: {checkpoint} holds a LoRA adapter ({saved}) and the recipe has no lora: section; "
            "resume with the recipe's lora section as saved, or export the merged model (megatron-rl convert "
            "mcore-to-hf) and start a new run from it with checkpoint.resume=none"
        )
    differing = [
        f"{key}: {saved[key]} saved, {wanted[key]} in the recipe" for key in _ADAPTER_SHAPE if saved[key] != wanted[key]
    ]
    raise ValueError(
        f"checkpoint.resume: {checkpoint} holds another adapter ({'; '.join(differing)}); resume with the lora "
        "section it was saved with, or set checkpoint.resume=none (or another checkpoint.dir)"
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
