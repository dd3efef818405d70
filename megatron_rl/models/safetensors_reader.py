"""Read slices of tensors from a Hugging Face safetensors checkpoint.

Handles a single ``model.safetensors`` and sharded checkpoints
(``model.safetensors.index.json`` + ``model-0000k-of-0000n.safetensors``).
Only the requested rows/columns are read from disk (``safe_open().get_slice``),
so a rank loads just the shard it owns.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megatron_rl.config.hf_config import INDEX_FILE, SINGLE_FILE


class CheckpointTensorError(KeyError):
    """A tensor is missing from the checkpoint or has an unexpected shape."""

    def __str__(self) -> str:
        return str(self.args[0])


def _open(path: Path) -> safe_open:
    """``safe_open(path)``; CheckpointTensorError naming the file when it is absent, truncated or not safetensors."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointTensorError(
            f"{path}: not a readable safetensors file ({exc}); download or export the checkpoint again"
        ) from exc


class SafetensorsCheckpoint:
    """Name -> file index of a checkpoint directory, with sliced reads.

    Raises FileNotFoundError when the directory has neither ``model.safetensors``
    nor ``model.safetensors.index.json``.
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index_path = self.model_dir / INDEX_FILE
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text())["weight_map"]
            self._file_of = {name: self.model_dir / file for name, file in weight_map.items()}
        elif (self.model_dir / SINGLE_FILE).is_file():
            with _open(self.model_dir / SINGLE_FILE) as handle:
                self._file_of = {name: self.model_dir / SINGLE_FILE for name in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)
        else:
            raise FileNotFoundError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._handles: dict[Path, safe_open] = {}

    def names(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self._file_of)

    def _handle(self, name: str) -> safe_open:
        if name not in self._file_of:
            raise CheckpointTensorError(f"tensor {name!r} is missing from the checkpoint in {self.model_dir}")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = _open(path)
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` (without reading it)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        """Raise CheckpointTensorError when ``name`` is missing or not of shape ``expected``."""
        actual = self.shape(name)
        if actual != tuple(expected):
            raise CheckpointTensorError(
                f"tensor {name!r} in {self.model_dir} has shape {list(actual)}, but config.json and the "
                f"parallel layout imply {list(expected)}"
            )

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """``tensor[rows, cols]`` read from disk; ``None`` selects the whole dimension."""
        tensor_slice = self._handle(name).get_slice(name)
        if rows is None and cols is None:
            tensor: torch.Tensor = tensor_slice[:]
        elif cols is None:
            tensor = tensor_slice[rows]
        else:
            tensor = tensor_slice[rows if rows is not None else slice(None), cols]
        return tensor
