"""The FP8 checkpoint format of FP8 rollouts, torch-free: its ``quantization_config`` and SGLang's shape rules.

Qwen's FP8 releases (and DeepSeek-V3's) store each quantised projection as an ``float8_e4m3fn``
weight and a float32 ``weight_scale_inv`` per ``[bn, bk]`` block, and say so in config.json's
``quantization_config``, which SGLang 0.5.23's ``Fp8Config.from_config`` reads. The tensor math is
``megatron_rl.wire.fp8_blocks``.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.config.hf_config import QwenArchitecture

_FORMAT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def quantization_config(block: tuple[int, int], num_layers: int) -> dict[str, Any]:
    """config.json's ``quantization_config`` of an FP8 checkpoint with ``block`` = (bn, bk), as Qwen's FP8 releases
    write it: ``modules_to_not_convert`` lists what stays bf16 besides embeddings and norms (the output layer and
    each layer's router)."""
    not_converted = ["lm_head", *(f"model.layers.{layer}.mlp.gate" for layer in range(num_layers))]
    return _FORMAT | {"weight_block_size": list(block), "modules_to_not_convert": not_converted}


def checkpoint_block(config: dict[str, Any]) -> tuple[int, int] | None:
    """The (bn, bk) of the FP8 block checkpoint whose config.json holds ``config``; None when it is not quantised.

    Raises ValueError for a quantisation FP8 rollouts do not load (another method, format or activation scheme,
    or no 2-element ``weight_block_size``), naming it."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    block = quant.get("weight_block_size")
    if {key: quant.get(key) for key in _FORMAT} != _FORMAT or not (isinstance(block, list) and len(block) == 2):
        raise ValueError(
            f"quantization_config {quant}: FP8 rollouts load blockwise FP8 only (quant_method fp8, fmt e4m3, "
            "activation_scheme dynamic, a 2-element weight_block_size)"
        )
    return int(block[0]), int(block[1])


def sglang_block_problems(arch: QwenArchitecture, tp: int, ep: int, block: tuple[int, int]) -> list[str]:
    """Why SGLang 0.5.23 would refuse FP8 ``block`` = (bn, bk) for ``arch`` at engine TP ``tp`` x EP ``ep``: empty
    when it loads.

    Its rules (``srt/layers/quantization/fp8.py``: ``validate_block_quant_shapes``, ``create_fp8_moe_weight_``):
    every output partition of a merged layer (q/k/v, gate/up) or of a column-parallel one at TP > 1 is a
    multiple of bn; the input of a row-parallel layer (o_proj, down_proj) is a multiple of bk at TP > 1; an
    expert's intermediate size per MoE TP rank (``tp / ep``) is a multiple of bn, and of bk at MoE TP > 1.
    KV heads are replicated where TP exceeds them.
    """
    bn, bk = block
    moe_tp = tp // ep
    q_out = arch.num_attention_heads * arch.head_dim // tp
    kv_out = max(1, arch.num_query_groups // tp) * arch.head_dim
    problems = []
    outputs = {"q_proj": q_out, "k_proj / v_proj": kv_out}
    inputs = {"o_proj": q_out}
    if not all(arch.moe_layer_pattern) or not arch.is_moe:
        outputs["dense gate_proj / up_proj"] = arch.ffn_hidden_size // tp
        inputs["dense down_proj"] = arch.ffn_hidden_size // tp
    if arch.is_moe:
        outputs["expert gate_proj / up_proj"] = arch.moe_ffn_hidden_size // moe_tp
        if moe_tp > 1:
            inputs["expert down_proj"] = arch.moe_ffn_hidden_size // moe_tp
    for name, size in outputs.items():
        if size % bn:
            problems.append(f"{name} has {size} output rows per engine rank, not a multiple of the block's {bn}")
    if tp > 1:
        for name, size in inputs.items():
            if size % bk:
                problems.append(f"{name} has {size} input columns per engine rank, not a multiple of the block's {bk}")
    return problems
