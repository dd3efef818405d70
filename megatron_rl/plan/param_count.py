"""Exact parameter counts of a Qwen3 / Qwen3-MoE model per trainer rank and per engine GPU, without torch.

Trainer side: the counts equal ``sum(p.numel())`` over the GPTModel chunks
:func:`megatron_rl.models.builder.build_model_chunks` builds on a rank (pinned by
``tests/distributed/test_param_count.py`` against real Megatron models). They mirror
Megatron-core 0.19.2 as this repo configures it:

- vocabulary padded to a multiple of ``128 * tp`` (:func:`padded_vocab_size`), embedding
  and output layer split over TP by rows;
- the embedding lives on the chunk with ``pre_process`` (pipeline stage 0, virtual stage 0),
  the final norm and output layer on the chunk with ``post_process`` (last stage, last virtual
  stage); with tied embeddings the output layer has no weight of its own only when one chunk
  has both (PP 1), otherwise the last stage holds a copy;
- layers split as Megatron's ``get_transformer_layer_offset`` splits them, evenly or with
  ``parallel.first_stage_layers`` / ``last_stage_layers``
  (:mod:`megatron_rl.config.pipeline_split`);
- attention: fused QKV ``[(heads + 2 kv_heads) * head_dim / tp, hidden]``, output projection
  ``[hidden, heads * head_dim / tp]``, q/k RMSNorms ``[head_dim]`` and the input RMSNorm
  ``[hidden]`` replicated; no biases;
- dense MLP (SwiGLU): ``fc1 [2 ffn / tp, hidden]``, ``fc2 [hidden, ffn / tp]``;
- MoE layer: router ``[experts, hidden]`` replicated (a dense parameter), ``experts / ep``
  local experts each with ``fc1 [2 moe_ffn / etp, hidden]`` and ``fc2 [hidden, moe_ffn / etp]``
  (expert parameters); the pre-MLP RMSNorm ``[hidden]``.

Every TP, EP and ETP rank of one pipeline stage holds the same count (all splits are even).

Engine side: SGLang's sharding of the same model over an engine's TP (and EP inside it).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.hf_config import QwenArchitecture, padded_vocab_size
from megatron_rl.config.pipeline_split import pipeline_split
from megatron_rl.config.schema import ParallelConfig, RolloutConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameter elements, split into dense (reduced over DP) and expert (reduced over expert-DP) ones."""

    dense: int = 0
    expert: int = 0

    @property
    def total(self) -> int:
        """Dense plus expert elements."""
        return self.dense + self.expert

    def __add__(self, other: ParamCount) -> ParamCount:
        return ParamCount(self.dense + other.dense, self.expert + other.expert)


def _attention(arch: QwenArchitecture, tp: int) -> int:
    qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim * arch.hidden_size // tp
    proj = arch.hidden_size * arch.num_attention_heads * arch.head_dim // tp
    norms = arch.hidden_size + 2 * arch.head_dim  # input_layernorm, q_layernorm, k_layernorm
    return qkv + proj + norms


def _mlp(arch: QwenArchitecture, layer: int, parallel: ParallelConfig) -> ParamCount:
    pre_mlp_norm = arch.hidden_size
    if not arch.moe_layer_pattern[layer]:
        return ParamCount(dense=pre_mlp_norm + 3 * arch.ffn_hidden_size * arch.hidden_size // parallel.tp)
    router = arch.num_experts * arch.hidden_size
    per_expert = 3 * arch.moe_ffn_hidden_size * arch.hidden_size // parallel.expert_tp
    return ParamCount(dense=pre_mlp_norm + router, expert=arch.num_experts // parallel.ep * per_expert)


def layer_params(arch: QwenArchitecture, layer: int, parallel: ParallelConfig) -> ParamCount:
    """Elements of decoder layer ``layer`` (0-based) on one rank at ``parallel``."""
    return ParamCount(dense=_attention(arch, parallel.tp)) + _mlp(arch, layer, parallel)


def chunk_layers(num_layers: int, parallel: ParallelConfig, pp_rank: int, vp_stage: int) -> range:
    """Global indices of the decoder layers of chunk ``vp_stage`` on pipeline stage ``pp_rank`` (even or uneven)."""
    return pipeline_split(num_layers, parallel).chunk_layers(pp_rank, vp_stage)


def _vocab_rows(arch: QwenArchitecture, tp: int) -> int:
    return padded_vocab_size(arch.vocab_size, tp) // tp * arch.hidden_size


def chunk_params(arch: QwenArchitecture, parallel: ParallelConfig, pp_rank: int, vp_stage: int) -> ParamCount:
    """Elements of one GPTModel chunk ``(pp_rank, vp_stage)`` on one rank at ``parallel``."""
    vpp = parallel.vpp or 1
    pre_process = pp_rank == 0 and vp_stage == 0
    post_process = pp_rank == parallel.pp - 1 and vp_stage == vpp - 1
    count = ParamCount()
    for layer in chunk_layers(arch.num_layers, parallel, pp_rank, vp_stage):
        count += layer_params(arch, layer, parallel)
    if pre_process:
        count += ParamCount(dense=_vocab_rows(arch, parallel.tp))
    if post_process:
        output = 0 if pre_process and arch.tie_word_embeddings else _vocab_rows(arch, parallel.tp)
        count += ParamCount(dense=arch.hidden_size + output)
    return count


def stage_params(arch: QwenArchitecture, parallel: ParallelConfig, pp_rank: int) -> ParamCount:
    """Elements held by any one rank of pipeline stage ``pp_rank`` (all its virtual chunks)."""
    return sum((chunk_params(arch, parallel, pp_rank, v) for v in range(parallel.vpp or 1)), start=ParamCount())


def model_params(arch: QwenArchitecture) -> ParamCount:
    """Elements of the whole model, unpadded vocabulary (the Hugging Face checkpoint's count)."""
    one_rank = ParallelConfig()
    layers = sum((layer_params(arch, i, one_rank) for i in range(arch.num_layers)), start=ParamCount())
    vocab = arch.vocab_size * arch.hidden_size
    return layers + ParamCount(dense=vocab * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size)


def hf_tensor_counts(arch: QwenArchitecture) -> tuple[int, int]:
    """(dense, expert) tensors of the Hugging Face checkpoint, as a weight sync sends them: per layer 4
    attention projections, 2 QK norms and 2 layer norms, then the router and 3 per expert (MoE layer)
    or 3 MLP projections (dense layer); the embedding, the final norm and, untied, the output layer.
    (Qwen3-30B-A3B: 435 dense + 18,432 expert = 18,867.)"""
    dense, expert = 3 if not arch.tie_word_embeddings else 2, 0
    for layer in range(arch.num_layers):
        dense += 8
        if arch.moe_layer_pattern and arch.moe_layer_pattern[layer]:
            dense += 1
            expert += 3 * arch.num_experts
        else:
            dense += 3
    return dense, expert


def _moe_layers(arch: QwenArchitecture) -> int:
    """How many of the layers are MoE layers."""
    return sum(1 for layer in range(arch.num_layers) if arch.moe_layer_pattern and arch.moe_layer_pattern[layer])


def fp8_projections(arch: QwenArchitecture) -> list[tuple[int, int, int]]:
    """(rows, columns, count) of the weights FP8 rollouts quantise (every attention projection, dense MLP
    projection and expert projection; ``wire.fp8_blocks.is_quantized``), over the whole model."""
    hidden, q_out = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv_out = arch.num_query_groups * arch.head_dim
    moe_layers = _moe_layers(arch)
    dense_layers = arch.num_layers - moe_layers
    return [
        (q_out, hidden, arch.num_layers),
        (kv_out, hidden, 2 * arch.num_layers),
        (hidden, q_out, arch.num_layers),
        (arch.ffn_hidden_size, hidden, 2 * dense_layers),
        (hidden, arch.ffn_hidden_size, dense_layers),
        (arch.moe_ffn_hidden_size, hidden, 2 * arch.num_experts * moe_layers),
        (hidden, arch.moe_ffn_hidden_size, arch.num_experts * moe_layers),
    ]


def fp8_dense_projections(arch: QwenArchitecture) -> int:
    """Tensors FP8 rollouts quantise outside the experts: 4 attention projections a layer, 3 MLP ones a dense
    layer (each gets a scales tensor)."""
    moe_layers = _moe_layers(arch)
    return 4 * arch.num_layers + 3 * (arch.num_layers - moe_layers)


def synced_model_bytes(arch: QwenArchitecture, fp8_block: tuple[int, int] | None) -> int:
    """Bytes of the whole model as a weight sync sends it: bf16, or with FP8 rollouts (``fp8_block`` = (bn, bk))
    each projection in FP8 (1 B) plus its float32 scale per block and the rest in bf16."""
    total = model_params(arch).total * 2
    if fp8_block is None:
        return total
    bn, bk = fp8_block
    for rows, cols, count in fp8_projections(arch):
        total -= rows * cols * count  # 2 B -> 1 B
        total += -(-rows // bn) * -(-cols // bk) * 4 * count
    return total


@dataclass(frozen=True)
class EngineWeights:
    """One engine GPU's weight elements: in GEMMs (quantisable) and the rest (embeddings, norms, router)."""

    gemm: int
    other: int

    def nbytes(self, quantization: str | None) -> int:
        """Bytes in the engine: bf16, or fp8 (1 byte) GEMM weights with ``quantization='fp8'`` (scales ignored)."""
        return self.gemm * (1 if quantization == "fp8" else 2) + self.other * 2


def engine_kv_heads_per_gpu(arch: QwenArchitecture, tp: int) -> int:
    """KV heads each engine GPU stores: ``kv_heads / tp``, at least one (SGLang replicates them when tp exceeds them)."""
    return max(1, arch.num_query_groups // tp)


def engine_gpu_weights(arch: QwenArchitecture, rollout: RolloutConfig) -> EngineWeights:
    """Weight elements on one GPU of an SGLang engine at ``rollout.tp`` / ``rollout.ep``.

    SGLang splits attention heads, the vocabulary and dense MLPs over TP (KV heads replicated
    when TP exceeds them), experts over EP and each expert over ``tp / ep``, so an engine GPU
    holds ``1 / tp`` of the expert weights; norms and the router are replicated. Vocabulary
    padding (to 64 rows) is ignored (< 64 rows).
    """
    tp = rollout.tp
    head_dim, hidden = arch.head_dim, arch.hidden_size
    q_and_out = 2 * arch.num_attention_heads // tp * head_dim * hidden
    kv = 2 * engine_kv_heads_per_gpu(arch, tp) * head_dim * hidden
    gemm = other = 0
    for layer in range(arch.num_layers):
        gemm += q_and_out + kv
        other += 2 * hidden + 2 * head_dim
        if arch.moe_layer_pattern[layer]:
            gemm += arch.num_experts * 3 * arch.moe_ffn_hidden_size * hidden // tp
            other += arch.num_experts * hidden
        else:
            gemm += 3 * arch.ffn_hidden_size * hidden // tp
    vocab = arch.vocab_size * hidden // tp
    other += vocab * (1 if arch.tie_word_embeddings else 2) + hidden
    return EngineWeights(gemm=gemm, other=other)
