"""Shard layouts: reading a rank's slice and unsharding all ranks' slices are inverse operations.

Unsharding into given ``out`` tensors writes the same values, bit for bit, into exactly those tensors;
without ``out``, one shard comes back as views of itself wherever the layout is a slice of it.
"""

import pytest
import torch

from megatron_rl.models.weight_layouts import FusedGateUp, FusedQKV, Replicated, RowParallel, VocabParallel

HIDDEN = 6


class _Reader:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __call__(self, name, rows=None, cols=None):
        tensor = self.tensors[name]
        tensor = tensor if rows is None else tensor[rows]
        return tensor if cols is None else tensor[:, cols]


def _round_trip(layout, tensors: dict[str, torch.Tensor], local_shape: tuple[int, ...], size: int):
    names = list(tensors)
    shards = [layout.read_shard(_Reader(tensors), names, rank, local_shape) for rank in range(size)]
    assert all(tuple(shard.shape) == local_shape for shard in shards)
    assert layout.hf_shapes(local_shape, size) == [tuple(t.shape) for t in tensors.values()]
    full = layout.unshard(shards)
    out = [torch.full(tuple(t.shape), float("nan")) for t in tensors.values()]
    written = layout.unshard(shards, out)
    assert [t.data_ptr() for t in written] == [t.data_ptr() for t in out]
    assert all(torch.equal(a, b) for a, b in zip(written, full, strict=True))
    return shards, full


@pytest.mark.parametrize(
    "layout, local_shape",
    [
        (Replicated(), (HIDDEN,)),
        (RowParallel(), (HIDDEN, 8)),
        (VocabParallel(10), (16, HIDDEN)),
        (FusedGateUp(), (16, HIDDEN)),
    ],
)
def test_one_shard_unshards_to_views_of_itself(layout, local_shape):
    shard = torch.rand(local_shape)
    storage = shard.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in layout.unshard([shard]))


@pytest.mark.parametrize("size", [1, 2])
def test_qkv_shard_holds_whole_kv_groups_as_q_heads_then_k_then_v(size):
    heads, groups, d = 4, 2, 3
    q = torch.arange(heads * d * HIDDEN, dtype=torch.float32).view(heads * d, HIDDEN)
    k, v = -torch.rand(groups * d, HIDDEN), torch.rand(groups * d, HIDDEN) + 100
    local = (groups // size * (heads // groups + 2) * d, HIDDEN)
    shards, (q2, k2, v2) = _round_trip(FusedQKV(heads, groups, d), {"q": q, "k": k, "v": v}, local, size)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    first_group = shards[0][: 4 * d]
    assert torch.equal(first_group, torch.cat([q[: 2 * d], k[:d], v[:d]]))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_gate_up_shard_is_this_ranks_gate_rows_then_its_up_rows(size):
    gate, up = torch.rand(8, HIDDEN), torch.rand(8, HIDDEN)
    shards, (gate2, up2) = _round_trip(FusedGateUp(), {"gate": gate, "up": up}, (16 // size, HIDDEN), size)
    assert torch.equal(gate2, gate) and torch.equal(up2, up)
    assert torch.equal(shards[-1], torch.cat([gate[-8 // size :], up[-8 // size :]]))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_row_parallel_splits_the_input_dimension(size):
    weight = torch.rand(HIDDEN, 8)
    shards, (weight2,) = _round_trip(RowParallel(), {"w": weight}, (HIDDEN, 8 // size), size)
    assert torch.equal(weight2, weight) and torch.equal(shards[0], weight[:, : 8 // size])


@pytest.mark.parametrize("size", [1, 2, 4])
def test_vocab_rows_beyond_the_vocabulary_are_zero_padding_and_trimmed_on_export(size):
    table = torch.rand(10, HIDDEN)
    shards, (table2,) = _round_trip(VocabParallel(10), {"e": table}, (16 // size, HIDDEN), size)
    assert torch.equal(table2, table)
    assert torch.all(torch.cat(shards)[10:] == 0)


def test_replicated_reads_the_whole_tensor():
    norm = torch.rand(HIDDEN)
    shards, (norm2,) = _round_trip(Replicated(), {"n": norm}, (HIDDEN,), 2)
    assert torch.equal(norm2, norm)


def test_only_an_unpadded_vocabulary_is_gathered_in_place():
    out = [torch.empty(16, HIDDEN)]
    targets = VocabParallel(16).gather_targets(out, (8, HIDDEN), 2)
    assert targets is not None
    assert [(t.data_ptr(), tuple(t.shape)) for t in targets] == [
        (out[0].data_ptr(), (8, HIDDEN)),
        (out[0][8].data_ptr(), (8, HIDDEN)),
    ]
    assert VocabParallel(10).gather_targets([torch.empty(10, HIDDEN)], (8, HIDDEN), 2) is None
    assert all(layout.gather_targets(out, (8, HIDDEN), 2) is None for layout in (RowParallel(), FusedGateUp()))
