"""Model weights as a Megatron ``torch_dist`` distributed checkpoint.

The checkpoint stores Megatron's sharded tensors under global keys (global
layer and expert indices), so weights saved at one TP/PP/VPP/EP/ETP layout
load at any other: each rank builds its chunks at the new layout and asks
for exactly its shards. Only model weights are handled here (no optimizer or
trainer state; that is ``megatron_rl.checkpoint``'s job).

All ranks must call :func:`save_model_weights` / :func:`load_model_weights`
together.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule


def _sharded_state_dict(chunks: Sequence[MegatronModule]) -> dict[str, Any]:
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_model_weights(chunks: Sequence[torch.nn.Module], checkpoint_dir: str | Path) -> None:
    """Save this rank's shards of ``chunks`` into ``checkpoint_dir`` (created if absent; must be empty)."""
    checkpoint_dir = Path(checkpoint_dir)
    if dist.get_rank() == 0:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # Megatron's writer keeps a results queue behind a multiprocessing Manager;
    # its default 'spawn' context re-imports torch in a new process (tens of
    # seconds on small CPU machines). A forked Manager is equivalent here.
    filesystem_async.get_write_results_queue(mp_mode="fork")
    dist_checkpointing.save(_sharded_state_dict(chunks), str(checkpoint_dir))


def load_model_weights(chunks: Sequence[torch.nn.Module], checkpoint_dir: str | Path) -> None:
    """Load this rank's shards of ``chunks`` from a ``torch_dist`` checkpoint saved at any layout.

    Raises RuntimeError naming the parameters the checkpoint lacks.
    """
    loaded = dist_checkpointing.load(_sharded_state_dict(chunks), str(checkpoint_dir))
    for i, chunk in enumerate(chunks):
        result = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [key for key in result.missing_keys if not key.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"checkpoint {checkpoint_dir} lacks parameters {missing} of model chunk {i}")
