"""Capture and restore every random generator a rank draws from, for bitwise-exact resume.

Generator states are per global rank, so they are restored only when a run resumes at the
layout it was saved at. At another layout the ranks hold other shards and there is no
meaningful mapping; :func:`reseed_generators` then gives every generator a fresh, deterministic
seed instead.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rl.checkpoint.layout import rng_state_path
from megatron_rl.parallel.device import on_accelerator


def capture_rng_state() -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's global generators (CUDA ones when present)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if on_accelerator():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the global generators back to ``state`` (from :func:`capture_rng_state`)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state:
        if not on_accelerator():
            raise RuntimeError("this checkpoint holds CUDA generator states, but no GPU is visible to restore them")
        torch.cuda.set_rng_state_all(state["torch_cuda"])


def save_rng_state(checkpoint_dir: str | Path, rank: int, extra: dict[str, Any] | None = None) -> Path:
    """Write this rank's generator states, plus ``extra`` states its caller owns, into the checkpoint directory."""
    path = rng_state_path(checkpoint_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(capture_rng_state() | {"extra": extra or {}}, path)
    return path


def load_rng_state(checkpoint_dir: str | Path, rank: int) -> dict[str, Any]:
    """Restore this rank's generator states and return the ``extra`` states saved with them.

    Raises FileNotFoundError naming the missing file (a run saved with fewer ranks).
    """
    path = rng_state_path(checkpoint_dir, rank)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no generator state for rank {rank} (was the run saved with fewer ranks?)")
    state = torch.load(path, weights_only=False)
    restore_rng_state(state)
    extra: dict[str, Any] = state.get("extra", {})
    return extra


def reseed_generators(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (CUDA ones included) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
