"""Hugging Face on-disk tensor names -> the parameters of a transformers Qwen3 / Qwen3-MoE model.

transformers 5.x holds each MoE layer's experts fused
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` = [gate; up] per expert,
``mlp.experts.down_proj`` ``[E, H, I]``) while checkpoints, SGLang and our
exporter use the Hub's per-expert names
(``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``).
:func:`resolve_weight` maps a Hub name to the view of the parameter that holds
it, so loading is ``view.copy_(tensor)`` and reading is ``view`` itself; every
other name is a parameter of the model under the same name.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class UnknownWeightError(KeyError):
    """A tensor name the model has no parameter for; the message names it and a similar known name."""


def _expert_view(params: dict[str, torch.nn.Parameter], name: str, match: re.Match[str]) -> torch.Tensor:
    expert = int(match["expert"])
    if match["proj"] == "down":
        fused = params.get(f"{match['prefix']}.down_proj")
        if fused is None or expert >= fused.shape[0]:
            raise UnknownWeightError(f"{name}: the model has no expert {expert} down_proj")
        return fused[expert]
    fused = params.get(f"{match['prefix']}.gate_up_proj")
    if fused is None or expert >= fused.shape[0]:
        raise UnknownWeightError(f"{name}: the model has no expert {expert} gate_up_proj")
    half = fused.shape[1] // 2
    return fused[expert, :half] if match["proj"] == "gate" else fused[expert, half:]


def holding_parameter(name: str) -> str:
    """The name of the model parameter that holds Hub tensor ``name``: the fused experts' parameter for a
    per-expert name, ``name`` itself otherwise (whether or not the model has it)."""
    match = _EXPERT.match(name)
    if match is None:
        return name
    return f"{match['prefix']}.{'down_proj' if match['proj'] == 'down' else 'gate_up_proj'}"


def resolve_weight(params: dict[str, torch.nn.Parameter], name: str) -> torch.Tensor:
    """The tensor (a parameter or a view of one) that holds Hub tensor ``name``.

    ``params`` is ``dict(model.named_parameters())``. Raises UnknownWeightError
    for a name the model does not have.
    """
    match = _EXPERT.match(name)
    if match is not None:
        return _expert_view(params, name, match)
    if name not in params:
        raise UnknownWeightError(f"{name}: not a weight of this model (e.g. {next(iter(params), '?')})")
    return params[name]


@torch.no_grad()
def load_named_tensors(params: dict[str, torch.nn.Parameter], named_tensors: list[tuple[str, torch.Tensor]]) -> int:
    """Copy each (Hub name, tensor) into the model; returns the number of elements written.

    Shapes must match exactly (ValueError naming the tensor); dtypes are
    converted to the parameter's. All names are resolved before anything is
    written, so an unknown name leaves the model untouched.
    """
    targets = [resolve_weight(params, name) for name, _ in named_tensors]
    for (name, tensor), target in zip(named_tensors, targets, strict=True):
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}")
    for (_, tensor), target in zip(named_tensors, targets, strict=True):
        target.copy_(tensor)
    return sum(t.numel() for _, t in named_tensors)
