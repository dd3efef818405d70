"""Loss aggregation: hand-computed values, split invariance, and how each mode weights tokens."""

from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.algorithms import LOSS_AGG_MODES, LossAggMode, aggregate_loss, count_tokens_and_seqs

INF = float("inf")
# Two responses of 3 and 1 valid tokens; padding holds garbage that must be ignored.
LOSS = torch.tensor([[1.0, 2.0, 3.0, INF], [4.0, -INF, float("nan"), 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
ShardedBatch = tuple[torch.Tensor, torch.Tensor, list[int]]
MaskAndExtra = tuple[torch.Tensor, int]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),
        ("seq-mean-token-sum", ((1 + 2 + 3) + 4) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) / 4 + 4 / 4) / 2),
    ],
)
def test_modes_match_hand_computed_values(mode: LossAggMode, expected: float) -> None:
    loss = aggregate_loss(LOSS, MASK, mode, norm_constant=4)
    assert loss.item() == pytest.approx(expected)


def test_global_counts_replace_local_ones() -> None:
    assert aggregate_loss(LOSS, MASK, "token-mean", num_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=5).item() == pytest.approx(10 / 5)
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", num_seqs=5, norm_constant=2).item() == pytest.approx(
        (6 / 2 + 4 / 2) / 5
    )


def test_counts_are_valid_tokens_and_rows_with_a_valid_token() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    num_tokens, num_seqs = count_tokens_and_seqs(mask)
    assert (num_tokens.item(), num_seqs.item()) == (3, 2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_rows_neither_contribute_nor_count(mode: LossAggMode) -> None:
    padded_loss = torch.cat([LOSS, torch.full((1, 4), 7.0)])
    padded_mask = torch.cat([MASK, torch.zeros(1, 4, dtype=MASK.dtype)])
    with_padding = aggregate_loss(padded_loss, padded_mask, mode, norm_constant=4)
    assert with_padding.item() == pytest.approx(aggregate_loss(LOSS, MASK, mode, norm_constant=4).item())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_no_valid_token_gives_zero_loss_with_zero_gradient(mode: LossAggMode) -> None:
    loss_BT = torch.randn(2, 3, requires_grad=True)
    loss = aggregate_loss(loss_BT, torch.zeros(2, 3), mode, norm_constant=3)
    loss.backward()
    assert loss.item() == 0.0
    assert loss_BT.grad is not None and torch.equal(loss_BT.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_garbage_in_padding_reaches_neither_value_nor_gradient(mode: LossAggMode) -> None:
    loss_BT = LOSS.clone().requires_grad_()
    aggregate_loss(loss_BT, MASK, mode, norm_constant=4).backward()
    assert loss_BT.grad is not None
    assert torch.isfinite(loss_BT.grad).all()
    assert torch.equal(loss_BT.grad[MASK == 0], torch.zeros(4))


def test_seq_mean_token_mean_weights_tokens_of_short_responses_more() -> None:
    loss_BT = torch.ones(2, 4, requires_grad=True)
    aggregate_loss(loss_BT, torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]]), "seq-mean-token-mean").backward()
    assert loss_BT.grad is not None
    assert loss_BT.grad[0, 0].item() == pytest.approx(1 / (1 * 2))
    assert loss_BT.grad[1].tolist() == pytest.approx([1 / (4 * 2)] * 4)


def test_unknown_mode_raises_listing_valid_modes() -> None:
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate_loss(LOSS, MASK, "sequence-mean")  # type: ignore[arg-type]  # not a mode, on purpose


@pytest.mark.parametrize("norm_constant", [None, 0, -1.0])
def test_token_sum_norm_requires_positive_norm_constant(norm_constant: float | None) -> None:
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=norm_constant)


def test_invalid_shapes_and_counts_raise() -> None:
    with pytest.raises(ValueError, match="mask"):
        aggregate_loss(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="loss"):
        aggregate_loss(LOSS[0], MASK[0], "token-mean")
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(LOSS, MASK, "token-mean", num_tokens=-1)


@st.composite
def sharded_batches(draw: st.DrawFn) -> ShardedBatch:
    """A [B, T] loss and mask, and an arbitrary assignment of its rows to up to 4 shards."""
    rows = draw(st.integers(1, 8))
    cols = draw(st.integers(1, 6))
    values = draw(st.lists(st.floats(-10, 10, width=32), min_size=rows * cols, max_size=rows * cols))
    valid = draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
    shard_of_row = draw(st.lists(st.integers(0, 3), min_size=rows, max_size=rows))
    return torch.tensor(values).view(rows, cols), torch.tensor(valid).view(rows, cols), shard_of_row


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@settings(max_examples=50, deadline=None)
@given(batch=sharded_batches())
def test_sum_over_any_row_split_equals_whole_batch_loss_and_gradient(mode: LossAggMode, batch: ShardedBatch) -> None:
    values_BT, mask_BT, shard_of_row = batch
    num_tokens, num_seqs = count_tokens_and_seqs(mask_BT)
    aggregate = partial(aggregate_loss, num_tokens=num_tokens, num_seqs=num_seqs, norm_constant=5.0)

    whole_BT = values_BT.clone().requires_grad_()
    whole = aggregate(whole_BT, mask_BT, mode)
    whole.backward()

    split_BT = values_BT.clone().requires_grad_()
    shard_losses = []
    for shard in range(4):
        rows = torch.tensor([i for i, s in enumerate(shard_of_row) if s == shard], dtype=torch.long)
        shard_losses.append(aggregate(split_BT[rows], mask_BT[rows], mode))
    split = torch.stack(shard_losses).sum()
    split.backward()

    torch.testing.assert_close(split, whole, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(split_BT.grad, whole_BT.grad, atol=1e-6, rtol=1e-5)


@st.composite
def masks_and_step_counts(draw: st.DrawFn) -> MaskAndExtra:
    """A mask with at least one valid token, and how many more of something the rest of the step holds."""
    rows = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, 6), min_size=rows, max_size=rows).filter(any))
    mask = torch.arange(6).expand(rows, 6) < torch.tensor(lengths).unsqueeze(-1)
    return mask, draw(st.integers(0, 50))


@settings(max_examples=50, deadline=None)
@given(case=masks_and_step_counts(), norm_constant=st.floats(1, 4096))
def test_drgrpo_mode_weights_every_token_equally_whatever_its_length(case: MaskAndExtra, norm_constant: float) -> None:
    mask_BT, other_seqs = case
    num_seqs = int(mask_BT.any(dim=-1).sum()) + other_seqs
    loss_BT = torch.randn(mask_BT.shape, requires_grad=True)
    aggregate_loss(
        loss_BT, mask_BT, "seq-mean-token-sum-norm", num_seqs=num_seqs, norm_constant=norm_constant
    ).backward()
    expected = torch.where(mask_BT, 1 / (norm_constant * num_seqs), 0.0)
    torch.testing.assert_close(loss_BT.grad, expected)


@settings(max_examples=50, deadline=None)
@given(case=masks_and_step_counts())
def test_token_mean_weights_every_token_of_the_step_equally(case: MaskAndExtra) -> None:
    mask_BT, other_tokens = case
    num_tokens = int(mask_BT.sum()) + other_tokens
    loss_BT = torch.randn(mask_BT.shape, requires_grad=True)
    aggregate_loss(loss_BT, mask_BT, "token-mean", num_tokens=num_tokens).backward()
    torch.testing.assert_close(loss_BT.grad, torch.where(mask_BT, 1 / num_tokens, 0.0))
