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

Flattened buckets (SGLang's ``load_format="flattened_bucket"``): when a bucket's
tensors are views of one storage (the tensor transport's bucket buffer),
:func:`flattened_bucket` describes them as one ``uint8`` tensor spanning them plus
per-tensor metadata (name, shape, dtype, byte offsets), and
:func:`serialize_flattened_bucket` pickles ``{"flattened_tensor", "metadata"}``
with each metadata entry a ``types.SimpleNamespace`` of the attributes SGLang's
``FlattenedTensorMetadata`` has (its allow-list unpickler admits
``SimpleNamespace``; its loader reads the attributes). One IPC handle per bucket
instead of one per tensor: measured on an H200, about 72 us of a sync's time
went to each tensor sent on its own.

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
import math
import os
import pickle
import re
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
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
_FLATTENED_GLOBALS: dict[str, frozenset[str]] = {**_ALLOWED_GLOBALS, "types": frozenset({"SimpleNamespace"})}
FLATTENED_BUCKET = "flattened_bucket"
"""SGLang's ``load_format`` for a payload of one flattened tensor and its metadata."""
_METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


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
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(*rebuild_args_with_index(args, visible_device_uuids()))
    return tensor


class _TensorOnlyUnpickler(pickle.Unpickler):
    allowed = _ALLOWED_GLOBALS

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_on_visible_device
        if name in self.allowed.get(module, ()):
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePayloadError(
            f"refusing to unpickle {module}.{name}: only torch tensor/storage rebuild functions are allowed"
        )


class _FlattenedBucketUnpickler(_TensorOnlyUnpickler):
    allowed = _FLATTENED_GLOBALS


@contextlib.contextmanager
def _sharing_strategy(strategy: str) -> Iterator[None]:
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def _dumps(obj: Any) -> str:
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    with _sharing_strategy("file_system"):
        pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


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
    return _dumps([(name, tensor.detach()) for name, tensor in named_tensors])


def serialize_tensor_dict(tensors: Mapping[str, torch.Tensor]) -> str:
    """Base64 text of a ``{name: tensor}`` dict as IPC handles: the payload SGLang 0.5.23's
    ``/load_lora_adapter_from_tensors`` reads without a ``load_format`` (its loader calls ``tensors.items()``,
    ``srt/lora/lora.py:158-160``), where ``/update_weights_from_tensor`` reads a list of pairs
    (:func:`serialize_named_tensors`). Raises TypeError for a key that is not a str or a value that is not a tensor."""
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected str -> torch.Tensor, got {type(name).__name__} -> {type(tensor).__name__}")
    return _dumps({name: tensor.detach() for name, tensor in tensors.items()})


def flattened_bucket(
    named_tensors: Sequence[tuple[str, torch.Tensor]],
) -> tuple[torch.Tensor, list[types.SimpleNamespace]] | None:
    """One ``uint8`` tensor over the bytes of ``named_tensors`` and their metadata, or None when they are not
    all contiguous, non-empty views of one storage (then they go one by one).

    The flat tensor spans the first tensor's first byte to the last one's end, a view of their
    storage (nothing is copied; gaps between them travel unread). Metadata entries have SGLang's
    ``FlattenedTensorMetadata`` attributes: ``name``, ``shape`` (``torch.Size``), ``dtype``,
    ``start_idx`` and ``end_idx`` (byte offsets into the flat tensor) and ``numel`` (their difference).
    """
    if not named_tensors:
        return None
    storage = named_tensors[0][1].untyped_storage()
    spans = []
    for _, tensor in named_tensors:
        if (
            not tensor.is_contiguous()
            or tensor.numel() == 0
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
        ):
            return None
        start = tensor.storage_offset() * tensor.element_size()
        spans.append((start, start + tensor.nbytes))
    first, last = min(start for start, _ in spans), max(end for _, end in spans)
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, first, (last - first,), (1,))
    metadata = [
        types.SimpleNamespace(
            name=name,
            shape=tensor.shape,
            dtype=tensor.dtype,
            start_idx=start - first,
            end_idx=end - first,
            numel=end - start,
        )
        for (name, tensor), (start, end) in zip(named_tensors, spans, strict=True)
    ]
    return flat, metadata


def serialize_flattened_bucket(flat: torch.Tensor, metadata: Sequence[types.SimpleNamespace]) -> str:
    """Base64 text of ``{"flattened_tensor": flat, "metadata": [...]}`` (flat as an IPC handle), SGLang's
    ``flattened_bucket`` payload; see :func:`flattened_bucket`."""
    return _dumps({"flattened_tensor": flat.detach(), "metadata": list(metadata)})


def _unpickle(payload: str, unpickler: type[pickle.Unpickler]) -> Any:
    try:
        raw = base64.b64decode(payload, validate=True)
    except ValueError as error:
        raise UnsafePayloadError(f"payload is not base64: {error}") from error
    return unpickler(io.BytesIO(raw)).load()


def deserialize_named_tensors(payload: str) -> NamedTensors:
    """Inverse of :func:`serialize_named_tensors`; tensors are views of the sender's memory (copy them).

    A CUDA tensor opens on the visible device whose UUID the payload names (or the index it names);
    a UUID no visible device has raises ValueError naming it and the visible devices.

    Raises UnsafePayloadError for a payload naming any other global, or not a list of (str, Tensor) pairs.
    """
    loaded = deserialize_tensors(payload)
    if isinstance(loaded, dict):
        raise UnsafePayloadError("payload must be a list of (name, tensor) pairs")
    return loaded


def deserialize_tensors(payload: str) -> NamedTensors | dict[str, torch.Tensor]:
    """A payload of :func:`serialize_named_tensors` (a list of pairs) or :func:`serialize_tensor_dict` (a dict), as
    pickled; tensors are views of the sender's memory (copy them). Raises UnsafePayloadError for any global outside
    the tensor allow-list and for anything but those two shapes."""
    loaded = _unpickle(payload, _TensorOnlyUnpickler)
    if isinstance(loaded, dict):
        if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            raise UnsafePayloadError("a dict payload must map str names to tensors")
        return loaded
    if not isinstance(loaded, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
        for item in loaded
    ):
        raise UnsafePayloadError("payload must be a list of (name, tensor) pairs or a dict of name -> tensor")
    return loaded


def deserialize_flattened_bucket(payload: str) -> NamedTensors:
    """The named tensors of a :func:`serialize_flattened_bucket` payload, views of its flat tensor (copy them).

    Raises UnsafePayloadError for any global outside the tensor allow-list and ``SimpleNamespace``, and
    for a payload that is not a dict of a 1-D ``uint8`` tensor and metadata entries whose byte range lies
    inside it and matches their shape and dtype.
    """
    loaded = _unpickle(payload, _FlattenedBucketUnpickler)
    if not isinstance(loaded, dict) or set(loaded) != {"flattened_tensor", "metadata"}:
        raise UnsafePayloadError("a flattened_bucket payload must be a dict of 'flattened_tensor' and 'metadata'")
    flat, metadata = loaded["flattened_tensor"], loaded["metadata"]
    if not (isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8 and flat.dim() == 1):
        raise UnsafePayloadError("flattened_tensor must be a 1-D uint8 tensor")
    if not isinstance(metadata, list):
        raise UnsafePayloadError("metadata must be a list")
    named = []
    for meta in metadata:
        if not all(hasattr(meta, field) for field in _METADATA_FIELDS):
            raise UnsafePayloadError(f"metadata entries need the attributes {', '.join(_METADATA_FIELDS)}")
        if not (isinstance(meta.name, str) and isinstance(meta.dtype, torch.dtype)):
            raise UnsafePayloadError("metadata name must be a str and dtype a torch.dtype")
        nbytes = math.prod(meta.shape) * meta.dtype.itemsize
        inside = meta.start_idx >= 0 and meta.start_idx + nbytes == meta.end_idx <= flat.numel()
        if not inside or (flat.storage_offset() + meta.start_idx) % meta.dtype.itemsize:
            raise UnsafePayloadError(
                f"{meta.name}: bytes [{meta.start_idx}, {meta.end_idx}) do not hold {tuple(meta.shape)} of "
                f"{meta.dtype} (aligned to its element size) inside a flattened tensor of {flat.numel()} bytes"
            )
        named.append((meta.name, flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)))
    return named


_SHARED_MEMORY_FILE = re.compile(rb"/torch_(\d+)_")


def shared_memory_owners(named_tensors: NamedTensors) -> set[int]:
    """The process ids that put the received CPU tensors' storages in shared memory (torch names each file
    ``/torch_<pid>_...`` after the process that created it); CUDA and private tensors add none."""
    owners = set()
    for _, tensor in named_tensors:
        storage = tensor.untyped_storage()
        if tensor.device.type == "cpu" and storage.is_shared():
            match = _SHARED_MEMORY_FILE.match(storage._share_filename_cpu_()[1])
            if match is not None:
                owners.add(int(match.group(1)))
    return owners


def deserialize_payload(payload: str, load_format: str | None) -> NamedTensors:
    """One ``/update_weights_from_tensor`` payload as named tensors: :func:`deserialize_flattened_bucket` for
    ``load_format="flattened_bucket"``, else :func:`deserialize_named_tensors`."""
    if load_format == FLATTENED_BUCKET:
        return deserialize_flattened_bucket(payload)
    return deserialize_named_tensors(payload)
