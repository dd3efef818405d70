"""The reference engine's FP8 weights: what SGLang's FP8 layers hold, and the model weights computed from them.

SGLang 0.5.23 builds each quantised projection of an FP8 checkpoint as two parameters, ``weight``
(``float8_e4m3fn``) and ``weight_scale_inv`` (float32 per block), each loaded on its own by name. The
reference engine computes in its model's dtype, so it keeps the last FP8 weight and the last scales
of every projection and writes their product (:func:`~megatron_rl.wire.fp8_blocks.dequantize_blocks`)
into the model whenever either changes: the tokens it samples are the FP8 model's.
"""

from __future__ import annotations

import torch

from megatron_rl.wire.fp8_blocks import FP8_DTYPE, SCALE_SUFFIX, dequantize_blocks, is_quantized

NamedTensors = list[tuple[str, torch.Tensor]]


class Fp8Weights:
    """FP8 weights and scales of blocks ``block`` = (bn, bk), by Hugging Face weight name."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def absorb(self, named: NamedTensors, dtype: torch.dtype) -> NamedTensors:
        """Keep the FP8 weights and scales in ``named``; return what to write into the model: every other tensor
        as it is, and the dequantised weight (in ``dtype``) of each projection whose weight or scales came. All
        tensors are checked before anything is kept.

        Raises ValueError for a projection sent in another dtype than FP8, scales whose shape does not fit the
        block, and a projection with a weight but no scales (or scales but no weight) so far.
        """
        incoming_weights, incoming_scales, plain = {}, {}, []
        for name, tensor in named:
            if name.endswith(SCALE_SUFFIX) and is_quantized(name.removesuffix(SCALE_SUFFIX)):
                incoming_scales[name.removesuffix(SCALE_SUFFIX)] = tensor
            elif is_quantized(name):
                if tensor.dtype != FP8_DTYPE:
                    raise ValueError(
                        f"{name}: {tensor.dtype}, but this engine serves FP8 weights ({FP8_DTYPE}, with "
                        f"{name}{SCALE_SUFFIX}); send the sync quantised (rollout.quantization=fp8)"
                    )
                incoming_weights[name] = tensor
            else:
                plain.append((name, tensor))
        changed = {*incoming_weights, *incoming_scales}
        for name in changed:
            weight = incoming_weights.get(name, self.weights.get(name))
            scales = incoming_scales.get(name, self.scales.get(name))
            if weight is None or scales is None:
                missing = "scales" if scales is None else "FP8 weight"
                raise ValueError(f"{name}: its {missing} never came; an FP8 projection needs both")
            rows, cols = weight.shape
            expected = (-(-rows // self.block[0]), -(-cols // self.block[1]))
            if tuple(scales.shape) != expected:
                raise ValueError(
                    f"{name}{SCALE_SUFFIX}: shape {tuple(scales.shape)}, but blocks of {list(self.block)} over "
                    f"{tuple(weight.shape)} give {expected}"
                )
        self.weights |= {name: tensor.clone() for name, tensor in incoming_weights.items()}
        self.scales |= {name: tensor.float().clone() for name, tensor in incoming_scales.items()}
        dequantized = [
            (name, dequantize_blocks(self.weights[name], self.scales[name], self.block, dtype))
            for name in sorted(changed)
        ]
        return plain + dequantized

    def lookup(self, name: str) -> torch.Tensor | None:
        """The FP8 weight (as float32) or the scales held under ``name``; None for a name not held here."""
        if name.endswith(SCALE_SUFFIX):
            return self.scales.get(name.removesuffix(SCALE_SUFFIX))
        weight = self.weights.get(name)
        return None if weight is None else weight.float()
