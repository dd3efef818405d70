"""Tensor ops whose result for one row does not depend on the other rows computed with it.

The reference engine batches whatever requests are in flight, and which requests share
a forward pass depends on timing. A response must not: exact resume and identical metrics
between placements need every response to be a function of its own request only. Plain ops do
not give that, because a kernel library picks its kernel, and how it splits a row's sums over
threads, by the shape it is given (``scripts/probe_row_invariance.py`` shows which, per device):

- CPU (the 2-core AVX-512 box, torch 2.14.1, MKL): ``F.linear``'s result for a row changes with
  the row count M from width 512 on. A ``torch.bmm`` of 16-row blocks does not change with the
  number of blocks when torch runs one intra-op thread (each block is its own single-threaded
  GEMM); with two threads it does at K >= 1,024. Norms and attention keep rows apart.
- CUDA (H200, torch 2.11, cuBLAS): ``F.linear`` and the 16-row ``bmm`` both change with the row
  count, even at width 64; RMS norm's mean over 2,048 values changes with the number of rows,
  and attention's batched ``matmul`` with the number of tokens.

What holds on every backend: a kernel of one fixed shape computes every row with the same
instructions in the same order, whatever the row's position and whatever the other rows hold.
So every op here that reads rows (linear layers, RMS norms, attention) runs in calls of exactly
:data:`ROWS_PER_CALL` rows, zero rows padding the last call (:func:`in_fixed_row_calls`), except
on CPU with one intra-op thread (the engine server's default ``--num-threads 1``), where the
cheaper blocked ``bmm`` and plain row-wise ops hold without padding. A token attends over a fixed
key span (the engine's context length), masked past its own position.
``tests/unit/test_reference_engine_batching.py`` checks this bitwise, op by op over many row
counts (on CPU with one and with two threads) and for the whole forward; CI runs it on CPU, and
``scripts/device_check.py`` on a GPU with ``MEGATRON_RL_TEST_DEVICE=cuda``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ROW_BLOCK = 16
"""Rows per GEMM of the blocked ``bmm`` (CPU, one intra-op thread)."""

ROWS_PER_CALL = 128
"""Rows of every call of a row op elsewhere (a decode step of up to 128 sequences is one call per op)."""


def needs_fixed_row_calls(device: torch.device) -> bool:
    """Whether row ops on ``device`` must run in calls of :data:`ROWS_PER_CALL` rows, in this process.

    False only on CPU with one torch intra-op thread, where blocked ``bmm``, norms and attention
    give a row the same bits for any number of rows (measured; see the module docstring).
    """
    return device.type != "cpu" or torch.get_num_threads() > 1


def in_fixed_row_calls(op: Callable[..., torch.Tensor], *rows_first: torch.Tensor) -> torch.Tensor:
    """``op(*rows_first)`` computed in calls of exactly :data:`ROWS_PER_CALL` rows along dim 0.

    Every tensor of ``rows_first`` has the same dim-0 size T >= 0; the last call's missing rows are
    zeros (integer inputs too: index 0), and their outputs are dropped. ``op`` must treat rows
    independently and return dim 0 of its inputs' size. Returns op's output for the T rows.
    """
    rows = rows_first[0].shape[0]
    calls = max(1, -(-rows // ROWS_PER_CALL))
    missing = calls * ROWS_PER_CALL - rows
    if missing:
        rows_first = tuple(
            torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, missing)) for tensor in rows_first
        )
    if calls == 1:
        return op(*rows_first)[:rows]
    chunks = [
        op(*(tensor[start : start + ROWS_PER_CALL] for tensor in rows_first)) for start in range(0, rows, ROWS_PER_CALL)
    ]
    return torch.cat(chunks)[:rows]


def row_invariant_linear(
    x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` as ``F.linear``, with each row's result independent of the other rows.

    ``x_TK``: [T, K] (T >= 0); ``weight_NK``: [N, K]. Returns [T, N], computed as GEMMs of
    :data:`ROWS_PER_CALL` rows, or on CPU with one thread as one ``torch.bmm`` of :data:`ROW_BLOCK`-row
    blocks (zero rows pad the last one): row t's output is the same bits for any T and any other rows.
    """
    if needs_fixed_row_calls(x_TK.device):
        return in_fixed_row_calls(lambda x: torch.nn.functional.linear(x, weight_NK, bias_N), x_TK)
    return blocked_bmm_linear(x_TK, weight_NK, bias_N)


def blocked_bmm_linear(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` as one ``torch.bmm`` of :data:`ROW_BLOCK`-row blocks (zero rows pad the last).

    Row-invariant on CPU with one intra-op thread only (see the module docstring); [T, K] -> [T, N].
    """
    rows = x_TK.shape[0]
    blocks = -(-rows // ROW_BLOCK)
    padded = x_TK.new_zeros(blocks * ROW_BLOCK, x_TK.shape[1])
    padded[:rows] = x_TK
    weight_KN = weight_NK.t()
    out = torch.bmm(padded.view(blocks, ROW_BLOCK, -1), weight_KN.expand(blocks, *weight_KN.shape))
    out_TN = out.view(blocks * ROW_BLOCK, -1)[:rows]
    return out_TN if bias_N is None else out_TN + bias_N


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm over the last dimension (in float32, then back to ``x``'s dtype), row by row.

    ``x``: [T, ..., D]; computed in calls of :data:`ROWS_PER_CALL` rows of dim 0 where
    :func:`needs_fixed_row_calls`.
    """
    if needs_fixed_row_calls(x.device):
        return in_fixed_row_calls(lambda rows: _rms_norm(rows, weight, eps), x)
    return _rms_norm(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotary(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half layout) of [T, heads, D] with each token's own [T, D] cos/sin."""
    half = x_THD.shape[-1] // 2
    rotated = torch.cat((-x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None] + rotated * sin_TD[:, None]


def slot_attention(
    q_THD: torch.Tensor,
    keys_SKLD: torch.Tensor,
    values_SKLD: torch.Tensor,
    slots_T: torch.Tensor,
    positions_T: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Causal attention of each query token over its own cache slot; [T, H, D] -> [T, H * D].

    ``keys_SKLD`` / ``values_SKLD``: the cache [slots, kv_heads, L, D] with the token's own key
    already written at ``positions_T``; H must be a multiple of kv_heads (grouped queries). Token t
    attends to positions 0..positions_T[t] of slot slots_T[t]. Every token's scores span all L
    positions (masked past its own), so its result does not depend on the other tokens, on how
    long their sequences are, or on whether it came in a prefill or a decode step. Computed in
    calls of :data:`ROWS_PER_CALL` tokens where :func:`needs_fixed_row_calls`.
    """
    kv_heads, span = keys_SKLD.shape[1], keys_SKLD.shape[2]

    def attend(q_THD: torch.Tensor, slots_T: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        tokens, heads, dim = q_THD.shape
        q_TKGD = q_THD.view(tokens, kv_heads, heads // kv_heads, dim)
        keys_TKLD, values_TKLD = keys_SKLD[slots_T], values_SKLD[slots_T]
        scores_TKGL = torch.matmul(q_TKGD, keys_TKLD.transpose(-1, -2)) * scaling
        future_TL = torch.arange(span, device=q_THD.device)[None, :] > positions_T[:, None]
        scores_TKGL = scores_TKGL.masked_fill(future_TL[:, None, None, :], float("-inf"))
        probs_TKGL = torch.softmax(scores_TKGL, dim=-1, dtype=torch.float32).to(q_THD.dtype)
        return torch.matmul(probs_TKGL, values_TKLD).reshape(tokens, heads * dim)

    if needs_fixed_row_calls(q_THD.device):
        return in_fixed_row_calls(attend, q_THD, slots_T, positions_T)
    return attend(q_THD, slots_T, positions_T)
