"""Megatron chunks -> a Hugging Face model directory, written by all ranks together.

One writer for ``convert mcore-to-hf`` and for the trainer's export at each
checkpoint save, so both produce the same files from the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config.hf_config import QwenArchitecture, checkpoint_dtype_name, load_hf_config
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.hf_files import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardFile,
    copy_hf_metadata,
    finalize_safetensors,
    write_shard_files,
)
from megatron_rl.models.lora_merge import merge_lora_weights
from megatron_rl.models.lora_peft import lora_state_to_peft, save_peft_adapter
from megatron_rl.models.weight_transfer import export_hf_weights

PEFT_ADAPTER_DIR = "adapter"
"""With LoRA, the PEFT adapter's folder inside the exported model directory."""


def _cast(tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, tensor.to(dtype)


def write_hf_model_dir(
    chunks: Sequence[torch.nn.Module],
    arch: QwenArchitecture,
    metadata_dir: str | Path,
    out_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    lora: LoRAConfig | None = None,
) -> None:
    """All ranks: write the chunks' weights and ``metadata_dir``'s non-weight files into ``out_dir``.

    Collective over the default group (every rank calls it with the same
    arguments; ``out_dir`` on a filesystem all ranks share). Weights are
    written in the dtype ``metadata_dir/config.json`` names (``dtype`` or
    ``torch_dtype``, default float32), whatever dtype the chunks train in.
    Each rank writes the tensors it is the designated source of (its pipeline
    stage, its experts), so memory per rank is one shard plus one gathered
    tensor; rank 0 names the files (``model.safetensors``, or numbered shards
    with ``model.safetensors.index.json``) and copies config.json, the
    generation config and tokenizer files. On return, on every rank,
    ``out_dir`` is complete.

    ``lora``: the chunks carry these adapters (:func:`~megatron_rl.models.lora.apply_lora`); the weights
    written are the merged ``W + (alpha / r) B A`` (:func:`~megatron_rl.models.lora_merge.merge_lora_weights`,
    rounded once to the config's dtype from float32), and ``out_dir/adapter/`` holds the adapter alone as
    PEFT files (float32) for ``PeftModel.from_pretrained`` on the unmerged base or an engine's LoRA loader.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    dtype = getattr(torch, checkpoint_dtype_name(load_hf_config(metadata_dir)))
    weights = export_hf_weights(chunks, arch, designated_only=True)
    adapter = lora_state_to_peft(chunks) if lora is not None else {}  # collective: before the export's gathers
    if lora is not None:
        weights = merge_lora_weights(weights, adapter, lora.alpha / lora.rank)
    tensors = _cast(weights, dtype)
    shards = write_shard_files(tensors, out_dir, max_shard_bytes, prefix=f"rank{rank}")
    per_rank: list[list[ShardFile]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(per_rank, shards)
    if rank == 0:
        finalize_safetensors(out_dir, [shard for rank_shards in per_rank for shard in rank_shards])
        copy_hf_metadata(metadata_dir, out_dir)
        if lora is not None:
            base_model = str(load_hf_config(metadata_dir).get("_name_or_path", ""))
            save_peft_adapter(out_dir / PEFT_ADAPTER_DIR, adapter, lora, base_model)
    dist.barrier()
