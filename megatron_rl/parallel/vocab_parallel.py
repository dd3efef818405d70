"""Per-token log-probs and entropy from vocabulary-parallel logits.

With tensor parallelism the output layer leaves each rank a contiguous slice
of the vocabulary: rank r holds columns ``[r*Vl, (r+1)*Vl)`` of the padded
vocabulary. :func:`vocab_parallel_logprobs_entropy` computes, without
gathering the vocabulary, for the sampling distribution softmax(z) with
z = logits / T (T the sampling temperature, 1 by default),

    logp[t]    = z[t, y_t] - logsumexp_v z[t, v]
    entropy[t] = logsumexp_v z[t, v] - sum_v softmax(z[t])_v * z[t, v]

The temperature enters once, in the max shift: (logits - max) / T, divided
in place on that shift (a tensor this function made), so the caller's logits
are never written and no extra [..., Vl] copy is made.

Three reductions over the group: MAX of the row maxima (a constant
shift, no gradient), SUM of the exp-sums (and of the entropy numerators),
SUM of the target logit (held by exactly one rank). Columns at or beyond
``vocab_size`` (TP padding) are excluded. The SUM reductions pass gradients
through unchanged, as Megatron's ``reduce_from_tensor_model_parallel_region``:
every rank computes the same loss, so each rank's local-logit gradient is
already complete.

Shapes: logits ``[..., Vl]`` (any float dtype; math in fp32), targets ``[...]``
(int64, global vocabulary ids). Outputs are fp32 ``[...]``.

Working set: the fp32 copy, the shifted and exp tensors and the entropy terms cost about
21 bytes per ``[token, Vl]`` element at the forward peak. With ``chunk_tokens`` the tokens are
processed in chunks of that many, each under activation checkpointing when gradients are
needed (its intermediates are freed after the forward and recomputed in backward, one chunk
at a time), so the working set is bounded by ``chunk_tokens x Vl`` elements whatever the
micro-batch's size; values and gradients are those of the unchunked computation (the
arithmetic per token is the same).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx
from torch.utils.checkpoint import checkpoint


class _AllReduceSum(torch.autograd.Function):
    """All-reduce SUM forward, identity backward (the loss is replicated on the group)."""

    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _sum_over(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    return tensor if size == 1 else _AllReduceSum.apply(tensor, group)


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies from this rank's vocabulary slice.

    Args:
        logits: ``[..., Vl]`` this rank's slice of the (padded) vocabulary.
        targets: ``[...]`` global token ids; each must be < ``vocab_size``.
        vocab_size: true vocabulary size; columns >= it are padding and are
            ignored (None: no padding).
        group: the tensor-parallel group holding the slices; None means the
            logits hold the whole vocabulary (no communication).
        temperature: T > 0; the values are those of softmax(logits / T), and
            gradients flow through the division.
        chunk_tokens: process at most this many tokens at once (0: all at once); see the
            module docstring. Every rank of ``group`` must pass the same value.

    Returns:
        ``(logprobs, entropy)``, both fp32 of shape ``targets.shape``.
    """
    tokens = targets.numel()
    if chunk_tokens <= 0 or tokens <= chunk_tokens:
        return _logprobs_entropy(logits, targets, vocab_size, group, temperature)
    logits_NV, targets_N = logits.reshape(tokens, logits.shape[-1]), targets.reshape(tokens)
    checkpointed = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for start in range(0, tokens, chunk_tokens):
        chunk = (logits_NV[start : start + chunk_tokens], targets_N[start : start + chunk_tokens])
        if checkpointed:
            parts.append(checkpoint(_logprobs_entropy, *chunk, vocab_size, group, temperature, use_reentrant=False))
        else:
            parts.append(_logprobs_entropy(*chunk, vocab_size, group, temperature))
    log_probs, entropy = (torch.cat([part[i] for part in parts]).reshape(targets.shape) for i in (0, 1))
    return log_probs, entropy


def _logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int | None,
    group: dist.ProcessGroup | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    size = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    local_vocab = logits.shape[-1]
    start = rank * local_vocab
    logits = logits.float()
    if vocab_size is not None and start + local_vocab > vocab_size:
        columns = torch.arange(start, start + local_vocab, device=logits.device)
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))

    row_max = logits.detach().max(dim=-1).values
    if size > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max.unsqueeze(-1)
    if temperature != 1.0:
        shifted.div_(temperature)  # our own tensor; the subtraction's backward saves nothing
    exp = shifted.exp()
    sum_exp = _sum_over(exp.sum(dim=-1), group, size)
    finite_shifted = torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))
    weighted = (exp * finite_shifted).sum(dim=-1)
    sum_weighted = _sum_over(weighted, group, size)

    local_targets = targets - start
    owned = (local_targets >= 0) & (local_targets < local_vocab)
    picked = shifted.gather(-1, local_targets.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum_over(torch.where(owned, picked, torch.zeros_like(picked)), group, size)

    log_normaliser = sum_exp.log()
    return target_logit - log_normaliser, log_normaliser - sum_weighted / sum_exp
