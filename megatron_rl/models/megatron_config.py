"""QwenArchitecture + parallel sizes -> Megatron-core ``TransformerConfig``.

Every math-changing field of :class:`~megatron_rl.config.hf_config.QwenArchitecture`
maps to one TransformerConfig field here; the mapping is the single place
where Hugging Face semantics meet Megatron's:

- ``head_dim`` -> ``kv_channels`` (may differ from hidden / heads);
- ``norm_topk_prob`` -> ``moe_router_pre_softmax = not norm_topk_prob``
  (Megatron's softmax-after-top-k equals a renormalised top-k softmax);
- the router runs in fp32 (``moe_router_dtype="fp32"``), like Hugging Face;
- ``mlp_only_layers`` / ``decoder_sparse_step`` -> ``moe_layer_freq`` as a list.

Vocabulary padding (:func:`~megatron_rl.config.hf_config.padded_vocab_size`, torch-free) follows Megatron-LM's rule: the
embedding rows are padded to a multiple of ``make_vocab_size_divisible_by * tp``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.config.pipeline_split import PipelineSplit
from megatron_rl.parallel.distributed import ParallelSizes


def check_layout(arch: QwenArchitecture, sizes: ParallelSizes) -> None:
    """Raise ValueError naming the parallel size the architecture cannot be split by."""
    if arch.num_attention_heads % sizes.tp or arch.num_query_groups % sizes.tp:
        raise ValueError(
            f"tp={sizes.tp} must divide num_attention_heads={arch.num_attention_heads} "
            f"and num_key_value_heads={arch.num_query_groups}"
        )
    if arch.ffn_hidden_size % sizes.tp:
        raise ValueError(f"tp={sizes.tp} must divide intermediate_size={arch.ffn_hidden_size}")
    split = PipelineSplit(arch.num_layers, sizes.pp, sizes.vpp, sizes.first_stage_layers, sizes.last_stage_layers)
    if (problem := split.problem()) is not None:
        raise ValueError(problem)
    if arch.is_moe:
        if arch.num_experts % sizes.ep:
            raise ValueError(f"ep={sizes.ep} must divide num_experts={arch.num_experts}")
        if arch.moe_ffn_hidden_size % sizes.expert_tp:
            raise ValueError(f"etp={sizes.expert_tp} must divide moe_intermediate_size={arch.moe_ffn_hidden_size}")
    elif sizes.ep > 1:
        raise ValueError(f"ep={sizes.ep} > 1 needs a MoE model; {arch.architecture} has no experts")


def _moe_fields(arch: QwenArchitecture, on_gpu: bool) -> dict[str, Any]:
    if not arch.is_moe:
        return {}
    return {
        "num_moe_experts": arch.num_experts,
        "moe_router_topk": arch.moe_router_topk,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_layer_freq": list(arch.moe_layer_pattern),
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall" if on_gpu else "allgather",
        "moe_grouped_gemm": on_gpu,
    }


def build_transformer_config(
    arch: QwenArchitecture,
    sizes: ParallelSizes,
    *,
    params_dtype: torch.dtype = torch.bfloat16,
    use_transformer_engine: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> TransformerConfig:
    """Build the TransformerConfig for ``arch`` at ``sizes``.

    Sequence parallelism is on whenever tp > 1 (Megatron requires it for MoE
    with TP). ``use_transformer_engine`` also selects grouped-GEMM experts and
    the all-to-all dispatcher; without it (CPU) experts are SequentialMLP and
    tokens go through the all-gather dispatcher, which needs no CUDA streams
    but does not support ``variable_seq_lengths``: on CPU every micro-batch of
    one pipeline schedule call must have the same sequence length.
    ``overrides`` are extra TransformerConfig fields (recompute, aux-loss, ...)
    applied last; they must not contradict the checkpoint's math.
    """
    check_layout(arch, sizes)
    fields: dict[str, Any] = {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "kv_channels": arch.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": arch.rms_norm_eps,
        "qk_layernorm": True,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "hidden_dropout": 0.0,
        "attention_dropout": arch.attention_dropout,
        "tensor_model_parallel_size": sizes.tp,
        "pipeline_model_parallel_size": sizes.pp,
        "virtual_pipeline_model_parallel_size": sizes.vpp,
        "num_layers_in_first_pipeline_stage": sizes.first_stage_layers,
        "num_layers_in_last_pipeline_stage": sizes.last_stage_layers,
        "context_parallel_size": sizes.cp,
        "expert_model_parallel_size": sizes.ep,
        "expert_tensor_parallel_size": sizes.expert_tp,
        "sequence_parallel": sizes.tp > 1,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        "variable_seq_lengths": use_transformer_engine,
        "transformer_impl": "transformer_engine" if use_transformer_engine else "local",
        "use_cpu_initialization": not use_transformer_engine,
        **_moe_fields(arch, on_gpu=use_transformer_engine),
    }
    fields.update(overrides or {})
    return TransformerConfig(**fields)
