"""Named tensors across processes without copying them through HTTP: shared-memory / CUDA IPC handles.

:func:`serialize_named_tensors` pickles ``[(name, tensor), ...]`` with
``multiprocessing``'s ForkingPickler and torch's reductions: a CPU tensor's
storage is moved to a named shared-memory file (``file_system`` sharing
strategy, so an unrelated process can open it) and a CUDA tensor travels as a
CUDA IPC handle (same node only). The bytes are base64-encoded for JSON, which
is what SGLang's ``/update_weights_from_tensor`` expects.

The sender must keep the tensors alive until the receiver has copied them
(the HTTP call returning). :func:`deserialize_named_tensors` never unpickles
arbitrary objects: its unpickler resolves only the torch storage/tensor
rebuild functions, tensor and storage classes, ``torch.Size`` and torch dtypes,
and refuses every other global with :class:`UnsafePayloadError`.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
from collections.abc import Iterator, Sequence
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing
import torch.multiprocessing.reductions  # noqa: F401  (registers torch's ForkingPickler reductions)

NamedTensors = list[tuple[str, torch.Tensor]]

_ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.multiprocessing.reductions": frozenset(
        {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_storage_filename"}
    ),
    "torch": frozenset({"Tensor", "Size"}),
    "torch.storage": frozenset({"UntypedStorage", "TypedStorage"}),
    "torch.nn.parameter": frozenset({"Parameter"}),
}


class UnsafePayloadError(pickle.UnpicklingError):
    """A tensor payload referenced a global outside the allow-list (or was malformed)."""


class _TensorOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePayloadError(
            f"refusing to unpickle {module}.{name}: only torch tensor/storage rebuild functions are allowed"
        )


@contextlib.contextmanager
def _sharing_strategy(strategy: str) -> Iterator[None]:
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Base64 text of ``[(name, tensor)]`` as IPC handles (CPU storages are moved to shared memory).

    Raises TypeError for anything but (str, Tensor) pairs.
    """
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        if not isinstance(item[1], torch.Tensor):
            raise TypeError(f"{item[0]}: expected a torch.Tensor, got {type(item[1]).__name__}")
    buffer = io.BytesIO()
    with _sharing_strategy("file_system"):
        ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(
            [(name, tensor.detach()) for name, tensor in named_tensors]
        )
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> NamedTensors:
    """Inverse of :func:`serialize_named_tensors`; tensors are views of the sender's memory (copy them).

    Raises UnsafePayloadError for a payload naming any other global, or not a list of (str, Tensor) pairs.
    """
    try:
        raw = base64.b64decode(payload, validate=True)
    except ValueError as error:
        raise UnsafePayloadError(f"payload is not base64: {error}") from error
    loaded = _TensorOnlyUnpickler(io.BytesIO(raw)).load()
    if not isinstance(loaded, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in loaded
    ):
        raise UnsafePayloadError("payload must be a list of (name, tensor) pairs")
    return loaded
