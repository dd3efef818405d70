"""Layer specs and this rank's GPTModel chunk(s) for a Qwen3 / Qwen3-MoE checkpoint.

The Transformer Engine spec is used when TE is importable and CUDA is present;
otherwise Megatron's local spec, with its norms replaced by our
sequence-parallel-capable :class:`~megatron_rl.models.norm.RMSNorm`. With
virtual pipeline parallelism a rank holds ``vpp`` chunks; chunk ``v`` holds the
layers Megatron assigns to (this pipeline rank, ``vp_stage=v``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_rl.config.hf_config import QwenArchitecture, padded_vocab_size, parse_hf_config
from megatron_rl.models.context_parallel_attention import AllGatherContextAttention
from megatron_rl.models.megatron_config import build_transformer_config
from megatron_rl.models.norm import RMSNorm
from megatron_rl.parallel.device import select_device, transformer_engine_usable
from megatron_rl.parallel.distributed import ParallelSizes


def _local_layer(layer_spec: ModuleSpec, context_parallel: bool) -> ModuleSpec:
    attention = layer_spec.submodules.self_attention
    replaced: dict[str, Any] = {
        name: RMSNorm
        for name in ("q_layernorm", "k_layernorm")
        if getattr(attention.submodules, name) is not IdentityOp
    }
    if context_parallel:
        replaced["core_attention"] = AllGatherContextAttention
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules, **replaced))
    submodules = dataclasses.replace(
        layer_spec.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm, self_attention=attention
    )
    return dataclasses.replace(layer_spec, submodules=submodules)


def build_block_spec(
    config: TransformerConfig, *, use_transformer_engine: bool, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """Decoder block spec of this pipeline rank's chunk ``vp_stage``.

    Dense and MoE layers follow ``config.moe_layer_freq``. The local spec's
    norms are all :class:`RMSNorm` (Megatron's torch-norm wrapper rejects
    sequence parallelism); with context parallelism its core attention is
    :class:`AllGatherContextAttention` (Megatron's local attention has no CP).
    """
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine, normalization="RMSNorm", vp_stage=vp_stage
    )
    if use_transformer_engine:
        return block
    return TransformerBlockSubmodules(
        layer_specs=[_local_layer(spec, config.context_parallel_size > 1) for spec in block.layer_specs],
        layer_norm=RMSNorm,
    )


def build_model_chunks(
    arch: QwenArchitecture,
    config: TransformerConfig,
    *,
    use_transformer_engine: bool = False,
    make_vocab_size_divisible_by: int = 128,
) -> list[GPTModel]:
    """GPTModel chunks held by this rank (one, or ``vpp`` with interleaving).

    Requires :func:`megatron_rl.parallel.distributed.initialize_parallel` first.
    Chunk ``v`` has ``pre_process`` (embedding) only on the first pipeline stage
    with ``v == 0`` and ``post_process`` (final norm, output layer) only on the
    last stage with ``v == vpp - 1``. The vocabulary is padded to a multiple of
    ``make_vocab_size_divisible_by * tp``; padded logits are meaningless and
    must be masked or trimmed by callers (see ``vocab_parallel``). The chunks are on this
    process's device (:func:`~megatron_rl.parallel.device.select_device`), with or without
    Transformer Engine, where the batches go too.
    """
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    vocab = padded_vocab_size(arch.vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=build_block_spec(
                config, use_transformer_engine=use_transformer_engine, vp_stage=stage
            ),
            vocab_size=vocab,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            vp_stage=stage,
        )
        chunks.append(chunk.to(select_device()))
    return chunks


def build_qwen_model(
    hf_config: Mapping[str, Any],
    sizes: ParallelSizes,
    *,
    params_dtype: torch.dtype = torch.bfloat16,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[QwenArchitecture, TransformerConfig, list[GPTModel]]:
    """config.json dict -> (architecture, TransformerConfig, this rank's chunks), TE chosen automatically.

    Weights are freshly initialised; load them with
    :func:`megatron_rl.models.weight_transfer.load_hf_weights` or
    :func:`megatron_rl.models.mcore_checkpoint.load_model_weights`.
    """
    arch = parse_hf_config(hf_config)
    use_te = transformer_engine_usable()
    config = build_transformer_config(
        arch, sizes, params_dtype=params_dtype, use_transformer_engine=use_te, overrides=overrides
    )
    return arch, config, build_model_chunks(arch, config, use_transformer_engine=use_te)
