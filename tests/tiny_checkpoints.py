"""Tiny Qwen3 / Qwen3-MoE Hugging Face checkpoints built locally (random init, fp32).

Weights are re-drawn with a larger scale than Hugging Face's init and every
norm weight is randomised, so that a swapped or mis-sliced tensor (q_norm vs
k_norm, gate vs up, a wrong KV group) changes the logits visibly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 100

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)


def save_tiny_dense(path: Path) -> Path:
    """Qwen3 dense, 4 layers, GQA 4/2 heads, head_dim 16 != hidden/heads, tied embeddings."""
    config = Qwen3Config(intermediate_size=64, tie_word_embeddings=True, **_COMMON)
    model = Qwen3ForCausalLM(config)
    _randomise(model, seed=1)
    model.save_pretrained(path)
    return path


def save_tiny_moe(
    path: Path,
    *,
    sparse_step: bool = False,
    dtype: torch.dtype = torch.float32,
    vocab_size: int = VOCAB,
    max_position_embeddings: int = 64,
    all_sparse: bool = False,
) -> Path:
    """Qwen3-MoE, 4 layers, 4 experts top-2, untied embeddings.

    Default: layer 1 dense via ``mlp_only_layers``, normalised top-k (as Qwen3-30B-A3B).
    ``sparse_step=True``: every second layer dense via ``decoder_sparse_step=2``,
    un-normalised top-k probabilities. ``dtype``: the saved weights' dtype. ``vocab_size``:
    e.g. 256, which Megatron does not pad at TP 2 (the default 100 is padded to 256).
    ``max_position_embeddings``: room for long generations (RoPE has no learnt positions).
    ``all_sparse=True``: every layer MoE, as Qwen3-30B-A3B (SGLang 0.5.23 serves no other kind).
    """
    routing: dict[str, Any] = (
        dict(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2)
        if sparse_step
        else dict(norm_topk_prob=True, mlp_only_layers=[] if all_sparse else [1], decoder_sparse_step=1)
    )
    config = Qwen3MoeConfig(
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        **routing,
        **{**_COMMON, "vocab_size": vocab_size, "max_position_embeddings": max_position_embeddings},
    )
    model = Qwen3MoeForCausalLM(config)
    _randomise(model, seed=2)
    # transformers wraps PreTrainedModel.to in a decorator whose type takes the model as its first argument
    model.to(dtype).save_pretrained(path)  # type: ignore[arg-type]
    return path


def checkpoint_named_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The ``.grad`` of every parameter of a transformers model under its on-disk (checkpoint) name.

    transformers keeps the experts fused in memory (``gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I]); the checkpoint, and so our export, names one
    tensor per expert and projection.
    """
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} has no gradient"
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("mlp.experts.gate_up_proj"):
            for expert, (gate, up) in enumerate(g.chunk(2) for g in param.grad):
                grads[f"{prefix}.{expert}.gate_proj.weight"], grads[f"{prefix}.{expert}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            grads |= {f"{prefix}.{expert}.down_proj.weight": g for expert, g in enumerate(param.grad)}
        else:
            grads[name] = param.grad
    return grads


def chain_model(path, chain: list[int], vocab_size: int) -> PreTrainedModel:
    """The tiny MoE at ``path`` made to sample ``chain``: its next token after ``chain[i]`` is ``chain[i + 1]``,
    whatever came before (by a logit margin of 100), and ``chain[-1]`` is its EOS."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                parameter.zero_()  # no layer adds to the residual stream: the last hidden state is the embedding
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        for position, (token, following) in enumerate(zip(chain, chain[1:], strict=False)):
            embed[token, position] = 1.0
            head[following, position] = 100.0 / model.config.hidden_size**0.5  # logit 100 after the RMS norm
    model.config.eos_token_id = chain[-1]
    assert model.config.vocab_size >= vocab_size
    return model
