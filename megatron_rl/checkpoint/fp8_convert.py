"""``convert hf-to-fp8``: a Hugging Face checkpoint -> the blockwise FP8 checkpoint FP8 rollouts start from.

The output holds every tensor of the input, the projections quantised
(:func:`~megatron_rl.wire.fp8_blocks.quantize_named`: FP8 weight + ``weight_scale_inv``), the
rest unchanged, in shards of at most the default shard size; config.json gains the
``quantization_config`` SGLang reads; tokenizer and generation files are copied. It is built in
``.OUT.partial`` and renamed into place, so an interrupted conversion leaves no half-written OUT.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_rl.config.fp8_checkpoint import quantization_config
from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.models.hf_files import (
    check_output_dir,
    copy_hf_metadata,
    finalize_safetensors,
    partial_dir,
    write_shard_files,
)
from megatron_rl.models.safetensors_reader import SafetensorsCheckpoint
from megatron_rl.wire.fp8_blocks import quantize_named


def convert_hf_to_fp8(hf_dir: str | Path, out_dir: str | Path, block: tuple[int, int]) -> Path:
    """Write the FP8 checkpoint of ``hf_dir`` with scale blocks ``block`` = (bn, bk) to ``out_dir``; returns it.

    Raises FileExistsError when ``out_dir`` is not empty and ValueError when ``hf_dir`` is quantised already.
    """
    out_dir = Path(out_dir)
    check_output_dir(out_dir)
    config = load_hf_config(hf_dir)
    if "quantization_config" in config:
        raise ValueError(f"--hf {hf_dir} is quantised already ({config['quantization_config']}); give a bf16 one")
    staging = partial_dir(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    copy_hf_metadata(hf_dir, staging)
    config["quantization_config"] = quantization_config(block, config["num_hidden_layers"])
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    source = SafetensorsCheckpoint(hf_dir)
    finalize_safetensors(staging, write_shard_files(quantize_named(_tensors(source), block), staging))
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked above)
    staging.rename(out_dir)
    return out_dir


def _tensors(source: SafetensorsCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    for name in source.names():
        yield name, source.read(name)
