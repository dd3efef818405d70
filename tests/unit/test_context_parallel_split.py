"""Megatron's load-balanced context-parallel split (megatron_rl.parallel.context_parallel.local_positions)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.parallel.context_parallel import local_positions


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 4, 1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize(("seq_length", "cp"), [(4, 2), (24, 2), (24, 3), (64, 4)])
def test_the_ranks_hold_every_position_once_with_equal_causal_work(seq_length, cp):
    shares = [local_positions(seq_length, cp, rank) for rank in range(cp)]
    assert torch.equal(torch.cat(shares).sort().values, torch.arange(seq_length))
    # Causal attention work of a query at position p is p + 1 keys: the split gives every rank the same sum.
    assert len({int((share + 1).sum()) for share in shares}) == 1


@pytest.mark.parametrize(("seq_length", "cp", "rank"), [(6, 2, 0), (0, 2, 0), (8, 2, 2), (8, 2, -1)])
def test_a_length_or_rank_the_split_cannot_take_is_refused(seq_length, cp, rank):
    with pytest.raises(ValueError):
        local_positions(seq_length, cp, rank)
