"""A bucket packed back to back for one broadcast (SGLang's flattened_bucket layout), and unpacked as the engine does."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.wire.dense_buckets import aligned_runs, dense_layout, empty_bucket, pack


def _mixed() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.float32", torch.randn(3, 4, generator=generator)),
        ("b.bfloat16.odd", torch.randn(7, generator=generator).bfloat16()),
        ("c.float32", torch.randn(5, generator=generator)),
        ("d.bfloat16", torch.randn(2, 3, generator=generator).bfloat16()),
        ("e.int8", torch.arange(3, dtype=torch.int8)),
        ("f.float64", torch.randn(2, generator=generator, dtype=torch.float64)),
    ]


def test_runs_split_only_where_the_dense_layout_would_misalign():
    runs = aligned_runs(_mixed())
    # 48 + 14 bytes put c.float32 at offset 62; after e.int8 (3 bytes) f.float64 sits at 12 + 3 = 15
    assert [[name for name, _ in run] for run in runs] == [
        ["a.float32", "b.bfloat16.odd"],
        ["c.float32", "d.bfloat16", "e.int8"],
        ["f.float64"],
    ]
    uniform = [(f"w{i}", torch.ones(i + 1, dtype=torch.bfloat16)) for i in range(5)]
    assert aligned_runs(uniform) == [uniform]
    assert aligned_runs([]) == []


def test_pack_then_unpack_gives_every_tensor_back_bit_exact():
    named = _mixed()
    restored = []
    for run in aligned_runs(named):
        flat = pack(run)
        names, dtypes, shapes = [n for n, _ in run], [t.dtype for _, t in run], [list(t.shape) for _, t in run]
        assert flat.dtype == torch.uint8 and flat.numel() == dense_layout(names, dtypes, shapes)[-1]
        received, views = empty_bucket(names, dtypes, shapes, "cpu")
        received.copy_(flat)
        restored += views
    assert [name for name, _ in restored] == [name for name, _ in named]
    for (_, original), (_, copy) in zip(named, restored, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)


def test_a_non_contiguous_tensor_is_packed_by_value():
    matrix = torch.arange(12.0).view(3, 4)
    (run,) = aligned_runs([("t", matrix.t())])
    flat, ((_, copy),) = empty_bucket(["t"], [torch.float32], [[4, 3]], "cpu")
    flat.copy_(pack(run))
    assert torch.equal(copy, matrix.t())


@pytest.mark.parametrize(
    ("dtypes", "shapes", "message"),
    [
        (
            [torch.bfloat16, torch.float32],
            [[3], [2]],
            "^Unaligned received tensor w1: byte offset 6, dtype torch.float32$",
        ),
        ([torch.float32], [[-1]], r"^Negative dimension in received tensor w0: torch.Size\(\[-1\]\)$"),
        ([], [], "^Cannot create empty tensor bucket$"),
    ],
    ids=["unaligned", "negative", "empty"],
)
def test_the_layout_refuses_what_sglang_refuses(dtypes, shapes, message):
    with pytest.raises(ValueError, match=message):
        dense_layout([f"w{i}" for i in range(len(dtypes))], dtypes, shapes)
