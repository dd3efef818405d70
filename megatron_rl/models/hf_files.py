"""Files of a Hugging Face model directory: metadata copy, streamed safetensors, atomic output.

- :func:`copy_hf_metadata` copies config.json, generation_config.json and the
  tokenizer files (everything that is not a weight file).
- :func:`write_safetensors` writes a stream of (name, tensor) pairs as
  ``model.safetensors`` or, beyond ``max_shard_bytes``, as
  ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``,
  holding at most one shard in memory.
- :func:`atomic_output_dir` builds the output in a sibling ``.partial``
  directory and renames it into place only on success, so a failed run leaves
  nothing half-written at the output path.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file

from megatron_rl.models.safetensors_reader import INDEX_FILE, SINGLE_FILE

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


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """Write ``tensors`` into ``out_dir`` in Hugging Face's layout; return the file names written.

    Raises ValueError on a duplicate tensor name.
    """
    out_dir = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    seen: set[str] = set()
    temp_files: list[Path] = []

    def flush() -> None:
        path = out_dir / f".shard-{len(temp_files)}.tmp"
        save_file(shards[-1], str(path), metadata={"format": "pt"})
        temp_files.append(path)

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} was produced twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:
            flush()
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        sizes[-1] += nbytes
    flush()
    if len(temp_files) == 1:
        temp_files[0].rename(out_dir / SINGLE_FILE)
        return [SINGLE_FILE]
    weight_map: dict[str, str] = {}
    names = [_shard_name(i + 1, len(temp_files)) for i in range(len(temp_files))]
    for path, shard, file_name in zip(temp_files, shards, names):
        path.rename(out_dir / file_name)
        weight_map |= {tensor_name: file_name for tensor_name in shard}
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return [*names, INDEX_FILE]


def partial_dir(out_dir: str | Path) -> Path:
    """The sibling directory an output is built in before it is renamed into place."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.partial"


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a fresh ``.partial`` directory; rename it to ``out_dir`` on success, delete it on error.

    Raises FileExistsError when ``out_dir`` exists and is not empty.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"--out {out_dir} exists and is not empty; choose a new directory")
    staging = partial_dir(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()
    staging.rename(out_dir)
