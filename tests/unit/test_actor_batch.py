"""ActorBatch validation, selection and padding."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.algorithms import count_tokens_and_seqs


def _batch() -> ActorBatch:
    lengths = torch.tensor([4, 2])
    response_mask = torch.tensor([[False, True, True, True], [False, True, False, False]])
    return ActorBatch(
        input_ids=torch.tensor([[5, 6, 7, 8], [9, 3, 0, 0]]),
        lengths=lengths,
        response_mask=response_mask,
        advantages=torch.tensor([1.0, -1.0]),
        old_log_probs=torch.full((2, 4), -1.0),
        routed_experts=torch.full((2, 4, 3, 2), 3),
    )


def test_padding_adds_inert_rows_and_positions():
    padded = _batch().padded(3, 6)
    assert padded.advantages is not None and padded.routed_experts is not None
    assert padded.input_ids.shape == (3, 6)
    assert padded.lengths.tolist() == [4, 2, 0]
    assert padded.advantages.tolist() == [1.0, -1.0, 0.0]
    assert not padded.response_mask[2].any() and not padded.response_mask[:, 4:].any()
    assert [int(c) for c in count_tokens_and_seqs(padded.response_mask)] == [4, 2]
    assert padded.routed_experts[2, 0, 0].tolist() == [0, 1]
    assert padded.routed_experts[0, 0, 0].tolist() == [3, 3]


def test_select_keeps_rows_in_the_given_order():
    selected = _batch().select([1, 0])
    assert selected.input_ids[0].tolist() == [9, 3, 0, 0]
    assert selected.routed_experts is not None and selected.routed_experts.shape == (2, 4, 3, 2)


def test_prompt_mask_is_valid_non_response_tokens():
    assert _batch().prompt_mask.tolist() == [[True, False, False, False], [True, False, False, False]]


def test_shapes_are_checked_with_the_field_name():
    batch = _batch()
    with pytest.raises(ValueError, match="old_log_probs must be"):
        batch.replace(old_log_probs=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="routed_experts must be"):
        batch.replace(routed_experts=torch.zeros(2, 4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot pad"):
        batch.padded(1, 4)
