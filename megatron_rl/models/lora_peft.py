"""The adapters of :mod:`megatron_rl.models.lora` as a PEFT adapter, and back.

Export names are PEFT's for a Qwen3 / Qwen3-MoE ``PeftModel`` saved with transformers v4 module names (what
SGLang and ``PeftModel.from_pretrained`` read): ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``,
``...mlp.gate_proj.lora_B.weight`` for a dense MLP and ``...mlp.experts.{e}.down_proj.lora_A.weight`` for a
routed expert. PEFT 0.21 on transformers v5 loads those into its fused-expert wrappers and saves them fused
(``...mlp.experts.base_layer.lora_{A,B}.weight`` for gate/up, ``...mlp.experts.lora_{A,B}.weight`` for down,
built by ``peft/utils/transformers_weight_conversion.py``, which has no reverse); :func:`unfuse_peft_experts`
is that reverse, exact (a permutation and a block-diagonal split), so the import reads either form.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file
from torch import nn

from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.lora import LoRALinear, lora_modules

PEFT_PREFIX = "base_model.model."
_FUSED = re.compile(r"(.+\.mlp\.experts)\.(base_layer\.)?(lora_[AB])\.weight")


def _gather(tensor: torch.Tensor, dim: int | None, module: LoRALinear) -> torch.Tensor:
    if dim is None:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(module.size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=module.group)
    return torch.cat(shards, dim=dim)


def _is_source(module: LoRALinear) -> bool:
    """Whether this rank contributes the module's whole adapter to the export (one copy per tensor)."""
    if module.expert:
        return bool(
            parallel_state.get_expert_tensor_parallel_rank() == 0
            and parallel_state.get_expert_data_parallel_rank() == 0
        )
    return bool(
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )


def lora_state_to_peft(chunks: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """The whole adapter under PEFT names (module docstring), fp32 on CPU, on every rank.

    Collective over the default group: every rank must call it. Tensors are gathered over their TP (expert-TP)
    group, then all ranks' shares (pipeline stages, expert-parallel ranks) are exchanged.
    """
    own: dict[str, torch.Tensor] = {}
    for module in lora_modules(chunks):
        a_dim, b_dim = module.shard_dims()
        for proj in module.projections:
            if proj.target not in module.lora_A:
                continue
            a = _gather(module.lora_A[proj.target], a_dim, module)
            b = _gather(module.lora_B[proj.target], b_dim, module)
            if _is_source(module):
                own[f"{PEFT_PREFIX}{proj.hf_name}.lora_A.weight"] = a.float().cpu()
                own[f"{PEFT_PREFIX}{proj.hf_name}.lora_B.weight"] = b.float().cpu()
    shares: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(shares, own)
    return {name: tensor for share in shares for name, tensor in share.items()}


def peft_adapter_config(lora: LoRAConfig, base_model: str = "") -> dict[str, Any]:
    """``adapter_config.json`` of the export (PEFT's ``LoraConfig`` fields)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": list(lora.target_modules),
        "lora_dropout": lora.dropout,
        "bias": "none",
        "base_model_name_or_path": base_model,
    }


def save_peft_adapter(
    directory: str | Path, state: Mapping[str, torch.Tensor], lora: LoRAConfig, base_model: str
) -> Path:
    """Write ``state`` (PEFT names, :func:`lora_state_to_peft`) as a PEFT adapter folder: ``adapter_config.json``
    (:func:`peft_adapter_config`) and ``adapter_model.safetensors``; ``directory``, created if missing."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, directory / "adapter_model.safetensors")
    config = peft_adapter_config(lora, base_model)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    return directory


def _unfuse(prefix: str, gate_up: bool, factor: str, tensor: torch.Tensor, experts: int) -> dict[str, torch.Tensor]:
    """Per-expert tensors of one fused PEFT tensor (the inverse of PEFT's ``MergeModulelist`` + ``Concatenate`` /
    ``PeftConcatenate`` / ``FlattenDims`` / ``PermuteDims`` / ``Transpose`` chain)."""
    names = ("gate_proj", "up_proj") if gate_up else ("down_proj",)
    if factor == "lora_A":  # [E * n r, in], expert-major, gate rows then up rows
        per_expert = tensor.reshape(experts, tensor.shape[0] // experts, tensor.shape[1])
        parts = per_expert.chunk(len(names), dim=1)
    else:  # [n out, n r * E], rank-major columns; per expert block-diagonal over gate/up
        ranks = tensor.shape[1] // experts
        block_diagonal = tensor.t().reshape(ranks, experts, tensor.shape[0]).permute(1, 2, 0)
        rows, cols = block_diagonal.shape[1] // len(names), ranks // len(names)
        parts = tuple(
            block_diagonal[:, i * rows : (i + 1) * rows, i * cols : (i + 1) * cols] for i in range(len(names))
        )
    return {
        f"{prefix}.{e}.{name}.{factor}.weight": part[e].contiguous()
        for name, part in zip(names, parts, strict=True)
        for e in range(experts)
    }


def unfuse_peft_experts(state: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """``state`` with PEFT's fused-expert tensors (transformers v5 form) replaced by per-expert ones."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _FUSED.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, gate_up, factor = match.group(1), match.group(2) is not None, match.group(3)
        out |= _unfuse(prefix, gate_up, factor, tensor, num_experts)
    return out


def peft_to_lora_state(chunks: Sequence[nn.Module], state: Mapping[str, torch.Tensor], num_experts: int) -> None:
    """Load a PEFT adapter (either form, module docstring) into this rank's adapters: each takes its shard.

    Every adapter of ``chunks`` must be in ``state`` with its whole shape (KeyError / ValueError otherwise);
    tensors for other ranks' layers and experts are ignored.
    """
    whole = unfuse_peft_experts(state, num_experts)
    with torch.no_grad():
        for module in lora_modules(chunks):
            a_dim, b_dim = module.shard_dims()
            for proj in module.projections:
                if proj.target not in module.lora_A:
                    continue
                for factor, dim, shape in (
                    ("lora_A", a_dim, (module.lora_A[proj.target].shape[0], proj.fan_in)),
                    ("lora_B", b_dim, (proj.fan_out, module.lora_B[proj.target].shape[1])),
                ):
                    tensor = whole[f"{PEFT_PREFIX}{proj.hf_name}.{factor}.weight"]
                    if tuple(tensor.shape) != shape:
                        raise ValueError(f"{proj.hf_name}.{factor}: shape {tuple(tensor.shape)}, expected {shape}")
                    local = tensor if dim is None else tensor.chunk(module.size, dim=dim)[module.rank]
                    getattr(module, factor)[proj.target].copy_(local)
