"""Which trainer rank feeds which engine rank (on GPUs the rank on the engine rank's own GPU), and which experts."""

from __future__ import annotations

import pytest

from megatron_rl.weight_sync.engine_feeds import EngineFeed, colocated_feeds, engine_rank_experts


def test_the_30b_layout_feeds_each_engine_rank_from_the_trainer_rank_on_its_gpu():
    feeds = colocated_feeds(32, [4] * 8)  # 4 nodes x 8 GPUs, engines of TP 4 on GPUs 4e..4e+3
    for rank, feed in enumerate(feeds):
        assert feed == EngineFeed(rank // 4, rank % 4, tuple(range(rank // 4 * 4, rank // 4 * 4 + 4)))
    assert [rank for rank, feed in enumerate(feeds) if feed is not None and feed.posts] == list(range(0, 32, 4))


def test_fewer_engines_than_ranks_are_fed_from_the_first_rank_of_their_stride():
    assert colocated_feeds(4, [1, 1]) == [EngineFeed(0, 0, (0,)), None, EngineFeed(1, 0, (2,)), None]
    assert colocated_feeds(2, []) == [None, None]


@pytest.mark.parametrize(("world", "sizes"), [(2, [1, 1, 1]), (4, [2, 4]), (8, [8, 8])])
def test_an_engine_rank_without_a_trainer_rank_of_its_own_is_refused(world, sizes):
    with pytest.raises(ValueError, match="needs a trainer rank of its own"):
        colocated_feeds(world, sizes)


def test_the_30b_engine_ranks_at_tp4_ep4_each_load_a_quarter_of_the_experts():
    assert [engine_rank_experts(t, 4, 4, 128) for t in range(4)] == [range(32 * t, 32 * t + 32) for t in range(4)]


@pytest.mark.parametrize(("tp", "ep"), [(4, 2), (8, 4), (8, 2)])
def test_tp_ranks_of_one_moe_ep_rank_share_its_experts(tp, ep):
    moe_tp, per_rank = tp // ep, 128 // ep
    for tp_rank in range(tp):
        first = tp_rank // moe_tp * per_rank
        assert engine_rank_experts(tp_rank, tp, ep, 128) == range(first, first + per_rank)
    assert engine_rank_experts(3, 4, 1, 128) == range(128)


@pytest.mark.parametrize(("tp_rank", "tp", "ep", "experts"), [(0, 4, 3, 128), (0, 8, 8, 60), (4, 4, 4, 128)])
def test_an_expert_share_sglang_would_not_build_is_refused(tp_rank, tp, ep, experts):
    with pytest.raises(ValueError, match="EP must divide both TP and the experts"):
        engine_rank_experts(tp_rank, tp, ep, experts)
