"""Files of a Hugging Face model directory: metadata copy, streamed safetensors, atomic output.

- :func:`copy_hf_metadata` copies config.json, generation_config.json and the
  tokenizer files (everything that is not a weight file).
- :func:`write_shard_files` streams (name, tensor) pairs into size-bounded
  temporary files (one writer per rank), and :func:`finalize_safetensors`
  names them ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` with
  ``model.safetensors.index.json``.
- :func:`distributed_output_dir` builds the output in a sibling ``.partial``
  directory and renames it into place only on success, so a failed run leaves
  nothing half-written at the output path.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_rl.config.hf_config import INDEX_FILE, SINGLE_FILE

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def copy_hf_metadata(src_dir: str | Path, dst_dir: str | Path) -> None:
    """Copy every file of ``src_dir`` except weights (``*.safetensors``, ``*.bin``, the index)."""
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    for path in Path(src_dir).iterdir():
        if path.is_file() and path.suffix not in (".safetensors", ".bin") and path.name != INDEX_FILE:
            shutil.copy2(path, dst_dir / path.name)


def _shard_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


@dataclass(frozen=True)
class ShardFile:
    """A temporary safetensors file in the output directory and what it holds."""

    file_name: str
    tensor_names: tuple[str, ...]
    nbytes: int


def write_shard_files(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    prefix: str = "rank0",
) -> list[ShardFile]:
    """Write ``tensors`` into temporary files ``.{prefix}-{k}.tmp`` of at most ``max_shard_bytes`` each.

    Holds at most one shard in memory. Several writers (ranks) use distinct
    prefixes in one directory; :func:`finalize_safetensors` names the files.
    """
    out_dir = Path(out_dir)
    written: list[ShardFile] = []
    shard: dict[str, torch.Tensor] = {}
    nbytes = 0

    def flush() -> None:
        file_name = f".{prefix}-{len(written)}.tmp"
        save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
        written.append(ShardFile(file_name, tuple(shard), nbytes))

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and nbytes + size > max_shard_bytes:
            flush()
            shard, nbytes = {}, 0
        shard[name] = tensor.detach().to("cpu").contiguous()
        nbytes += size
    if shard:
        flush()
    return written


def finalize_safetensors(out_dir: str | Path, shards: Sequence[ShardFile]) -> list[str]:
    """Rename the temporary files to Hugging Face's names and write the index; return the file names.

    One file becomes ``model.safetensors`` (no index). Raises ValueError on a
    tensor name written twice.
    """
    out_dir = Path(out_dir)
    names = [name for shard in shards for name in shard.tensor_names]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"tensors written more than once: {duplicates}")
    if len(shards) == 1:
        (out_dir / shards[0].file_name).rename(out_dir / SINGLE_FILE)
        return [SINGLE_FILE]
    weight_map: dict[str, str] = {}
    final_names = [_shard_name(i + 1, len(shards)) for i in range(len(shards))]
    for shard, final_name in zip(shards, final_names, strict=True):
        (out_dir / shard.file_name).rename(out_dir / final_name)
        weight_map |= dict.fromkeys(shard.tensor_names, final_name)
    index = {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return [*final_names, INDEX_FILE]


def partial_dir(out_dir: str | Path) -> Path:
    """The sibling directory an output is built in before it is renamed into place."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.partial"


def check_output_dir(out_dir: str | Path) -> None:
    """Raise FileExistsError when ``out_dir`` exists and is not empty."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"--out {out_dir} exists and is not empty; choose a new directory")


@contextlib.contextmanager
def distributed_output_dir(out_dir: str | Path) -> Iterator[Path]:
    """All ranks: build the output in :func:`partial_dir`; rank 0 renames it to ``out_dir`` at the end.

    Collective (barriers on the default group). On an exception in rank 0's
    body the partial directory is deleted; if another rank fails, the
    launcher tears the job down and only the partial directory remains (the
    next run replaces it), never a half-written ``out_dir``.
    """
    out_dir, staging = Path(out_dir), partial_dir(out_dir)
    leader = dist.get_rank() == 0
    if leader:
        check_output_dir(out_dir)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    try:
        yield staging
        dist.barrier()
    except BaseException:
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if leader:
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    dist.barrier()
