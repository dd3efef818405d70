"""Blockwise FP8 weights: our quantiser against transformers' FP8 checkpoint quantiser, to the bit; the names and
order a quantised stream carries; the checkpoint format's config and SGLang 0.5.23's shape rules."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

from megatron_rl.checkpoint.fp8_convert import convert_hf_to_fp8
from megatron_rl.config.fp8_checkpoint import checkpoint_block, quantization_config, sglang_block_problems
from megatron_rl.config.hf_config import parse_hf_config
from megatron_rl.wire.fp8_blocks import (
    FP8_DTYPE,
    dequantize_blocks,
    is_quantized,
    quantize_blocks,
    quantize_named,
)
from tests.hf_configs import QWEN3_30B_A3B_CONFIG_FILE
from tests.tiny_checkpoints import save_tiny_moe


def _transformers(block: tuple[int, int]) -> types.SimpleNamespace:
    """What transformers' FP8 conversion ops read of their quantizer: the block and the scale format."""
    return types.SimpleNamespace(
        quantization_config=types.SimpleNamespace(weight_block_size=list(block), scale_fmt=None)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("shape", "block"), [((256, 384), (128, 128)), ((64, 96), (32, 16)), ((32, 32), (32, 32))])
def test_quantisation_is_transformers_fp8_checkpoint_quantisation_to_the_bit(dtype, shape, block):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=generator) * torch.logspace(-4, 1, shape[1])).to(dtype)
    weight[: block[0], : block[1]] = 0  # an all-zero block
    weight[-1, -1] = 1e4  # a block whose largest value is far above the others
    ours, scales = quantize_blocks(weight, block)
    theirs = Fp8Quantize(_transformers(block))._quantize_one("x.weight", weight)
    assert ours.dtype == FP8_DTYPE and scales.dtype == torch.float32
    assert torch.equal(ours.view(torch.uint8), theirs["x.weight"].view(torch.uint8))
    assert torch.equal(scales, theirs["x.weight_scale_inv"])
    back = dequantize_blocks(ours, scales, block, dtype)
    assert torch.equal(back, Fp8Dequantize(_transformers(block))._dequantize_one(ours, scales, dtype))
    # e4m3 keeps 3 mantissa bits: each value within half a step (2^-4 of its binade) plus the block's subnormal step
    step = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1) * 2.0**-9
    assert ((back.float() - weight.float()).abs() <= weight.float().abs() * 2.0**-4 + step).all()


def test_edge_blocks_quantise_what_is_left_as_a_block_of_its_own():
    weight = torch.randn(70, 45, generator=torch.Generator().manual_seed(1))
    quantized, scales = quantize_blocks(weight, (32, 32))
    assert scales.shape == (3, 2)
    corner, corner_scale = quantize_blocks(weight[64:, 32:].contiguous(), (32, 32))
    assert torch.equal(quantized[64:, 32:].view(torch.uint8), corner.view(torch.uint8))
    assert torch.equal(scales[2:, 1:], corner_scale)


def test_a_stream_carries_each_projection_as_its_fp8_weight_then_its_scales():
    named = [
        ("model.embed_tokens.weight", torch.ones(8, 4)),
        ("model.layers.0.self_attn.q_proj.weight", torch.ones(4, 4)),
        ("model.layers.0.self_attn.q_norm.weight", torch.ones(4)),
        ("model.layers.0.mlp.gate.weight", torch.ones(2, 4)),
        ("model.layers.0.mlp.experts.1.down_proj.weight", torch.ones(4, 4)),
        ("lm_head.weight", torch.ones(8, 4)),
    ]
    out = list(quantize_named(named, (2, 2)))
    assert [name for name, _ in out] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.1.down_proj.weight",
        "model.layers.0.mlp.experts.1.down_proj.weight_scale_inv",
        "lm_head.weight",
    ]
    assert [t.dtype for _, t in out].count(FP8_DTYPE) == 2
    assert [is_quantized(name) for name, _ in named] == [False, True, False, False, True, False]


def test_the_converter_writes_an_fp8_checkpoint_sglang_reads(tmp_path: Path):
    source = save_tiny_moe(tmp_path / "bf16")
    out = convert_hf_to_fp8(source, tmp_path / "fp8", (16, 16))
    config = json.loads((out / "config.json").read_text())
    assert checkpoint_block(config) == (16, 16)
    assert config["quantization_config"]["modules_to_not_convert"][:2] == ["lm_head", "model.layers.0.mlp.gate"]
    original = {name: t for path in source.glob("*.safetensors") for name, t in load_file(path).items()}
    converted = {name: t for path in out.glob("*.safetensors") for name, t in load_file(path).items()}
    assert converted.keys() == {*original, *(f"{name}_scale_inv" for name in original if is_quantized(name))}
    for name, tensor in original.items():
        if is_quantized(name):
            quantized, scales = quantize_blocks(tensor, (16, 16))
            assert torch.equal(converted[name].view(torch.uint8), quantized.view(torch.uint8))
            assert torch.equal(converted[f"{name}_scale_inv"], scales)
        else:
            assert torch.equal(converted[name], tensor)
    with pytest.raises(FileExistsError):
        convert_hf_to_fp8(source, out, (16, 16))
    with pytest.raises(ValueError, match="quantised already"):
        convert_hf_to_fp8(out, tmp_path / "again", (16, 16))


def test_checkpoint_block_reads_qwens_fp8_config_and_refuses_other_quantisations():
    assert checkpoint_block({"num_hidden_layers": 2}) is None
    assert checkpoint_block({"quantization_config": quantization_config((128, 128), 48)}) == (128, 128)
    for other in ({"quant_method": "awq"}, quantization_config((128, 128), 1) | {"activation_scheme": "static"}):
        with pytest.raises(ValueError, match="blockwise FP8 only"):
            checkpoint_block({"quantization_config": other})


def test_qwen3_30b_a3b_fits_128_blocks_at_the_recipes_engine_layout_and_the_tiny_model_does_not():
    arch = parse_hf_config(json.loads(QWEN3_30B_A3B_CONFIG_FILE.read_text()))
    assert sglang_block_problems(arch, 4, 4, (128, 128)) == []
    assert sglang_block_problems(arch, 8, 8, (128, 128)) == []  # 4 KV heads over TP 8: one replicated per rank
    assert sglang_block_problems(arch, 8, 2, (128, 128)) == [  # each expert split over MoE TP 4: 768 / 4
        "expert gate_proj / up_proj has 192 output rows per engine rank, not a multiple of the block's 128",
        "expert down_proj has 192 input columns per engine rank, not a multiple of the block's 128",
    ]
    tiny = dataclasses.replace(
        arch, num_attention_heads=4, num_query_groups=2, head_dim=16, moe_ffn_hidden_size=64, hidden_size=64
    )
    problems = sglang_block_problems(tiny, 1, 1, (128, 128))
    assert problems == [
        "q_proj has 64 output rows per engine rank, not a multiple of the block's 128",
        "k_proj / v_proj has 32 output rows per engine rank, not a multiple of the block's 128",
        "expert gate_proj / up_proj has 64 output rows per engine rank, not a multiple of the block's 128",
    ]
    assert sglang_block_problems(tiny, 1, 1, (16, 16)) == []
