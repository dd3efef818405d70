"""FP8 rollouts against SGLang 0.5.23's own FP8 code (CPU, imported from the pinned set ``.ci/run`` installs into
``.sglang-protocol``; run with ``PYTHONPATH=.sglang-protocol``).

SGLang's ``Fp8Config.from_config`` reads our checkpoint's ``quantization_config`` as serialised block FP8;
the parameters its ``Fp8LinearMethod`` / ``Fp8MoEMethod`` create for a Qwen3-MoE layer (merged q/k/v and
gate/up, fused experts) have exactly the FP8 dtype and the scale rows and columns our per-projection
tensors add up to; the router and the output layer stay unquantised; and our dequantisation is its
``block_quant_dequant``, to the bit.
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from megatron_rl.config.fp8_checkpoint import quantization_config
from megatron_rl.wire.fp8_blocks import FP8_DTYPE, dequantize_blocks, quantize_blocks

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="sglang 0.5.23 not installed (see module docstring)"
)
BLOCK = (128, 128)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, EXPERT_FFN, LAYERS = 512, 4, 2, 128, 4, 256, 2


class _LinearLayer(torch.nn.Module):
    """The module SGLang's ``Fp8LinearMethod.create_weights`` fills: the attributes it reads and the parameters it
    registers, declared for the type checker (a Module's attribute is otherwise a Tensor or a Module)."""

    tp_group: None
    weight: torch.nn.Parameter
    weight_scale_inv: torch.nn.Parameter


class _ExpertsLayer(torch.nn.Module):
    """The module SGLang's ``Fp8MoEMethod.create_weights`` fills, declared as :class:`_LinearLayer` is."""

    moe_tp_size: int
    moe_runner_config: types.SimpleNamespace
    w13_weight: torch.nn.Parameter
    w13_weight_scale_inv: torch.nn.Parameter
    w2_weight: torch.nn.Parameter
    w2_weight_scale_inv: torch.nn.Parameter


def _our_shapes(name: str, rows: int, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    quantized, scales = quantize_blocks(torch.zeros(rows, cols), BLOCK)
    assert quantized.dtype == FP8_DTYPE, name
    return tuple(quantized.shape), tuple(scales.shape)


@pytest.fixture(scope="module")
def fp8_config():
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    return Fp8Config.from_config(quantization_config(BLOCK, LAYERS))


@needs_sglang
def test_sglang_reads_our_config_as_serialised_block_fp8_keeping_router_and_output_layer(fp8_config):
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    assert fp8_config.is_checkpoint_fp8_serialized and fp8_config.weight_block_size == list(BLOCK)
    assert fp8_config.activation_scheme == "dynamic"
    for prefix in ("lm_head", "model.layers.1.mlp.gate"):
        assert is_layer_skipped(prefix, fp8_config.ignored_layers)
    for prefix in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.experts"):
        assert not is_layer_skipped(prefix, fp8_config.ignored_layers)


@needs_sglang
def test_sglangs_merged_fp8_linears_take_our_projections_weights_and_scales(fp8_config):
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    layers = {
        "qkv_proj": ([q_out, kv_out, kv_out], HIDDEN, ["q_proj", "k_proj", "v_proj"]),
        "o_proj": ([HIDDEN], q_out, ["o_proj"]),
    }
    for merged, (outputs, inputs, ours) in layers.items():
        layer = _LinearLayer()
        layer.tp_group = None
        Fp8LinearMethod(fp8_config).create_weights(layer, inputs, outputs, inputs, sum(outputs), torch.bfloat16)
        shapes = [_our_shapes(name, rows, inputs) for name, rows in zip(ours, outputs, strict=True)]
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale_inv.dtype == torch.float32, merged
        assert tuple(layer.weight.shape) == (sum(s[0][0] for s in shapes), inputs)
        assert tuple(layer.weight_scale_inv.shape) == (sum(s[1][0] for s in shapes), shapes[0][1][1])


@needs_sglang
def test_sglangs_fp8_experts_take_each_experts_weights_and_scales(fp8_config):
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod

    layer = _ExpertsLayer()
    layer.moe_tp_size = 1
    layer.moe_runner_config = types.SimpleNamespace(is_gated=True)
    Fp8MoEMethod(fp8_config).create_weights(layer, EXPERTS, HIDDEN, EXPERT_FFN, torch.bfloat16)
    gate = _our_shapes("gate_proj", EXPERT_FFN, HIDDEN)
    down = _our_shapes("down_proj", HIDDEN, EXPERT_FFN)
    assert layer.w13_weight.dtype == layer.w2_weight.dtype == FP8_DTYPE
    assert tuple(layer.w13_weight.shape) == (EXPERTS, 2 * gate[0][0], HIDDEN)  # gate and up of each expert
    assert tuple(layer.w13_weight_scale_inv.shape) == (EXPERTS, 2 * gate[1][0], gate[1][1])
    assert tuple(layer.w2_weight.shape) == (EXPERTS, *down[0])
    assert tuple(layer.w2_weight_scale_inv.shape) == (EXPERTS, *down[1])


@needs_sglang
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_our_dequantisation_is_sglangs_block_quant_dequant_to_the_bit(dtype):
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(3)).to(dtype)
    quantized, scales = quantize_blocks(weight, BLOCK)
    ours = dequantize_blocks(quantized, scales, BLOCK, dtype)
    assert torch.equal(ours, block_quant_dequant(quantized, scales, list(BLOCK), dtype))
