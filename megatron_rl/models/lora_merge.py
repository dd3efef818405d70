"""A PEFT adapter merged into its base model's Hugging Face weights (``convert``'s merged export).

Pure tensor arithmetic on Hugging Face names: no Megatron, no model. Adapter names are PEFT's
(:mod:`~megatron_rl.models.lora_peft`: ``base_model.model.<module>.lora_{A,B}.weight``, per-expert form);
the base weight of ``<module>`` is ``<module>.weight``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

_PEFT_NAME = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
_FUSED_EXPERTS = re.compile(r".+\.mlp\.experts(\.base_layer)?")


def adapter_modules(adapter: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module name: (A [r, in], B [out, r])}`` of a PEFT state in per-expert form.

    Raises:
        ValueError: a name is not a PEFT LoRA factor, or a module has A without B (or B without A), or a
            module's A and B disagree on the rank.
    """
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter.items():
        match = _PEFT_NAME.fullmatch(name)
        if match is None or _FUSED_EXPERTS.fullmatch(match.group(1)):
            raise ValueError(
                f"adapter tensor {name!r} is not a PEFT LoRA factor (base_model.model.<module>.lora_A/B.weight); "
                "fused-expert tensors must be unfused first (models.lora_peft.unfuse_peft_experts)"
            )
        factors.setdefault(match.group(1), {})[match.group(2)] = tensor
    modules = {}
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter module {module!r} has lora_{''.join(pair)} only; a LoRA needs both A and B")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"adapter module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                "[r, in] and [out, r] of one rank r"
            )
        modules[module] = (a, b)
    return modules


@torch.no_grad()
def merge_lora_weights(
    weights: Iterable[tuple[str, torch.Tensor]], adapter: Mapping[str, torch.Tensor], scaling: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``weights`` with every adapted module's weight replaced by ``W + scaling * B @ A``.

    ``scaling`` is PEFT's ``lora_alpha / r``. The product and sum are computed in float32 (float64 for a
    float64 base) and rounded once to the base weight's dtype, on the base weight's device; other tensors
    pass through unchanged (the same objects). Adapter modules whose weight is not in ``weights`` are not
    used: ``weights`` may be one rank's share of the model.

    Raises:
        ValueError: an adapter module's ``B @ A`` has another shape than its base weight.
    """
    modules = adapter_modules(adapter)
    for name, weight in weights:
        module = name.removesuffix(".weight")
        if name == module or module not in modules:
            yield name, weight
            continue
        a, b = modules[module]
        if (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise ValueError(
                f"adapter of {module!r}: B @ A is {(b.shape[0], a.shape[1])}, the base weight {tuple(weight.shape)}"
            )
        compute = torch.float64 if weight.dtype == torch.float64 else torch.float32
        delta = b.to(weight.device, compute) @ a.to(weight.device, compute)
        yield name, (weight.to(compute) + scaling * delta).to(weight.dtype)
