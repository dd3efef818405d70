"""Named tensors across processes without copying them through HTTP: shared-memory / CUDA IPC handles.

:func:`serialize_named_tensors` pickles ``[(name, tensor), ...]`` with
``multiprocessing``'s ForkingPickler and torch's reductions: a CPU tensor's
storage is moved to a named shared-memory file (``file_system`` sharing
strategy, so an unrelated process can open it) and a CUDA tensor travels as a
CUDA IPC handle (same node only). The bytes are base64-encoded for JSON, which
is what SGLang's ``/update_weights_from_tensor`` expects.

Device UUIDs: torch's CUDA reduction names the storage's device by its index in
the sender's device numbering, and trainer ranks (Ray sets their
``CUDA_VISIBLE_DEVICES``) and engines (which see the node's devices) number them
differently. So the serializer writes the device's UUID,
``str(torch.cuda.get_device_properties(index).uuid)``, in place of the index
(argument :data:`REBUILD_DEVICE_ARG` of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``),
the format SGLang's ``monkey_patch_torch_reductions`` writes and its patched
``rebuild_cuda_tensor`` reads (it accepts an int index or a UUID string). The
deserializer maps a UUID back to the index of the visible device that has it
(and still takes an int). CPU tensors are unaffected.

The sender must keep the tensors alive until the receiver has copied them
(the HTTP call returning). :func:`deserialize_named_tensors` never unpickles
arbitrary objects: its unpickler resolves only the torch storage/tensor
rebuild functions, tensor and storage classes, ``torch.Size`` and torch dtypes,
and refuses every other global with :class:`UnsafePayloadError`.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

NamedTensors = list[tuple[str, torch.Tensor]]
Reduction = tuple[Callable[..., Any], tuple[Any, ...]]

REBUILD_DEVICE_ARG = 6
"""Position of the storage's device among ``rebuild_cuda_tensor``'s arguments (torch 2.x; SGLang patches the same)."""

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


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` (this process's numbering), as SGLang writes it."""
    return str(torch.cuda.get_device_properties(index).uuid)


@functools.cache
def visible_device_uuids() -> tuple[str, ...]:
    """UUIDs of this process's visible CUDA devices, by index (empty without CUDA)."""
    return tuple(device_uuid(index) for index in range(torch.cuda.device_count()))


def rebuild_args_with_uuid(args: tuple[Any, ...], uuid_of: Callable[[int], str] = device_uuid) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor`` arguments with the device index replaced by ``uuid_of(index)``; a UUID is kept."""
    device = args[REBUILD_DEVICE_ARG]
    if isinstance(device, str):
        return args
    return (*args[:REBUILD_DEVICE_ARG], uuid_of(device), *args[REBUILD_DEVICE_ARG + 1 :])


def rebuild_args_with_index(args: tuple[Any, ...], visible_uuids: Sequence[str]) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor`` arguments with a device UUID replaced by its index in ``visible_uuids``.

    An int device passes unchanged. Raises ValueError naming the UUID and the visible devices when
    no visible device has it, and UnsafePayloadError for a device that is neither int nor str.
    """
    device = args[REBUILD_DEVICE_ARG]
    if isinstance(device, int):
        return args
    if not isinstance(device, str):
        raise UnsafePayloadError(f"CUDA tensor device must be an index or a UUID string, got {type(device).__name__}")
    if device not in visible_uuids:
        visible = ", ".join(f"{i}: {uuid}" for i, uuid in enumerate(visible_uuids)) or "none"
        raise ValueError(
            f"CUDA IPC tensor on device {device}, which this process does not see (visible devices: {visible}; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); the receiving engine must run on "
            "the sender's node with its GPU visible, or use weight_sync.transport=distributed"
        )
    return (*args[:REBUILD_DEVICE_ARG], visible_uuids.index(device), *args[REBUILD_DEVICE_ARG + 1 :])


def with_device_uuid(reduction: Reduction, uuid_of: Callable[[int], str] = device_uuid) -> Reduction:
    """Torch's reduction of a tensor, the device of a CUDA one written as its UUID; any other passes unchanged."""
    rebuild, args = reduction
    if rebuild is reductions.rebuild_cuda_tensor:
        return rebuild, rebuild_args_with_uuid(args, uuid_of)
    return reduction


def _reduce_tensor(tensor: torch.Tensor) -> Reduction:
    return with_device_uuid(reductions.reduce_tensor(tensor))


def _rebuild_cuda_tensor_on_visible_device(*args: Any) -> torch.Tensor:
    return reductions.rebuild_cuda_tensor(*rebuild_args_with_index(args, visible_device_uuids()))


class _TensorOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_on_visible_device
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

    CUDA tensors name their device by UUID (see the module docstring); serialize once per receiving
    process: each deserialization releases one reference the serialization took.

    Raises TypeError for anything but (str, Tensor) pairs.
    """
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        if not isinstance(item[1], torch.Tensor):
            raise TypeError(f"{item[0]}: expected a torch.Tensor, got {type(item[1]).__name__}")
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    with _sharing_strategy("file_system"):
        pickler.dump([(name, tensor.detach()) for name, tensor in named_tensors])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str) -> NamedTensors:
    """Inverse of :func:`serialize_named_tensors`; tensors are views of the sender's memory (copy them).

    A CUDA tensor opens on the visible device whose UUID the payload names (or the index it names);
    a UUID no visible device has raises ValueError naming it and the visible devices.

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
