"""The reference policy as a second set of weights for the same model chunks.

One model per rank serves both policies: :class:`ReferencePolicyWeights` keeps a copy of the
reference parameters where the recipe says (``algorithm.reference_placement``: pinned host
memory, or the device), and :meth:`ReferencePolicyWeights.swapped_in` EXCHANGES them with the
model's parameters for a forward pass and exchanges them back on exit, parameter by parameter
through one scratch tensor of that parameter's size: nothing else is allocated, the policy's
parameters come back bit for bit, and the reference copy never makes a round trip through
pageable memory. This also keeps the routers (and their replay state) shared by both policies.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def _parameters(models: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return [param for model in models for param in model.parameters()]


class ReferencePolicyWeights:
    """A frozen copy of ``models``' parameters, taken at construction, kept on ``device``.

    ``device``: a CPU device (pinned when a GPU holds the model) or the model's own device.
    """

    def __init__(self, models: Sequence[torch.nn.Module], *, device: torch.device | str = "cpu") -> None:
        self._models = list(models)
        device = torch.device(device)
        with torch.no_grad():
            self._weights = [_copy_to(param.detach(), device) for param in _parameters(self._models)]

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The stored reference weights (for offloading them with the optimizer state when on the device)."""
        return list(self._weights)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside the block the models hold the reference weights; on exit the policy's, unchanged."""
        params = _parameters(self._models)
        _exchange(params, self._weights)
        try:
            yield
        finally:
            _exchange(params, self._weights)


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    pin = device.type == "cpu" and tensor.device.type == "cuda"
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)
    return copy.copy_(tensor)


@torch.no_grad()
def _exchange(params: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
    """Swap the contents of each parameter and its stored weight (one parameter-sized scratch at a time)."""
    for param, weight in zip(params, weights, strict=True):
        scratch = param.detach().clone()
        param.copy_(weight)
        weight.copy_(scratch)
