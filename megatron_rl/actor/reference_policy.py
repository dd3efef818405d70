"""The reference policy as a second set of weights for the same model chunks.

One model per rank serves both policies: :class:`ReferencePolicyWeights` keeps a
copy of the reference parameters (by default on CPU, so it costs no device
memory) and :meth:`ReferencePolicyWeights.swapped_in` copies them into the model
for a forward pass, then restores the policy's parameters bit for bit. This
also keeps the routers (and their replay state) shared by both policies.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def _parameters(models: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return [param for model in models for param in model.parameters()]


class ReferencePolicyWeights:
    """A frozen copy of ``models``' parameters, taken at construction."""

    def __init__(self, models: Sequence[torch.nn.Module], *, device: torch.device | str = "cpu") -> None:
        self._models = list(models)
        with torch.no_grad():
            self._weights = [param.detach().to(device, copy=True) for param in _parameters(self._models)]

    @contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """Inside the block the models hold the reference weights; on exit the policy's, unchanged."""
        params = _parameters(self._models)
        backup = [param.detach().to("cpu", copy=True) for param in params]
        try:
            for param, weight in zip(params, self._weights, strict=True):
                param.copy_(weight)
            yield
        finally:
            for param, saved in zip(params, backup, strict=True):
                param.copy_(saved)
