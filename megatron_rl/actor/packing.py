"""Packed (THD) micro-batches for Transformer Engine attention, and the choice packed vs padded.

Shape legend: B rows and S tokens of a padded micro-batch (``ActorBatch``),
T tokens of the packed stream, ``*`` any trailing dimensions.

A padded ``[B, S]`` micro-batch becomes one ``[1, T]`` stream: the valid
tokens of every row with ``lengths[b] > 0``, in row order, each row followed
by pad tokens up to a multiple of ``PackingRule.sequence_multiple`` (one
*segment* per row), then, when T exceeds the segments, one tail segment of pad
tokens. Rows of length 0 (padding rows) take no place in the stream.

``cu_seqlens`` are the segment boundaries (int32, ``[0, ..., T]``); a row's
pad tokens belong to its own segment. Attention is causal within a segment and
RoPE positions restart at 0 at every boundary (Megatron's
``_apply_rotary_pos_emb_thd`` / TE's fused THD RoPE), so every valid token
sees exactly what it sees in the padded layout: its own row's prefix at
positions ``0..t``. Pad tokens after a row's valid tokens are never attended
to by them. The same tensor serves as ``cu_seqlens_q`` and ``cu_seqlens_kv``;
without context parallelism the ``*_padded`` variants stay unset (no padding
*between* what TE treats as sequences), as slime and NeMo-RL do for non-CP packing.

Padding rule (Megatron + TE):

* with sequence parallelism the stream is split into ``tp`` equal chunks
  along T, so every segment is padded to a multiple of ``tp`` (NeMo-RL's
  rule; it also makes T a multiple of ``tp``);
* FP8 GEMMs need each TP rank's token count aligned (16; 32 for mxfp8; 128
  for blockwise), so T is a multiple of ``alignment * tp`` (with SP);
* with context parallelism every segment is padded to a multiple of
  ``2 * cp`` (times ``tp`` with sequence parallelism) and each CP rank runs
  its load-balanced chunks of every segment (``parallel.context_parallel``,
  Transformer Engine's ``thd_get_partitioned_indices``); ``cu_seqlens`` then
  also serve as the ``*_padded`` boundaries TE's CP attention splits by.

The packed stream only exists inside the forward step: log-probs and entropies
computed on it are unpacked (:func:`unpack_predictions`) to the padded
``[B, S]`` layout the loss and the callers use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from megatron.core.packed_seq_params import PackedSeqParams

# Token-count alignment per TP rank that Transformer Engine's FP8 GEMMs need, by Megatron fp8_recipe.
FP8_TOKEN_ALIGNMENT = {"delayed": 16, "tensorwise": 16, "mxfp8": 32, "blockwise": 128}


@dataclass(frozen=True)
class PackingRule:
    """Padding multiples of a packed stream.

    Attributes:
        sequence_multiple: every segment's length is a multiple of it.
        total_multiple: T is a multiple of it (itself a multiple of ``sequence_multiple``).
    """

    sequence_multiple: int = 1
    total_multiple: int = 1


def packing_rule(*, tp: int, cp: int, sequence_parallel: bool, fp8_recipe: str | None) -> PackingRule:
    """The padding rule of the module docstring for these parallel sizes and FP8 recipe (None: no FP8).

    T is a multiple of the segment multiple and of ``cp * tp * alignment`` (with sequence
    parallelism), so that every TP rank of every CP rank gets FP8-aligned token rows.
    """
    split = tp if sequence_parallel else 1
    sequence_multiple = split * (2 * cp if cp > 1 else 1)
    alignment = FP8_TOKEN_ALIGNMENT[fp8_recipe] if fp8_recipe is not None else 1
    return PackingRule(sequence_multiple, math.lcm(sequence_multiple, split * cp * alignment))


def select_packing(
    *,
    pack_sequences: bool,
    cuda: bool,
    transformer_engine_spec: bool,
    tp: int,
    cp: int,
    sequence_parallel: bool,
    fp8_recipe: str | None,
) -> PackingRule | None:
    """The single choice between packed and padded micro-batches: a rule to pack with, or None to pad.

    Packs iff the recipe allows it (``train.pack_sequences``), the model runs
    on CUDA and uses the Transformer Engine layer spec: Megatron's local
    ``DotProductAttention`` asserts ``packed_seq_params is None`` ("Packed
    sequence is not supported by DotProductAttention."). A pure function of
    its arguments.
    """
    if not (pack_sequences and cuda and transformer_engine_spec):
        return None
    return packing_rule(tp=tp, cp=cp, sequence_parallel=sequence_parallel, fp8_recipe=fp8_recipe)


def padded_sequence_multiple(*, tp: int, fp8_recipe: str | None, cp: int = 1) -> int:
    """The multiple ``S`` of padded ``[rows, S]`` micro-batches is rounded up to (the path without packing).

    ``tp`` (sequence parallelism splits every row's tokens over the TP ranks), times the FP8
    token alignment of ``fp8_recipe`` (None: no FP8), so that each TP rank's token rows, ``rows x
    S / tp``, meet Transformer Engine's FP8 GEMM alignment (16; 32 for mxfp8; 128 for blockwise)
    whatever the row count; times ``2 * cp`` with context parallelism (each CP rank holds two of
    the row's ``2 * cp`` equal chunks, and its share is split over TP again).
    """
    return tp * (FP8_TOKEN_ALIGNMENT[fp8_recipe] if fp8_recipe is not None else 1) * (2 * cp if cp > 1 else 1)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class PackedLayout:
    """Where the rows of a padded ``[B, S]`` micro-batch lie in a packed ``[1, T]`` stream.

    Attributes:
        lengths: valid tokens of each of the B rows (0: padding row, not packed).
        starts: each row's first position in the stream (for an empty row: where it would start).
        cu_seqlens: segment boundaries ``0 = c_0 < c_1 < ... < c_n = T`` (see the module docstring).
        seq_length: S of the padded layout.
    """

    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    cu_seqlens: tuple[int, ...]
    seq_length: int

    @property
    def total(self) -> int:
        """T, the stream length."""
        return self.cu_seqlens[-1]

    @property
    def max_seqlen(self) -> int:
        """The longest segment (``max_seqlen_q`` / ``max_seqlen_kv``; also the RoPE table length)."""
        return max(end - start for start, end in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:], strict=True))

    def token_index(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, valid)``, both [B, S]: row b's token t sits at stream position ``index[b, t]`` if ``valid[b, t]``.

        Invalid entries (t >= length) hold a valid but meaningless position.
        """
        positions = torch.arange(self.seq_length, device=device)
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=device).unsqueeze(1)
        starts = torch.tensor(self.starts, dtype=torch.long, device=device).unsqueeze(1)
        valid = positions < lengths
        return torch.where(valid, starts + positions, 0), valid

    def position_ids(self, device: torch.device | str) -> torch.Tensor:
        """[1, T] int64: each stream position's index within its segment (RoPE restarts per segment)."""
        bounds = torch.tensor(self.cu_seqlens, dtype=torch.long, device=device)
        segment_starts = torch.repeat_interleave(bounds[:-1], bounds[1:] - bounds[:-1])
        return (torch.arange(self.total, device=device) - segment_starts).unsqueeze(0)


def plan_packing(lengths: Sequence[int], seq_length: int, rule: PackingRule, total: int | None = None) -> PackedLayout:
    """The layout of rows with these ``lengths`` (S = ``seq_length``) under ``rule``.

    T is ``total`` if given, else the segments' sum rounded up to
    ``rule.total_multiple`` (at least one multiple: a stream of only padding
    rows still has tokens to run).

    Raises:
        ValueError: a length outside ``[0, seq_length]``; ``total`` too small or not a multiple.
    """
    if any(length < 0 or length > seq_length for length in lengths):
        raise ValueError(f"row lengths must lie in [0, {seq_length}]; got {list(lengths)}")
    segments = [_round_up(length, rule.sequence_multiple) for length in lengths]
    used = sum(segments)
    if total is None:
        total = max(_round_up(used, rule.total_multiple), rule.total_multiple)
    if total < max(used, 1) or total % rule.total_multiple:
        raise ValueError(f"cannot pack {used} tokens into T={total} (a positive multiple of {rule.total_multiple})")
    starts = tuple(accumulate(segments, initial=0))[:-1]
    cu_seqlens = tuple(accumulate((segment for segment in segments if segment), initial=0))
    if total > used:
        cu_seqlens += (total,)
    return PackedLayout(tuple(lengths), starts, cu_seqlens, seq_length)


def plan_micro_batch_packing(
    lengths: Sequence[Sequence[int]], seq_length: int, rule: PackingRule
) -> list[PackedLayout]:
    """Layouts of one schedule call's micro-batches, all with the same T (the largest need).

    One T per call keeps pipeline p2p shapes fixed, as the padded path does.
    """
    needed = [plan_packing(rows, seq_length, rule).total for rows in lengths]
    return [plan_packing(rows, seq_length, rule, total=max(needed)) for rows in lengths]


def pack_tokens(values: torch.Tensor, layout: PackedLayout, fill: torch.Tensor | float = 0) -> torch.Tensor:
    """``values`` [B, S, *] -> [1, T, *]: valid tokens at their stream positions, ``fill`` elsewhere.

    ``fill`` is a scalar or a tensor broadcastable to ``*`` (e.g. experts ``0..K-1``).
    """
    index, valid = layout.token_index(values.device)
    packed = values.new_empty((layout.total, *values.shape[2:]))
    packed[:] = fill
    packed[index[valid]] = values[valid]
    return packed.unsqueeze(0)


def unpack_tokens(values: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """``values`` [1, T, *] -> [B, S, *]: each row's tokens back at their positions, 0 at t >= length.

    Differentiable (a gather); ``unpack_tokens(pack_tokens(x))`` is ``x`` on valid positions.
    """
    index, valid = layout.token_index(values.device)
    gathered = values[0][index]
    mask = valid.view(*valid.shape, *([1] * (values.dim() - 2)))
    return torch.where(mask, gathered, torch.zeros((), dtype=values.dtype, device=values.device))


def unpack_predictions(values: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """Per-prediction values [1, T - 1] -> [B, S], aligned like ``input_ids``.

    ``values[0, p]`` belongs to the distribution at stream position p, which
    predicts the token at p + 1 (log-probs of ``ids[:, 1:]`` from
    ``logits[:, :-1]``, and their entropies). Row b's position t (1 <= t <
    length) receives ``values[0, starts[b] + t - 1]``; position 0 and t >=
    length hold 0. Predictions across a segment boundary (last token of one
    segment -> first of the next) and on pad tokens are never read.
    """
    zero = values.new_zeros((1, 1))
    by_target = unpack_tokens(torch.cat([zero, values], dim=1), layout)
    return torch.cat([by_target.new_zeros((by_target.shape[0], 1)), by_target[:, 1:]], dim=1)


def packed_seq_params(
    layout: PackedLayout, device: torch.device | str, *, context_parallel: bool = False
) -> PackedSeqParams:
    """Megatron's THD parameters of ``layout``: ``qkv_format='thd'``, int32 ``cu_seqlens_q`` = ``cu_seqlens_kv``
    on ``device`` (one tensor), ``max_seqlen_q`` = ``max_seqlen_kv`` (int, the whole segment's length); with
    ``context_parallel`` the same tensor as ``cu_seqlens_q_padded`` = ``cu_seqlens_kv_padded`` (TE's CP attention
    and Megatron's THD RoPE split each segment by them); every other field None."""
    cu_seqlens = torch.tensor(layout.cu_seqlens, dtype=torch.int32, device=device)
    padded = cu_seqlens if context_parallel else None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
    )
