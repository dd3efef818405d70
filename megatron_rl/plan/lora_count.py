"""Exact element counts of a recipe's LoRA adapters (``lora:``) per trainer rank, per engine GPU and whole.

An adapter on a projection ``W [out, in]`` is ``A [r, in]`` and ``B [out, r]``. Qwen3's projections
(``in``, ``out``): q_proj (h, a d), k_proj and v_proj (h, g d), o_proj (a d, h); gate_proj and up_proj
(h, f), down_proj (f, h), with ``f`` the dense FFN size in a dense layer and the expert FFN size for
each routed expert of a MoE layer.

Sharding rule (Megatron's column/row-parallel layers, and SGLang's ``lora/mem_pool.py`` shapes): an
adapter is sharded like the layer it adapts, on the dimension the base weight is split on:

- column-parallel (q/k/v, gate/up; the base splits ``out``): ``A [r, in]`` whole on every rank,
  ``B [out / t, r]`` split;
- row-parallel (o_proj, down_proj; the base splits ``in``): ``A [r, in / t]`` split,
  ``B [out, r]`` whole on every rank;

with ``t`` the TP size for attention and dense MLPs and the expert TP size for experts; k/v keep at
least one KV head per rank (SGLang replicates KV heads beyond TP; Megatron needs ``g % tp == 0``).
A rank holds the adapters of its ``experts / ep`` local experts. With ``experts_shared_outer``,
a MoE layer has one gate/up ``A`` and one down ``B`` for all its experts (SGLang's
``--experts-shared-outer-loras``): whole on every rank and counted as dense parameters (reduced over
all data-parallel ranks, as a replicated weight is), the per-expert ``B`` (gate/up) and ``A`` (down)
as expert parameters.
"""

from __future__ import annotations

from collections.abc import Collection

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.config.schema import LoRAConfig, ParallelConfig, RolloutConfig
from megatron_rl.plan.param_count import ParamCount, chunk_layers, engine_kv_heads_per_gpu

COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _dims(arch: QwenArchitecture, target: str, ffn: int) -> tuple[int, int]:
    """(in, out) of ``target`` whole; ``ffn`` the MLP's intermediate size."""
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, ffn),
        "up_proj": (h, ffn),
        "down_proj": (ffn, h),
    }[target]


def _a_b(arch: QwenArchitecture, target: str, ffn: int, rank: int, shards: int, kv_heads: int) -> tuple[int, int]:
    """Elements of (A, B) on one rank of ``shards`` (module docstring's sharding rule)."""
    fan_in, fan_out = _dims(arch, target, ffn)
    if target in ("k_proj", "v_proj"):
        return rank * fan_in, kv_heads * arch.head_dim * rank
    if target in COLUMN_PARALLEL:
        return rank * fan_in, fan_out // shards * rank
    return rank * fan_in // shards, fan_out * rank


def layer_adapter(
    arch: QwenArchitecture,
    layer: int,
    lora: LoRAConfig,
    parallel: ParallelConfig,
    targets: Collection[str] | None = None,
) -> ParamCount:
    """Adapter elements of decoder layer ``layer`` on one rank at ``parallel`` (``targets``: default
    ``lora.target_modules``)."""
    chosen = set(lora.target_modules if targets is None else targets)
    kv_heads = engine_kv_heads_per_gpu(arch, parallel.tp)
    dense = sum(sum(_a_b(arch, t, 0, lora.rank, parallel.tp, kv_heads)) for t in ATTENTION_TARGETS if t in chosen)
    mlp = [t for t in MLP_TARGETS if t in chosen]
    if not arch.moe_layer_pattern[layer]:
        dense += sum(sum(_a_b(arch, t, arch.ffn_hidden_size, lora.rank, parallel.tp, kv_heads)) for t in mlp)
        return ParamCount(dense=dense)
    local_experts, expert = arch.num_experts // parallel.ep, 0
    for target in mlp:
        a, b = _a_b(arch, target, arch.moe_ffn_hidden_size, lora.rank, parallel.expert_tp, kv_heads)
        if not lora.experts_shared_outer:
            expert += local_experts * (a + b)
        elif target == "down_proj":  # shared B, per-expert A
            dense, expert = dense + b, expert + local_experts * a
        else:  # gate/up: shared A, per-expert B
            dense, expert = dense + a, expert + local_experts * b
    return ParamCount(dense=dense, expert=expert)


def stage_adapter(arch: QwenArchitecture, lora: LoRAConfig, parallel: ParallelConfig, pp_rank: int) -> ParamCount:
    """Adapter elements held by one rank of pipeline stage ``pp_rank`` (all its virtual chunks)."""
    layers = [layer for v in range(parallel.vpp or 1) for layer in chunk_layers(arch.num_layers, parallel, pp_rank, v)]
    return sum((layer_adapter(arch, layer, lora, parallel) for layer in layers), start=ParamCount())


def whole_adapter(arch: QwenArchitecture, lora: LoRAConfig) -> ParamCount:
    """Elements of the whole adapter (the PEFT export, and what one sync sends)."""
    one_rank = ParallelConfig()
    return sum((layer_adapter(arch, i, lora, one_rank) for i in range(arch.num_layers)), start=ParamCount())


def _engine_parallel(rollout: RolloutConfig) -> ParallelConfig:
    """SGLang's split of an engine: attention and dense MLPs over ``tp``, experts over ``ep``, each expert over
    ``tp / ep``."""
    return ParallelConfig(tp=rollout.tp, ep=rollout.ep, etp=max(1, rollout.tp // rollout.ep))


def engine_adapter(arch: QwenArchitecture, lora: LoRAConfig, rollout: RolloutConfig) -> ParamCount:
    """Adapter elements one engine GPU holds of the adapter the trainer sends (its shard)."""
    parallel = _engine_parallel(rollout)
    return sum((layer_adapter(arch, i, lora, parallel) for i in range(arch.num_layers)), start=ParamCount())


def engine_slot(arch: QwenArchitecture, lora: LoRAConfig, rollout: RolloutConfig) -> ParamCount:
    """Elements of one adapter slot of SGLang's LoRA memory pool on one engine GPU: SGLang stacks q/k/v into
    qkv_proj and gate/up into gate_up_proj (``lora/utils.py`` ``get_normalized_target_modules``), so a slot
    holds all three (both) whenever one is a target."""
    targets = set(lora.target_modules)
    if targets & {"q_proj", "k_proj", "v_proj"}:
        targets |= {"q_proj", "k_proj", "v_proj"}
    if targets & {"gate_proj", "up_proj"}:
        targets |= {"gate_proj", "up_proj"}
    parallel = _engine_parallel(rollout)
    return sum((layer_adapter(arch, i, lora, parallel, targets) for i in range(arch.num_layers)), start=ParamCount())


def largest_adapter_tensor(arch: QwenArchitecture, lora: LoRAConfig) -> int:
    """Elements of the adapter's largest tensor as a sync sends it (whole): an A or a B, or with
    ``experts_shared_outer`` a 3-D per-expert B (gate/up) or A (down) of all a layer's experts."""
    sizes = []
    for target in lora.target_modules:
        for layer in range(arch.num_layers):
            moe = bool(arch.moe_layer_pattern[layer])
            ffn = arch.moe_ffn_hidden_size if moe else arch.ffn_hidden_size
            a, b = _a_b(arch, target, ffn, lora.rank, 1, arch.num_query_groups)
            if moe and lora.experts_shared_outer and target in MLP_TARGETS:
                a, b = (a * arch.num_experts, b) if target == "down_proj" else (a, b * arch.num_experts)
            sizes += [a, b]
    return max(sizes)


def adapter_tensor_counts(arch: QwenArchitecture, lora: LoRAConfig) -> tuple[int, int]:
    """(dense, expert) tensors of the PEFT adapter as a sync sends them: an A and a B per target and layer; in a
    MoE layer, per routed expert (expert tensors), or with ``experts_shared_outer`` one 3-D A and one 3-D B per
    MLP target for all experts (dense: every engine rank loads them)."""
    attention = 2 * sum(1 for t in lora.target_modules if t in ATTENTION_TARGETS)
    mlp = 2 * sum(1 for t in lora.target_modules if t in MLP_TARGETS)
    dense = expert = 0
    for layer in range(arch.num_layers):
        dense += attention
        if arch.moe_layer_pattern[layer] and not lora.experts_shared_outer:
            expert += mlp * arch.num_experts
        else:
            dense += mlp
    return dense, expert
