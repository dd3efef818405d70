"""config.json -> QwenArchitecture -> TransformerConfig: every math field mapped, the rest refused."""

from typing import Any

import pytest
import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from megatron_rl.config.hf_config import UnsupportedConfigError, padded_vocab_size, parse_hf_config
from megatron_rl.models.megatron_config import build_transformer_config, check_layout
from megatron_rl.parallel.distributed import ParallelSizes
from tests.hf_configs import QWEN3_30B_A3B


def _moe_config(**overrides) -> dict:
    fields: dict[str, Any] = dict(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        max_position_embeddings=512,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
    )
    config = Qwen3MoeConfig(**(fields | overrides)).to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    return config


def test_moe_fields_map_to_megatron_semantics():
    arch = parse_hf_config(_moe_config())
    config = build_transformer_config(arch, ParallelSizes(), params_dtype=torch.float32)
    assert (config.kv_channels, config.num_query_groups, config.layernorm_epsilon) == (24, 2, 1e-5)
    assert arch.rope_theta == 5e5 and arch.max_position_embeddings == 512
    assert config.moe_layer_freq == [0, 1, 1, 1]
    assert config.moe_router_pre_softmax is False  # norm_topk_prob=True: softmax over the top-k
    assert config.moe_router_dtype == "fp32" and config.moe_router_topk == 2
    assert config.moe_ffn_hidden_size == 16 and config.ffn_hidden_size == 64


def test_decoder_sparse_step_and_unnormalised_topk():
    arch = parse_hf_config(_moe_config(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False))
    config = build_transformer_config(arch, ParallelSizes(), params_dtype=torch.float32)
    assert config.moe_layer_freq == [0, 1, 0, 1]
    assert config.moe_router_pre_softmax is True


def test_legacy_rope_theta_and_num_local_experts_spellings_are_read():
    config = _moe_config()
    config.pop("rope_parameters")
    config["rope_theta"] = 1e6
    config["num_local_experts"] = config.pop("num_experts", 4)
    arch = parse_hf_config(config)
    assert arch.rope_theta == 1e6 and arch.num_experts == 4


def test_dense_qwen3_has_no_moe_layers_and_head_dim_defaults_to_hidden_over_heads():
    config = Qwen3Config(
        vocab_size=100,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=64,
        tie_word_embeddings=True,
    ).to_dict()
    config.update(architectures=["Qwen3ForCausalLM"], head_dim=None)
    arch = parse_hf_config(config)
    assert not arch.is_moe and arch.head_dim == 8 and arch.tie_word_embeddings
    assert build_transformer_config(arch, ParallelSizes(tp=2)).num_moe_experts is None


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_fields_are_refused_by_name(overrides, field):
    with pytest.raises(UnsupportedConfigError, match=field):
        parse_hf_config(_moe_config(**overrides))


def test_rope_scaling_and_unknown_architecture_are_refused():
    with pytest.raises(UnsupportedConfigError, match="rope_scaling"):
        parse_hf_config(_moe_config() | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(UnsupportedConfigError, match="architectures"):
        parse_hf_config(_moe_config() | {"architectures": ["LlamaForCausalLM"]})


def test_layout_errors_name_the_size_that_does_not_divide():
    arch = parse_hf_config(_moe_config())
    with pytest.raises(ValueError, match="ep=3"):
        check_layout(arch, ParallelSizes(ep=3))
    with pytest.raises(ValueError, match="tp=4"):
        check_layout(arch, ParallelSizes(tp=4))


def test_vocab_is_padded_to_a_multiple_of_divisor_times_tp():
    assert padded_vocab_size(100, tp=1) == 128
    assert padded_vocab_size(100, tp=2) == 256
    assert padded_vocab_size(151936, tp=1) == 151936
    assert padded_vocab_size(151936, tp=4) == 152064


def test_qwen3_30b_a3b_maps_at_a_production_layout():
    arch = parse_hf_config(QWEN3_30B_A3B)
    config = build_transformer_config(arch, ParallelSizes(tp=4, pp=2, ep=8, etp=1))
    assert config.kv_channels == 128 and config.hidden_size == 2048  # 32 heads * 128 != 2048
    assert config.moe_layer_freq == [1] * 48 and config.num_moe_experts == 128 and config.moe_router_topk == 8
    assert config.sequence_parallel and config.params_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="tp=8 must divide .* num_key_value_heads=4"):
        check_layout(arch, ParallelSizes(tp=8))


def test_disagreeing_expert_count_spellings_are_refused():
    with pytest.raises(UnsupportedConfigError, match="disagree"):
        parse_hf_config(QWEN3_30B_A3B | {"num_local_experts": 64})


def test_shipped_qwen3_30b_a3b_config_holds_the_published_values():
    arch = parse_hf_config(QWEN3_30B_A3B)
    assert (arch.architecture, arch.hidden_size, arch.num_layers, arch.vocab_size) == (
        "Qwen3MoeForCausalLM",
        2048,
        48,
        151936,
    )
    assert (arch.num_attention_heads, arch.num_query_groups, arch.head_dim) == (32, 4, 128)
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_ffn_hidden_size, arch.ffn_hidden_size) == (
        128,
        8,
        768,
        6144,
    )
    assert arch.moe_layer_pattern == (1,) * 48 and arch.norm_topk_prob and not arch.tie_word_embeddings
    assert (arch.rope_theta, arch.max_position_embeddings, arch.rms_norm_eps) == (1e6, 40960, 1e-6)
    assert (QWEN3_30B_A3B["bos_token_id"], QWEN3_30B_A3B["eos_token_id"]) == (151643, 151645)
    assert QWEN3_30B_A3B["torch_dtype"] == "bfloat16"
