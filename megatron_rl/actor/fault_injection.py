"""Faults injected into a run for reliability tests: set in the trainer processes' environment, never by a recipe.

``MEGATRON_RL_FAULT_NONFINITE_UPDATES="3,4"``: on the 3rd and 4th optimizer update this
process attempts (1-based, counted from its start), one gradient element becomes NaN after
the backward pass, on every rank, as an overflow or a corrupted sample would make it.
``tests/faults/`` uses it to check that such updates are skipped and counted and that a
run with too many in a row stops (``docs/reliability.md``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

NONFINITE_UPDATES_ENV = "MEGATRON_RL_FAULT_NONFINITE_UPDATES"

_attempts = 0


def _listed_updates() -> frozenset[int]:
    value = os.environ.get(NONFINITE_UPDATES_ENV, "").strip()
    return frozenset(int(item) for item in value.split(",") if item.strip())


@torch.no_grad()
def poison_gradients_if_asked(models: Sequence[torch.nn.Module]) -> bool:
    """Count one update attempt; when the environment lists it, write NaN into a gradient and return True."""
    global _attempts
    _attempts += 1
    if _attempts not in _listed_updates():
        return False
    for model in models:
        for param in model.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None and grad.numel():
                grad.view(-1)[0] = float("nan")
                return True
    return False
