"""Per-token log-probs and entropies from the last stage's logits, padded or packed.

Shape legend: B rows, S tokens (padded layout), T tokens (packed stream),
V/tp this TP rank's vocabulary slice.

Both functions return values aligned with the padded ``input_ids`` [B, S]:
position t holds log p(input_ids[t] | input_ids[:t]) and the entropy of that
distribution (predicted at t - 1); position 0 holds 0. The distribution is
the sampler's, softmax(logits / temperature). Columns at or beyond
``vocab_size`` (TP padding of the vocabulary) are excluded. Differentiable.
``chunk_tokens`` bounds the softmax working set (see ``parallel/vocab_parallel.py``);
the logits are read in place (every position, the last one's target a dummy that is
dropped), so chunking copies none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.actor.packing import PackedLayout, unpack_predictions
from megatron_rl.parallel.context_parallel import gather_sequence, split_sequence
from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy


@dataclass(frozen=True)
class TokenLogProbs:
    """Log-probs and entropies (nats) of a batch, [B, S] float32 each, aligned with ``input_ids``."""

    log_probs: torch.Tensor
    entropy: torch.Tensor


def token_log_probs(
    logits_BSV: torch.Tensor,
    input_ids_BS: torch.Tensor,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    *,
    temperature: float,
    chunk_tokens: int = 0,
    cp_group: dist.ProcessGroup | None = None,
) -> TokenLogProbs:
    """From padded logits [B, S, V/tp] of ``input_ids_BS``; ``group``: the TP group holding the slices.

    Positions t >= a row's length hold values computed on pad tokens (mask them).
    With context parallelism (``cp_group`` of size > 1) the logits are this CP rank's
    [B, S / cp, V/tp] (its load-balanced positions) of the whole rows ``input_ids_BS``, and
    the result is the whole rows' [B, S], the same on every CP rank; the gradient of a loss
    that every CP rank computes alike on those rows flows back through each rank's own
    positions (``gather_sequence(grads="own")``).
    """
    next_tokens_BS = _next_tokens(input_ids_BS)
    cp = cp_group if cp_group is not None and cp_group.size() > 1 else None
    if cp is not None:
        next_tokens_BS = split_sequence(next_tokens_BS, 1, cp)
    log_probs_BS, entropy_BS = vocab_parallel_logprobs_entropy(
        logits_BSV,
        next_tokens_BS,
        vocab_size=vocab_size,
        group=group,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )
    if cp is not None:
        log_probs_BS = gather_sequence(log_probs_BS, 1, cp, grads="own")
        entropy_BS = gather_sequence(entropy_BS, 1, cp, grads="own")
    first_BS = log_probs_BS.new_zeros((log_probs_BS.shape[0], 1))
    return TokenLogProbs(
        torch.cat([first_BS, log_probs_BS[:, :-1]], dim=1), torch.cat([first_BS, entropy_BS[:, :-1]], dim=1)
    )


def _next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """[..., S] the token each position predicts; the last position gets a dummy (token 0) that callers drop."""
    return torch.cat([input_ids[..., 1:], torch.zeros_like(input_ids[..., :1])], dim=-1)


def packed_token_log_probs(
    logits_1TV: torch.Tensor,
    input_ids_1T: torch.Tensor,
    layout: PackedLayout,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    *,
    temperature: float,
    chunk_tokens: int = 0,
    cp_group: dist.ProcessGroup | None = None,
) -> TokenLogProbs:
    """From packed logits [1, T, V/tp] of the stream ``input_ids_1T``, unpacked to [B, S] by ``layout``.

    Positions t >= a row's length hold 0. No value crosses a row boundary (see
    :func:`~megatron_rl.actor.packing.unpack_predictions`). With context parallelism the logits
    are this CP rank's [1, T / cp, V/tp] (its chunks of every segment) of the whole stream
    ``input_ids_1T``, gathered back as in :func:`token_log_probs`.
    """
    next_tokens_1T = _next_tokens(input_ids_1T)
    cp = cp_group if cp_group is not None and cp_group.size() > 1 else None
    if cp is not None:
        next_tokens_1T = split_sequence(next_tokens_1T, 1, cp, segments=layout.cu_seqlens)
    log_probs_1T, entropy_1T = vocab_parallel_logprobs_entropy(
        logits_1TV,
        next_tokens_1T,
        vocab_size=vocab_size,
        group=group,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
    )
    if cp is not None:
        log_probs_1T = gather_sequence(log_probs_1T, 1, cp, grads="own", segments=layout.cu_seqlens)
        entropy_1T = gather_sequence(entropy_1T, 1, cp, grads="own", segments=layout.cu_seqlens)
    return TokenLogProbs(
        unpack_predictions(log_probs_1T[:, :-1], layout), unpack_predictions(entropy_1T[:, :-1], layout)
    )
