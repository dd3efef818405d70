"""Blockwise FP8 weights as SGLang 0.5.23 loads them: Qwen's FP8 checkpoint format, and its quantiser.

A quantised Linear weight ``W`` [out, in] is stored as ``<name>.weight`` in ``float8_e4m3fn`` and
``<name>.weight_scale_inv`` in float32 [ceil(out / bn), ceil(in / bk)]: per block of ``bn x bk``
elements, the FP8 value is ``W x 448 / max|W|`` rounded to nearest (448: e4m3's largest finite
value), the scale is ``max|W| / 448`` and ``W ~ fp8 x scale`` (so "scale_inv" is the dequantisation
multiplier, as DeepSeek-V3 and Qwen3-FP8 checkpoints name it); config.json carries
:func:`~megatron_rl.config.fp8_checkpoint.quantization_config`. Torch only: the trainer's weight
sync, the converter and the reference engine all use it.

Quantised (:func:`is_quantized`): the projections SGLang builds as FP8 ``LinearBase`` layers or FP8
experts: attention ``q/k/v/o_proj``, dense MLP ``gate/up/down_proj`` and each expert's. Kept in
bf16: embeddings, the output layer (SGLang's ``ParallelLMHead`` is no Linear), norms and the
router (``mlp.gate``, built with no quantisation).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
"""Appended to a quantised weight's name for its scales: ``...q_proj.weight_scale_inv``."""
_QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")


def is_quantized(hf_name: str) -> bool:
    """Whether an FP8 checkpoint holds ``hf_name`` (a Hugging Face weight name) in FP8 with block scales."""
    return _QUANTIZED.search(hf_name) is not None


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight [out, in], float32 scales [ceil(out/bn), ceil(in/bk)]) of a 2-D ``weight``, on its device.

    In float32, per block: ``factor = 448 / max|w|``, FP8 = ``w x factor`` clamped to +-448 and rounded to
    nearest, scale = ``1 / factor``; an all-zero block gets factor 1 (zeros, scale 1). Edge blocks cover
    what is left. The same arithmetic, to the bit, as transformers' FP8 checkpoint quantiser
    (``integrations/finegrained_fp8.Fp8Quantize``); deterministic on any device.
    """
    if weight.dim() != 2:
        raise ValueError(f"blockwise FP8 quantises 2-D weights; got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    bn, bk = block
    padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    largest = blocks.abs().amax(dim=(1, 3))
    factors = torch.where(largest > 0, E4M3_MAX / torch.where(largest > 0, largest, 1.0), 1.0)
    quantized = (blocks * factors[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return quantized.view(padded.shape)[:rows, :cols].contiguous(), 1.0 / factors


def dequantize_blocks(
    quantized: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``quantized`` (FP8 [out, in]) times its ``block`` = (bn, bk) block's scale, computed in float32, as
    ``dtype`` (SGLang's ``block_quant_dequant``)."""
    rows, cols = quantized.shape
    expanded = scales.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:rows, :cols]
    return (quantized.float() * expanded).to(dtype)


def quantize_named(
    named: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream as an FP8 checkpoint holds it: each quantised weight (:func:`is_quantized`) becomes its FP8
    weight followed by its scales (``<name>_scale_inv``); every other tensor passes unchanged."""
    for name, tensor in named:
        if is_quantized(name):
            quantized, scales = quantize_blocks(tensor, block)
            yield name, quantized
            yield name + SCALE_SUFFIX, scales
        else:
            yield name, tensor
