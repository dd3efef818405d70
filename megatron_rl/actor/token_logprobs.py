"""Per-token log-probs and entropies from the last stage's logits, padded or packed.

Shape legend: B rows, S tokens (padded layout), T tokens (packed stream),
V/tp this TP rank's vocabulary slice.

Both functions return values aligned with the padded ``input_ids`` [B, S]:
position t holds log p(input_ids[t] | input_ids[:t]) and the entropy of that
distribution (predicted at t - 1); position 0 holds 0. The distribution is
the sampler's, softmax(logits / temperature). Columns at or beyond
``vocab_size`` (TP padding of the vocabulary) are excluded. Differentiable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.actor.packing import PackedLayout, unpack_predictions
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
) -> TokenLogProbs:
    """From padded logits [B, S, V/tp] of ``input_ids_BS``; ``group``: the TP group holding the slices.

    Positions t >= a row's length hold values computed on pad tokens (mask them).
    """
    log_probs_BS, entropy_BS = vocab_parallel_logprobs_entropy(
        logits_BSV[:, :-1], input_ids_BS[:, 1:], vocab_size=vocab_size, group=group, temperature=temperature
    )
    first_BS = log_probs_BS.new_zeros((log_probs_BS.shape[0], 1))
    return TokenLogProbs(torch.cat([first_BS, log_probs_BS], dim=1), torch.cat([first_BS, entropy_BS], dim=1))


def packed_token_log_probs(
    logits_1TV: torch.Tensor,
    input_ids_1T: torch.Tensor,
    layout: PackedLayout,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    *,
    temperature: float,
) -> TokenLogProbs:
    """From packed logits [1, T, V/tp] of the stream ``input_ids_1T``, unpacked to [B, S] by ``layout``.

    Positions t >= a row's length hold 0. No value crosses a row boundary (see
    :func:`~megatron_rl.actor.packing.unpack_predictions`).
    """
    log_probs_1T, entropy_1T = vocab_parallel_logprobs_entropy(
        logits_1TV[:, :-1], input_ids_1T[:, 1:], vocab_size=vocab_size, group=group, temperature=temperature
    )
    return TokenLogProbs(unpack_predictions(log_probs_1T, layout), unpack_predictions(entropy_1T, layout))
