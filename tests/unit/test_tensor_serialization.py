"""IPC tensor payloads: round trip through shared memory, and the allow-list unpickler refusing anything else."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from megatron_rl.rollout.tensor_serialization import (
    UnsafePayloadError,
    deserialize_named_tensors,
    serialize_named_tensors,
)
from megatron_rl.weight_sync.buckets import iter_buckets


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


def test_buckets_respect_the_size_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 1])]  # fp32: 40, 40, 120, 20, 4 bytes
    buckets = list(iter_buckets(tensors, 80))
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        list(iter_buckets(tensors, 0))
