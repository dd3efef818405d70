"""Name map between Megatron GPTModel parameters and Hugging Face Qwen3 tensors.

:func:`iter_param_mappings` walks this rank's model chunks and pairs every
parameter with a :class:`ParamMapping`: its Hugging Face (on-disk, Hub) names
and the :mod:`~megatron_rl.models.weight_layouts` layout relating them. Both
spec flavours are understood:

- local spec: ``input_layernorm.weight``, ``pre_mlp_layernorm.weight``,
  experts as ``mlp.experts.local_experts.{e}.linear_fc{1,2}.weight``;
- Transformer Engine spec: norms fused into the next linear
  (``linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``),
  grouped experts as ``mlp.experts.linear_fc{1,2}.weight{e}``.

With LoRA (:mod:`~megatron_rl.models.lora`) a wrapped linear's weight is ``<linear>.base.weight``, mapped as
``<linear>.weight``; the adapters (``lora_A``/``lora_B``) are not base weights and are not yielded (their
Hugging Face/PEFT names are :mod:`~megatron_rl.models.lora_peft`'s).

Layer indices are global (``layer.layer_number - 1``, so PP/VPP chunks map to
the right Hugging Face layer) and expert indices are global
(``ep_rank * local_experts + e``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from megatron.core import parallel_state

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.models.weight_layouts import (
    FusedGateUp,
    FusedQKV,
    Layout,
    Replicated,
    RowParallel,
    VocabParallel,
)

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter and the Hugging Face tensors it holds (a shard of).

    ``expert``: sharded over the expert-TP group (else the dense TP group).
    ``exported``: False for a tied output layer, whose tensor is exported as
    the embedding. ``local_expert``: an expert's index among this EP rank's experts (None for the rest).
    """

    megatron_name: str
    hf_names: tuple[str, ...]
    layout: Layout
    expert: bool = False
    exported: bool = True
    local_expert: int | None = None


_LayoutFactory = Callable[[QwenArchitecture], Layout]


def _qkv(arch: QwenArchitecture) -> Layout:
    return FusedQKV(arch.num_attention_heads, arch.num_query_groups, arch.head_dim)


_LAYER_RULES: dict[str, tuple[tuple[str, ...], _LayoutFactory]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), lambda a: Replicated()),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), lambda a: Replicated()),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        _qkv,
    ),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), lambda a: RowParallel()),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), lambda a: Replicated()),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), lambda a: Replicated()),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), lambda a: Replicated()),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), lambda a: Replicated()),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), lambda a: FusedGateUp()),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), lambda a: RowParallel()),
    "mlp.router.weight": (("mlp.gate.weight",), lambda a: Replicated()),
}

_EXPERT_RULES: dict[str, tuple[tuple[str, ...], Layout]] = {
    "linear_fc1": (("gate_proj.weight", "up_proj.weight"), FusedGateUp()),
    "linear_fc2": (("down_proj.weight",), RowParallel()),
}

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_ADAPTER = re.compile(r"\.lora_[AB]\.")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")
_GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)")


class UnmappedParameterError(KeyError):
    """A Megatron parameter has no Hugging Face counterpart in this map."""

    def __str__(self) -> str:
        return str(self.args[0])


def _expert_mapping(name: str, prefix: str, suffix: str, arch: QwenArchitecture) -> ParamMapping | None:
    local = _LOCAL_EXPERT.fullmatch(suffix)
    grouped = _GROUPED_EXPERT.fullmatch(suffix)
    if local:
        local_expert, linear = int(local.group(1)), local.group(2)
    elif grouped:
        local_expert, linear = int(grouped.group(2)), grouped.group(1)
    else:
        return None
    num_local = arch.num_experts // parallel_state.get_expert_model_parallel_world_size()
    expert = parallel_state.get_expert_model_parallel_rank() * num_local + local_expert
    hf_suffixes, layout = _EXPERT_RULES[linear]
    names = tuple(f"{prefix}.mlp.experts.{expert}.{s}" for s in hf_suffixes)
    return ParamMapping(name, names, layout, expert=True, local_expert=local_expert)


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def hf_expert_index(hf_name: str) -> int | None:
    """The global expert index in a Hugging Face tensor name (``...mlp.experts.{e}...``); None for the rest."""
    match = _EXPERT_INDEX.search(hf_name)
    return None if match is None else int(match.group(1))


def peer_expert_names(mapping: ParamMapping, num_experts: int, ep_rank: int, ep_size: int) -> tuple[str, ...]:
    """The Hugging Face names of the expert that EP rank ``ep_rank`` holds where this rank holds ``mapping``'s.

    ``mapping`` is an expert's (``local_expert`` set); the peer's global index is
    ``ep_rank * num_experts // ep_size + local_expert``.
    """
    if mapping.local_expert is None:
        raise ValueError(f"{mapping.megatron_name} is not an expert parameter")
    expert = ep_rank * (num_experts // ep_size) + mapping.local_expert
    return tuple(_EXPERT_INDEX.sub(f".experts.{expert}.", name, count=1) for name in mapping.hf_names)


def _layer_mapping(name: str, layer: int, suffix: str, arch: QwenArchitecture) -> ParamMapping:
    prefix = f"model.layers.{layer}"
    expert = _expert_mapping(name, prefix, suffix, arch)
    if expert is not None:
        return expert
    if suffix not in _LAYER_RULES:
        raise UnmappedParameterError(f"Megatron parameter {name!r} has no Hugging Face mapping")
    hf_suffixes, layout = _LAYER_RULES[suffix]
    return ParamMapping(name, tuple(f"{prefix}.{s}" for s in hf_suffixes), layout(arch))


def _top_level_mapping(name: str, arch: QwenArchitecture) -> ParamMapping:
    vocab = VocabParallel(arch.vocab_size)
    if name == "embedding.word_embeddings.weight":
        return ParamMapping(name, ("model.embed_tokens.weight",), vocab)
    if name == "output_layer.weight":
        if arch.tie_word_embeddings:
            return ParamMapping(name, ("model.embed_tokens.weight",), vocab, exported=False)
        return ParamMapping(name, ("lm_head.weight",), vocab)
    if name == "decoder.final_layernorm.weight":
        return ParamMapping(name, ("model.norm.weight",), Replicated())
    raise UnmappedParameterError(f"Megatron parameter {name!r} has no Hugging Face mapping")


def iter_param_mappings(
    chunks: Sequence[GPTModel], arch: QwenArchitecture
) -> Iterator[tuple[ParamMapping, torch.nn.Parameter]]:
    """Yield (mapping, parameter) for every base parameter of this rank's chunks, in model order (not LoRA's).

    The order is identical on all ranks with the same pipeline stage, so
    collectives issued per parameter line up across TP / expert-TP groups.
    """
    for chunk in chunks:
        layers = chunk.decoder.layers
        for name, param in chunk.named_parameters():
            if _ADAPTER.search(name):
                continue
            match = _LAYER.fullmatch(name.replace(".base.", "."))
            if match is None:
                yield _top_level_mapping(name, arch), param
                continue
            layer = layers[int(match.group(1))].layer_number - 1
            yield _layer_mapping(name, layer, match.group(2), arch), param


def tensor_parallel_group(mapping: ParamMapping) -> torch.distributed.ProcessGroup:
    """The process group a parameter is tensor-parallel-sharded over."""
    if mapping.expert:
        group: torch.distributed.ProcessGroup = parallel_state.get_expert_tensor_parallel_group()
    else:
        group = parallel_state.get_tensor_model_parallel_group()
    return group


def tensor_parallel_rank_size(mapping: ParamMapping) -> tuple[int, int]:
    """(rank, size) of this process in the parameter's tensor-parallel group."""
    if mapping.expert:
        return (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def group_holds_designated_source(mapping: ParamMapping) -> bool:
    """Whether this rank's TP (or expert-TP) group of the parameter holds its designated source.

    The same answer on every rank of the group: the group's data-parallel (expert: expert-data-parallel)
    rank is 0. The designated source is then the group's rank 0 (:func:`is_designated_source`).
    """
    if mapping.expert:
        rank: int = parallel_state.get_expert_data_parallel_rank()
    else:
        rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    return rank == 0


def is_designated_source(mapping: ParamMapping) -> bool:
    """Whether this rank is the one copy of the parameter's full tensor to send or write.

    Dense parameters: tensor-parallel rank 0 of data(+context)-parallel rank 0.
    Experts: expert-TP rank 0 of expert-data-parallel rank 0 (every EP rank is
    the source of its own experts). Pipeline stages are sources of their layers.
    """
    if mapping.expert:
        source: bool = (
            parallel_state.get_expert_tensor_parallel_rank() == 0
            and parallel_state.get_expert_data_parallel_rank() == 0
        )
    else:
        source = (
            parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        )
    return source
