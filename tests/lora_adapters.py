"""Random PEFT adapters (every A and B nonzero) for the tiny Qwen3 / Qwen3-MoE models, in PEFT's per-expert
(transformers v4 name) form."""

from __future__ import annotations

import torch

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.config.schema import LoRAConfig


def _shapes(arch: QwenArchitecture, layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) of every adaptable projection of ``layer``, by module name under ``model.layers.{layer}``."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv)}
    shapes["self_attn.o_proj"] = (q, h)
    moe = arch.is_moe and bool(arch.moe_layer_pattern[layer])
    ffn = arch.moe_ffn_hidden_size if moe else arch.ffn_hidden_size
    prefixes = [f"mlp.experts.{e}" for e in range(arch.num_experts)] if moe else ["mlp"]
    for prefix in prefixes:
        shapes |= {f"{prefix}.gate_proj": (h, ffn), f"{prefix}.up_proj": (h, ffn), f"{prefix}.down_proj": (ffn, h)}
    return shapes


def random_peft_adapter(arch: QwenArchitecture, lora: LoRAConfig, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT ``adapter_model.safetensors`` state for ``lora.target_modules``: A ~ U(-1/sqrt(in), 1/sqrt(in)) as
    PEFT's init, B ~ N(0, 0.1^2) (nonzero, unlike PEFT's zero init, so the adapter changes the logits)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(arch.num_layers):
        for module, (fan_in, fan_out) in _shapes(arch, layer).items():
            if module.rsplit(".", 1)[-1] not in lora.target_modules:
                continue
            name = f"base_model.model.model.layers.{layer}.{module}"
            bound = fan_in**-0.5
            state[f"{name}.lora_A.weight"] = (torch.rand(lora.rank, fan_in, generator=generator) * 2 - 1) * bound
            state[f"{name}.lora_B.weight"] = torch.randn(fan_out, lora.rank, generator=generator) * 0.1
    return state
