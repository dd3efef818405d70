"""A step's ragged data: sharding over data-parallel ranks, ragged selection, compact types, padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.actor.step_data import StepData, expert_index_dtype
from megatron_rl.data.balancing import balance_across_dp


def _step(lengths: list[int], prompt: int = 2, layers: int = 3, top_k: int = 2) -> StepData:
    lengths_t = torch.tensor(lengths)
    total, responses = int(lengths_t.sum()), int(lengths_t.sum()) - prompt * len(lengths)
    generator = torch.Generator().manual_seed(0)
    return StepData(
        token_ids=torch.randint(0, 1000, (total,), generator=generator, dtype=torch.int32),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths_t, 0)]),
        prompt_lengths=torch.full((len(lengths),), prompt),
        advantages=torch.randn(len(lengths), generator=generator),
        loss_mask=torch.rand(responses, generator=generator) > 0.2,
        rollout_log_probs=-torch.rand(responses, generator=generator),
        routed_experts=torch.randint(0, 128, (total - len(lengths), layers, top_k), generator=generator).to(
            torch.uint8
        ),
        sample_ids=torch.arange(len(lengths)),
        mini_batch_sizes=(len(lengths),),
    )


def test_expert_indices_take_the_smallest_type_that_holds_them() -> None:
    assert expert_index_dtype(128) == torch.uint8 and expert_index_dtype(256) == torch.uint8
    assert expert_index_dtype(257) == torch.int16 and expert_index_dtype(40_000) == torch.int32


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(3, 40), min_size=8, max_size=8).map(lambda xs: xs * 3),
    dp_size=st.sampled_from([1, 2, 4]),
    mini_batches=st.sampled_from([1, 2, 3]),
)
def test_shards_hold_each_sample_once_with_their_part_of_each_mini_batch(
    lengths: list[int], dp_size: int, mini_batches: int
) -> None:
    step = _step(lengths)  # 24 samples: every (mini_batches, dp_size) drawn divides them
    shards = step.shard(dp_size, mini_batches)
    assert sorted(i for shard in shards for i in shard.sample_ids.tolist()) == list(range(len(lengths)))
    full = step.to_actor_batch()
    for rank, shard in enumerate(shards):
        assert shard.mini_batch_sizes == (len(lengths) // mini_batches // dp_size,) * mini_batches
        local = shard.to_actor_batch()
        # The step's contiguous mini-batches in order, each balanced over the DP ranks.
        size = len(lengths) // mini_batches
        expected = []
        for start in range(0, len(lengths), size):
            expected += [start + i for i in balance_across_dp(lengths[start : start + size], dp_size)[rank]]
        assert shard.sample_ids.tolist() == expected
        rows = full.select(expected)
        width = local.seq_length
        for name in ("input_ids", "response_mask", "rollout_log_probs", "routed_experts"):
            assert torch.equal(getattr(local, name), getattr(rows, name)[:, :width]), name
        assert local.advantages is not None and rows.advantages is not None
        assert torch.equal(local.advantages, rows.advantages) and torch.equal(local.lengths, rows.lengths)


def test_each_rank_receives_its_share_of_the_bytes() -> None:
    lengths = [5] * 60 + [200] * 4  # long-tailed
    step = _step(lengths)
    shards = step.shard(4, 2)
    fair = step.nbytes() / 4
    assert max(shard.nbytes() for shard in shards) / fair < 1.10
    assert step.routed_experts is not None
    assert step.routed_experts.element_size() == 1 and step.token_ids.element_size() == 4


def test_a_step_that_does_not_split_names_the_fields() -> None:
    step = _step([5] * 6)
    with pytest.raises(ValueError, match=r"train.mini_batches_per_step=4"):
        step.shard(1, 4)
    with pytest.raises(ValueError, match=r"does not split over 4 data-parallel ranks"):
        step.shard(4, 1)


def test_malformed_step_data_is_refused_naming_the_field() -> None:
    step = _step([5, 6])
    with pytest.raises(ValueError, match=r"StepData.loss_mask must have shape \(7,\)"):
        StepData(**{**step.__dict__, "loss_mask": step.loss_mask[:-1]})
