"""Shared pieces of the weight-sync benchmarks: the plain-copy baseline and exactness checks."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from megatron_rl.engines import ReferenceEngine

NamedTensors = Sequence[tuple[str, torch.Tensor]]


def plain_copy_seconds(named: NamedTensors, repeats: int) -> float:
    """Best of ``repeats`` timed ``copy_`` of every tensor into a preallocated (already touched) one.

    Runs with the calling process's intra-op threads: the strongest single-copy baseline.
    """
    targets = [torch.empty_like(tensor) for _, tensor in named]
    for target, (_, tensor) in zip(targets, named, strict=True):
        target.copy_(tensor)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for target, (_, tensor) in zip(targets, named, strict=True):
            target.copy_(tensor)
        best = min(best, time.perf_counter() - start)
    return best


def engine_holds(engine: ReferenceEngine, named: NamedTensors, rows: int = 4) -> None:
    """Assert the engine holds each tensor's first ``rows`` rows bit for bit (AssertionError naming it)."""
    for name, tensor in named:
        held = torch.tensor(engine.weights_by_name(name, rows), dtype=tensor.dtype)
        assert torch.equal(held, tensor[:rows]), f"engine {engine.name}: {name} differs from what was sent"
