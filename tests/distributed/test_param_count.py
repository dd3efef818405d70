"""The planner's parameter counts equal the real Megatron chunks' ``sum(p.numel())`` on every rank.

Models: a dense Qwen3 with tied embeddings (head_dim != hidden / heads), a Qwen3-MoE with a dense
layer (``mlp_only_layers=[1]``) and a Qwen3-MoE with ``decoder_sparse_step=2``; vocabulary 100, so
TP padding (to 128 x tp) shows. Built at each layout on forked gloo ranks (fp32, local spec, no weights
loaded). Megatron marks expert weights ``allreduce=False`` (reduced over expert-DP) only when it uses
the expert groups (ep > 1 or etp != tp); otherwise they are reduced over DP, which then has the same
ranks, and count as dense there.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config.hf_config import parse_hf_config
from megatron_rl.config.schema import ParallelConfig
from megatron_rl.models.builder import build_model_chunks
from megatron_rl.models.megatron_config import build_transformer_config
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.plan.param_count import ParamCount, stage_params
from tests.distributed_utils import run_distributed

_COMMON = {
    "vocab_size": 100,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
}
CONFIGS = {
    "dense_tied": {
        "architectures": ["Qwen3ForCausalLM"],
        "intermediate_size": 64,
        "tie_word_embeddings": True,
        **_COMMON,
    },
    "moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,
        **_COMMON,
    },
    "moe_sparse_step": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 2,
        "tie_word_embeddings": False,
        **_COMMON,
    },
}
LAYOUTS = [  # (tp, pp, ep, etp, vpp), world size
    pytest.param((1, 1, 1, 1, None), 1, id="tp1-pp1-ep1-etp1"),
    pytest.param((2, 1, 2, 1, None), 2, id="tp2-pp1-ep2-etp1"),
    pytest.param((1, 2, 2, 1, None), 4, id="tp1-pp2-ep2-etp1"),
    pytest.param((2, 2, 1, 2, None), 4, id="tp2-pp2-ep1-etp2"),
    pytest.param((1, 2, 2, 1, 2), 4, id="tp1-pp2-vpp2-ep2-etp1"),
]


def _count_rank(rank: int, world_size: int, sizes: ParallelSizes, configs: dict) -> dict:
    from megatron.core import parallel_state

    initialize_parallel(sizes)
    counts = {"pp_rank": parallel_state.get_pipeline_model_parallel_rank()}
    for name, config in configs.items():
        arch = parse_hf_config(config)
        chunks = build_model_chunks(arch, build_transformer_config(arch, sizes, params_dtype=torch.float32))
        params = [p for chunk in chunks for p in chunk.parameters()]
        expert = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
        counts[name] = ParamCount(dense=sum(p.numel() for p in params) - expert, expert=expert)
    destroy_parallel()
    return counts


@pytest.mark.distributed
@pytest.mark.parametrize("layout, world_size", LAYOUTS)
def test_planner_counts_equal_megatron_chunks(layout: tuple, world_size: int) -> None:
    tp, pp, ep, etp, vpp = layout
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp)
    parallel = ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, sequence_parallel=tp > 1)
    configs = {name: config for name, config in CONFIGS.items() if ep == 1 or name != "dense_tied"}
    per_rank = run_distributed(_count_rank, world_size, sizes, configs)
    expert_groups = ep > 1 or etp != tp
    for rank, counts in enumerate(per_rank):
        for name, config in configs.items():
            planned = stage_params(parse_hf_config(config), parallel, counts["pp_rank"])
            if not expert_groups:
                planned = ParamCount(dense=planned.total)
            assert planned == counts[name], f"rank {rank} {name}: planned {planned}, Megatron {counts[name]}"
