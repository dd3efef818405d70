"""A step's samples as the trainer receives them: ragged, compact, one shard per data-parallel rank.

Shape legend: N samples; T = sum of the samples' lengths (prompt + response tokens);
R = sum of their response lengths; E = T - N routed positions (a sample of length n has experts
for positions 0 .. n-2, the tokens the engine ran through its model); L decoder layers; K experts
per token.

The driver builds one :class:`StepData` for the whole step and calls :meth:`StepData.shard`:
each data-parallel rank then receives only its own samples (every rank of its model-parallel
group the same shard), with no padding to the step's longest sequence, token ids in int32,
rollout log-probs for response tokens only and routed experts in the smallest integer type that
holds the expert count. The actor pads a shard into :class:`~megatron_rl.actor.batch.ActorBatch`
rows only on its own rank (:meth:`StepData.to_actor_batch`).

Sharding keeps the update semantics of one global batch: the step is cut into
``mini_batches`` contiguous mini-batches (one optimizer update each), and each mini-batch's
samples are balanced over the DP ranks by workload (``balance_across_dp``, equal counts), so a
rank's shard is its part of mini-batch 0, then of mini-batch 1, and so on (``mini_batch_sizes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.data.balancing import balance_across_dp


def expert_index_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert indices ``0 .. num_experts - 1``.

    uint8 up to 256 experts, int16 up to 32768, else int32.
    """
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 32768 else torch.int32


@dataclass(frozen=True)
class StepData:
    """N samples, ragged (see the module docstring for the shapes).

    Attributes:
        token_ids: [T] int32, each sample's prompt then response, samples back to back.
        offsets: [N + 1] int64, sample i's tokens are ``token_ids[offsets[i]:offsets[i+1]]``.
        prompt_lengths: [N] int64.
        advantages: [N] float32.
        loss_mask: [R] bool, per response token: enters the loss (False for overlong-filtered responses).
        rollout_log_probs: [R] float32, the engine's log-prob of each response token, or None.
        routed_experts: [E, L, K] integer, or None.
        sample_ids: [N] int64, each sample's position in the step (for bookkeeping).
        mini_batch_sizes: samples per mini-batch, in order; they sum to N.
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor
    prompt_lengths: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    rollout_log_probs: torch.Tensor | None
    routed_experts: torch.Tensor | None
    sample_ids: torch.Tensor
    mini_batch_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        num = self.num_samples
        total, responses = int(self.offsets[-1]), int(self.response_lengths.sum())
        checks = [
            ("token_ids", tuple(self.token_ids.shape), (total,)),
            ("prompt_lengths", tuple(self.prompt_lengths.shape), (num,)),
            ("advantages", tuple(self.advantages.shape), (num,)),
            ("sample_ids", tuple(self.sample_ids.shape), (num,)),
            ("loss_mask", tuple(self.loss_mask.shape), (responses,)),
        ]
        if self.rollout_log_probs is not None:
            checks.append(("rollout_log_probs", tuple(self.rollout_log_probs.shape), (responses,)))
        if self.routed_experts is not None:
            checks.append(("routed_experts", tuple(self.routed_experts.shape[:1]), (total - num,)))
        for name, got, wanted in checks:
            if got != wanted:
                raise ValueError(f"StepData.{name} must have shape {wanted}; got {got}")
        if sum(self.mini_batch_sizes) != num:
            raise ValueError(f"mini_batch_sizes {self.mini_batch_sizes} do not sum to the {num} samples")

    @property
    def num_samples(self) -> int:
        """N."""
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> torch.Tensor:
        """[N] int64, prompt + response tokens of each sample."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[N] int64."""
        return self.lengths - self.prompt_lengths

    @property
    def num_tokens(self) -> int:
        """T, every token of every sample."""
        return int(self.offsets[-1])

    def nbytes(self) -> int:
        """Bytes of every tensor this holds (what a rank receives)."""
        tensors = [getattr(self, f.name) for f in dataclasses.fields(self)]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def select(self, indices: Sequence[int], mini_batch_sizes: Sequence[int]) -> StepData:
        """The samples ``indices`` in that order, cut into ``mini_batch_sizes``."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        starts, lengths = self.offsets[:-1][index], self.lengths[index]
        responses = self.response_lengths
        response_starts = (torch.cumsum(responses, 0) - responses)[index]
        tokens = _Segments(starts, lengths)
        response = _Segments(response_starts, responses[index])
        routed = _Segments(starts - index, lengths - 1)  # sample i's experts start at offsets[i] - i
        return StepData(
            token_ids=tokens.gather(self.token_ids),
            offsets=torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]),
            prompt_lengths=self.prompt_lengths[index],
            advantages=self.advantages[index],
            loss_mask=response.gather(self.loss_mask),
            rollout_log_probs=None if self.rollout_log_probs is None else response.gather(self.rollout_log_probs),
            routed_experts=None if self.routed_experts is None else routed.gather(self.routed_experts),
            sample_ids=self.sample_ids[index],
            mini_batch_sizes=tuple(mini_batch_sizes),
        )

    def shard(self, dp_size: int, num_mini_batches: int) -> list[StepData]:
        """One shard per DP rank: each mini-batch's samples balanced over the ranks (module docstring).

        Raises:
            ValueError: the step does not split into ``num_mini_batches`` equal mini-batches, or a
                mini-batch into ``dp_size`` equal parts (the fields to change are named).
        """
        num = self.num_samples
        if num % num_mini_batches:
            raise ValueError(
                f"a step of {num} samples does not split into train.mini_batches_per_step={num_mini_batches} "
                "equal mini-batches; make the samples per step a multiple of it"
            )
        size = num // num_mini_batches
        if size % dp_size:
            raise ValueError(
                f"a mini-batch of {size} samples does not split over {dp_size} data-parallel ranks; make "
                "train.prompts_per_step x rollout.n_samples_per_prompt / train.mini_batches_per_step a multiple of it"
            )
        lengths = self.lengths.tolist()
        per_rank: list[list[int]] = [[] for _ in range(dp_size)]
        for start in range(0, num, size):
            for rank, rows in enumerate(balance_across_dp(lengths[start : start + size], dp_size)):
                per_rank[rank] += [start + row for row in rows]
        return [self.select(rows, [size // dp_size] * num_mini_batches) for rows in per_rank]

    def to_actor_batch(self, pad_token_id: int = 0) -> ActorBatch:
        """All N samples as right-padded [N, S] rows (S the longest sample), int64 ids and experts.

        Positions without routed experts (the last token of each row, padding) hold the distinct
        indices 0 .. K-1, which routing replay accepts and which change no real token's output.
        """
        num, seq = self.num_samples, int(self.lengths.max())
        rows = torch.repeat_interleave(torch.arange(num), self.lengths)
        columns = torch.arange(self.num_tokens) - torch.repeat_interleave(self.offsets[:-1], self.lengths)
        input_ids = torch.full((num, seq), pad_token_id, dtype=torch.long)
        input_ids[rows, columns] = self.token_ids.to(torch.long)
        response = columns >= torch.repeat_interleave(self.prompt_lengths, self.lengths)
        response_mask = torch.zeros(num, seq, dtype=torch.bool)
        response_mask[rows[response], columns[response]] = self.loss_mask
        rollout_log_probs = None
        if self.rollout_log_probs is not None:
            rollout_log_probs = torch.zeros(num, seq, dtype=torch.float32)
            rollout_log_probs[rows[response], columns[response]] = self.rollout_log_probs.to(torch.float32)
        return ActorBatch(
            input_ids=input_ids,
            lengths=self.lengths.clone(),
            response_mask=response_mask,
            advantages=self.advantages.to(torch.float32),
            rollout_log_probs=rollout_log_probs,
            routed_experts=self._padded_experts(rows, columns, seq),
        )

    def _padded_experts(self, rows: torch.Tensor, columns: torch.Tensor, seq: int) -> torch.Tensor | None:
        if self.routed_experts is None:
            return None
        _, layers, top_k = self.routed_experts.shape
        distinct_K = torch.arange(top_k, dtype=torch.long)
        out = distinct_K.expand(self.num_samples, seq, layers, top_k).clone()
        routed = columns < torch.repeat_interleave(self.lengths - 1, self.lengths)
        out[rows[routed], columns[routed]] = self.routed_experts.to(torch.long)
        return out

    def mini_batch_rows(self) -> list[range]:
        """The row ranges of each mini-batch in :meth:`to_actor_batch`'s order."""
        bounds = [0, *torch.cumsum(torch.tensor(self.mini_batch_sizes), 0).tolist()]
        return [range(start, end) for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True)
class _Segments:
    """Rows ``[start, start + length)`` of a ragged tensor, one segment per selected sample."""

    starts: torch.Tensor
    lengths: torch.Tensor

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """The segments of ``values`` (along dim 0) back to back: one contiguous copy per segment."""
        pieces = [values[s : s + n] for s, n in zip(self.starts.tolist(), self.lengths.tolist(), strict=True)]
        return torch.cat(pieces) if pieces else values[:0]
