"""IPC tensor payloads: round trip through shared memory, the allow-list unpickler refusing anything else,
and CUDA devices named by UUID (the rebuild arguments transformed both ways, with injected device UUIDs)."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch
from torch.multiprocessing import reductions

from megatron_rl.weight_sync.bucket_buffers import BucketBuffers
from megatron_rl.weight_sync.buckets import BucketFiller
from megatron_rl.wire.tensor_serialization import (
    FLATTENED_BUCKET,
    REBUILD_DEVICE_ARG,
    UnsafePayloadError,
    deserialize_flattened_bucket,
    deserialize_named_tensors,
    deserialize_payload,
    flattened_bucket,
    rebuild_args_with_index,
    rebuild_args_with_uuid,
    serialize_flattened_bucket,
    serialize_named_tensors,
    with_device_uuid,
)
from tests.ipc_payloads import cuda_payload, cuda_rebuild_args


def test_named_tensors_round_trip_bit_exact():
    tensors = [("a", torch.randn(3, 4)), ("b", torch.arange(6, dtype=torch.bfloat16)), ("c", torch.ones(2)[0])]
    restored = deserialize_named_tensors(serialize_named_tensors(tensors))
    assert [name for name, _ in restored] == ["a", "b", "c"]
    for (_, original), (_, copy) in zip(tensors, restored, strict=True):
        assert copy.dtype == original.dtype and torch.equal(copy, original)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo owned",))


@pytest.mark.parametrize(
    "payload",
    [[("x", _Exploit())], {"not": "a list"}, [("x", torch.ones(1), "extra")]],
    ids=["global", "dict", "tuple"],
)
def test_unpickler_refuses_anything_but_named_tensors(payload):
    with pytest.raises(UnsafePayloadError):
        deserialize_named_tensors(base64.b64encode(pickle.dumps(payload)).decode())


def _views_of_one_storage() -> list[tuple[str, torch.Tensor]]:
    storage = torch.zeros(1024, dtype=torch.uint8)
    a = storage[64:112].view(torch.float32).view(3, 4).copy_(torch.randn(3, 4))
    b = storage[256:268].view(torch.bfloat16).copy_(torch.arange(6, dtype=torch.bfloat16))
    c = storage[512:552].view(torch.float64).copy_(torch.randn(5, dtype=torch.float64))
    return [("c", c), ("a", a), ("b", b)]  # any order; gaps between them


def test_a_flattened_bucket_spans_its_views_and_round_trips_bit_exact():
    named = _views_of_one_storage()
    bucket = flattened_bucket(named)
    assert bucket is not None
    flat, metadata = bucket
    assert flat.dtype == torch.uint8 and flat.numel() == 552 - 64 and flat.data_ptr() == named[1][1].data_ptr()
    assert [(m.name, m.start_idx, m.end_idx, m.numel) for m in metadata] == [
        ("c", 448, 488, 40),
        ("a", 0, 48, 48),
        ("b", 192, 204, 12),
    ]
    restored = deserialize_payload(serialize_flattened_bucket(flat, metadata), FLATTENED_BUCKET)
    assert [name for name, _ in restored] == ["c", "a", "b"]
    for (_, original), (_, copy) in zip(named, restored, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)


def test_tensors_of_several_storages_or_strided_go_one_by_one():
    named = _views_of_one_storage()
    assert flattened_bucket([*named, ("other", torch.ones(3))]) is None
    assert flattened_bucket([("t", named[1][1].t())]) is None
    assert flattened_bucket([*named, ("empty", named[0][1][:0])]) is None
    assert flattened_bucket([]) is None


def _flattened_payload(flat: object, metadata: object) -> str:
    return base64.b64encode(pickle.dumps({"flattened_tensor": flat, "metadata": metadata})).decode()


@pytest.mark.parametrize(
    "payload",
    [
        _flattened_payload(torch.zeros(16, dtype=torch.uint8), [_Exploit()]),
        _flattened_payload(torch.zeros(4), []),
        base64.b64encode(pickle.dumps([("x", torch.ones(1))])).decode(),
    ],
    ids=["global", "not-uint8", "not-a-dict"],
)
def test_flattened_unpickler_refuses_foreign_objects(payload):
    with pytest.raises(UnsafePayloadError):
        deserialize_flattened_bucket(payload)


@pytest.mark.parametrize(
    ("start", "end", "shape", "dtype"),
    [
        (0, 20, (5,), torch.float32),
        (8, 16, (3,), torch.float32),
        (2, 6, (1,), torch.float32),
        (-4, 0, (1,), torch.float32),
    ],
    ids=["past-the-end", "size-mismatch", "misaligned", "negative"],
)
def test_flattened_metadata_outside_its_tensor_is_refused(start, end, shape, dtype):
    bucket = flattened_bucket([("w", torch.zeros(4))])
    assert bucket is not None
    flat, (meta,) = bucket
    meta.start_idx, meta.end_idx, meta.shape, meta.dtype = start, end, torch.Size(shape), dtype
    with pytest.raises(UnsafePayloadError, match="w: bytes"):
        deserialize_flattened_bucket(serialize_flattened_bucket(flat, [meta]))


def test_released_bucket_buffers_come_back_at_their_size():
    """After a release the next sync's bucket lies in one buffer again (so it goes flattened)."""
    buffers = BucketBuffers(num_buffers=1)
    tensors = [torch.full((n,), float(n)) for n in (10, 300, 5000)]
    first = [(str(i), buffers.copy_in(t)) for i, t in enumerate(tensors)]
    assert flattened_bucket(first) is None  # the buffer grew twice inside the first bucket
    buffers.seal(first)
    buffers.release()
    again = [(str(i), buffers.copy_in(t)) for i, t in enumerate(tensors)]
    assert flattened_bucket(again) is not None


def test_buckets_respect_the_size_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 1])]  # fp32: 40, 40, 120, 20, 4 bytes
    buckets: list[list] = []
    filler = BucketFiller(80, buckets.append)
    for name, tensor in tensors:
        filler.add(name, tensor)
    filler.flush()
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        BucketFiller(0, buckets.append)


def test_an_allocated_group_starts_a_new_bucket_whole_when_it_does_not_fit():
    buckets: list[list] = []
    filler = BucketFiller(80, buckets.append, lambda shapes, dtype: [torch.zeros(s, dtype=dtype) for s in shapes])
    filler.add("t0", torch.zeros(10))  # 40 bytes
    assert filler.allocate is not None
    gate, up = filler.allocate([(6,), (6,)], torch.float32)  # 48 bytes: with t0 past 80, so t0 goes alone
    assert [[name for name, _ in b] for b in buckets] == [["t0"]]
    filler.add("gate", gate)
    filler.add("up", up)
    filler.add("t1", torch.zeros(8))  # 32 bytes: 80 in all, still fits
    filler.flush()
    assert [[name for name, _ in b] for b in buckets] == [["t0"], ["gate", "up", "t1"]]


UUIDS = ("8f1c0d2e-0000-4000-8000-00000000000a", "8f1c0d2e-0000-4000-8000-00000000000b")


def test_device_index_becomes_the_uuid_and_back():
    args = cuda_rebuild_args(1)
    with_uuid = rebuild_args_with_uuid(args, uuid_of=lambda index: UUIDS[index])
    assert with_uuid[REBUILD_DEVICE_ARG] == UUIDS[1]
    assert with_uuid[:REBUILD_DEVICE_ARG] == args[:REBUILD_DEVICE_ARG]
    assert with_uuid[REBUILD_DEVICE_ARG + 1 :] == args[REBUILD_DEVICE_ARG + 1 :]
    assert rebuild_args_with_index(with_uuid, UUIDS) == args
    assert rebuild_args_with_index(with_uuid, UUIDS[::-1])[REBUILD_DEVICE_ARG] == 0  # the receiver's numbering


def test_int_devices_and_uuids_pass_unchanged():
    assert rebuild_args_with_index(cuda_rebuild_args(3), UUIDS) == cuda_rebuild_args(3)
    assert rebuild_args_with_uuid(cuda_rebuild_args(UUIDS[0]), uuid_of=lambda index: "other") == cuda_rebuild_args(
        UUIDS[0]
    )


def test_unknown_uuid_names_it_and_the_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    unknown = "8f1c0d2e-0000-4000-8000-0000000000ff"
    with pytest.raises(ValueError, match=rf"(?s){unknown}.*0: {UUIDS[0]}, 1: {UUIDS[1]}.*CUDA_VISIBLE_DEVICES='2,3'"):
        rebuild_args_with_index(cuda_rebuild_args(unknown), UUIDS)
    with pytest.raises(UnsafePayloadError, match="index or a UUID string, got float"):
        rebuild_args_with_index(cuda_rebuild_args(1.0), UUIDS)  # type: ignore[arg-type]  # a float device, on purpose


def test_only_cuda_reductions_get_a_uuid():
    cpu = reductions.reduce_tensor(torch.ones(2))
    assert with_device_uuid(cpu, uuid_of=lambda index: UUIDS[index]) == cpu
    rebuild, args = with_device_uuid((reductions.rebuild_cuda_tensor, cuda_rebuild_args(0)), lambda i: UUIDS[i])
    assert rebuild is reductions.rebuild_cuda_tensor and args == cuda_rebuild_args(UUIDS[0])


def test_a_uuid_this_process_does_not_see_is_a_clear_error_on_receipt():
    with pytest.raises(ValueError, match=rf"device {UUIDS[0]}, which this process does not see"):
        deserialize_named_tensors(cuda_payload("w", cuda_rebuild_args(UUIDS[0])))
