"""Checkpoint converters: ``convert hf-to-mcore`` and ``convert mcore-to-hf``.

The package CLI (``megatron_rl/cli.py``) parses the arguments and calls these
functions; they are importable for scripts too.

Megatron checkpoint directory written by ``hf-to-mcore``::

    OUT/metadata.json, OUT/*.distcp   torch_dist model weights (any layout can load them)
    OUT/hf_metadata/                  config.json, generation config, tokenizer files
                                      (:data:`~megatron_rl.checkpoint.layout.HF_METADATA_DIR`)

Outputs are built in ``.OUT.partial`` and renamed into place on success.
The converters run as local gloo ranks, or, started by torchrun (one process
per GPU), as the ranks of that job; ``check-parity`` always runs locally.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_rl.checkpoint.layout import HF_METADATA_DIR
from megatron_rl.checkpoint.trainer_state import saved_lora
from megatron_rl.config.hf_config import QwenArchitecture, checkpoint_dtype_name, load_hf_config, parse_hf_config
from megatron_rl.config.hf_weights import weight_problems
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.hf_export import write_hf_model_dir
from megatron_rl.models.hf_files import (
    DEFAULT_MAX_SHARD_BYTES,
    check_output_dir,
    copy_hf_metadata,
    distributed_output_dir,
    partial_dir,
)
from megatron_rl.models.lora import apply_lora
from megatron_rl.models.mcore_checkpoint import load_model_weights, save_model_weights
from megatron_rl.models.megatron_config import check_layout
from megatron_rl.models.weight_transfer import load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.parallel.local_launch import launched_externally, run_ranks


def _build(config: dict[str, Any], sizes: ParallelSizes) -> tuple[QwenArchitecture, list[torch.nn.Module]]:
    arch, _, chunks = build_qwen_model(config, sizes, params_dtype=getattr(torch, checkpoint_dtype_name(config)))
    return arch, chunks


def _hf_to_mcore_rank(rank: int, world_size: int, sizes: ParallelSizes, hf_dir: Path, out_dir: Path) -> None:
    initialize_parallel(sizes)
    try:
        with distributed_output_dir(out_dir) as staging:
            arch, chunks = _build(load_hf_config(hf_dir), sizes)
            load_hf_weights(chunks, arch, hf_dir)
            save_model_weights(chunks, staging)
            if rank == 0:
                copy_hf_metadata(hf_dir, staging / HF_METADATA_DIR)
    finally:
        destroy_parallel()


def _run_converter(rank_body: Callable[..., None], sizes: ParallelSizes, out_dir: Path, *args: Any) -> None:
    if not launched_externally():
        check_output_dir(out_dir)
    try:
        run_ranks(rank_body, sizes.min_world_size, sizes, *args, out_dir)
    except BaseException:
        if not launched_externally():
            shutil.rmtree(partial_dir(out_dir), ignore_errors=True)
        raise


def convert_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, sizes: ParallelSizes = ParallelSizes()) -> None:
    """Write the Hugging Face checkpoint in ``hf_dir`` as a torch_dist checkpoint at ``out_dir``.

    ``sizes`` is the layout used while converting (any layout can load the
    result). Runs ``sizes.min_world_size`` local gloo ranks, or as one rank
    of a job started by torchrun (then the launcher's world size is used).
    """
    hf_dir = Path(hf_dir)
    arch = parse_hf_config(load_hf_config(hf_dir))
    check_layout(arch, sizes)
    problems = weight_problems(hf_dir, arch)
    if problems:
        raise ValueError("--hf: " + "; ".join(problems))
    _run_converter(_hf_to_mcore_rank, sizes, Path(out_dir), hf_dir)


def _mcore_to_hf_rank(
    rank: int,
    world_size: int,
    sizes: ParallelSizes,
    ckpt_dir: Path,
    metadata_dir: Path,
    max_shard_bytes: int,
    lora: LoRAConfig | None,
    out_dir: Path,
) -> None:
    initialize_parallel(sizes)
    try:
        with distributed_output_dir(out_dir) as staging:
            arch, chunks = _build(load_hf_config(metadata_dir), sizes)
            if lora is not None:
                apply_lora(chunks, arch, lora)  # the checkpoint's factors replace the fresh ones
            load_model_weights(chunks, ckpt_dir)
            write_hf_model_dir(chunks, arch, metadata_dir, staging, max_shard_bytes, lora=lora)
    finally:
        destroy_parallel()


def saved_lora_config(weights: Path, metadata: Path | None) -> LoRAConfig | None:
    """The ``lora:`` section a run checkpoint's model was trained with, for :func:`convert_mcore_to_hf`'s ``lora``;
    ``(weights, metadata)`` as :func:`~megatron_rl.checkpoint.layout.model_weight_dirs` returns them (None for
    ``hf-to-mcore``'s output, which holds no adapter)."""
    saved = saved_lora(weights.parent) if metadata is not None else None  # a run checkpoint's step_* folder
    return LoRAConfig.model_validate(saved) if saved is not None else None


def convert_mcore_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    sizes: ParallelSizes = ParallelSizes(),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    *,
    metadata_dir: str | Path | None = None,
    lora: LoRAConfig | None = None,
) -> None:
    """Write the torch_dist checkpoint at ``ckpt_dir`` as a Hugging Face model directory.

    ``metadata_dir`` holds the Hugging Face config (and tokenizer) files to copy; default
    ``<ckpt_dir>/hf_metadata`` (as hf-to-mcore writes). Only the model weights are read, so
    a checkpoint that also holds optimizer state converts the same way.

    Written by :func:`~megatron_rl.models.hf_export.write_hf_model_dir` (each rank its
    designated tensors; weights in the dtype the metadata's config.json names).

    ``lora``: the checkpoint holds a LoRA run's adapters too (its ``trainer_state.json`` says which); the
    model written is the merged one, and ``OUT/adapter/`` the adapter alone as PEFT files.
    """
    ckpt_dir = Path(ckpt_dir)
    metadata_dir = Path(metadata_dir) if metadata_dir is not None else ckpt_dir / HF_METADATA_DIR
    if not (metadata_dir / "config.json").is_file():
        raise FileNotFoundError(f"{metadata_dir}/config.json missing: not written by hf-to-mcore or a training run")
    check_layout(parse_hf_config(load_hf_config(metadata_dir)), sizes)
    _run_converter(_mcore_to_hf_rank, sizes, Path(out_dir), ckpt_dir, metadata_dir, max_shard_bytes, lora)
