"""Tensor ops whose result for one row does not depend on the other rows computed with it.

The reference engine batches whatever requests are in flight, and which requests share
a forward pass depends on timing. A response must not: exact resume and identical metrics
between placements need every response to be a function of its own request only. Plain
``F.linear`` does not give that on CPU: MKL picks its GEMM kernel by the row count M
(measured on the 2-core AVX-512 box, torch 2.14.1: a row's output differs between M = 1,
2, 3, 16 and 17 rows, in the last bits). What does hold there, and what the engine relies on
(``tests/unit/test_reference_engine_batching.py`` checks it bitwise on the engine's shapes):

- a GEMM of one fixed shape gives every row the same result whatever its position and
  whatever the other rows hold;
- ``torch.bmm`` computes each batch item as its own GEMM, so the number of items does not
  change an item's result.

So a linear layer runs as a batched matmul of fixed ``ROW_BLOCK``-row blocks (zero rows pad
the last one), and attention runs per token over a fixed key span (the engine's context
length), masked past the token's own position. Row-wise ops (norms, softmax over the last
dimension, element-wise maths) have no cross-row reduction and keep rows apart as they are.
"""

from __future__ import annotations

import torch

ROW_BLOCK = 16
"""Rows per GEMM in :func:`row_invariant_linear` (every GEMM the engine runs has this many rows)."""


def row_invariant_linear(
    x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` as ``F.linear``, with each row's result independent of the other rows.

    ``x_TK``: [T, K] (T >= 0); ``weight_NK``: [N, K]. Returns [T, N]. The rows are padded with zeros to a
    multiple of :data:`ROW_BLOCK` and multiplied block by block in one ``torch.bmm``; every block is a
    GEMM of the same shape, so row t's output is the same bits for any T and any other rows.
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
    """Qwen3's RMSNorm over the last dimension (in float32, then back to ``x``'s dtype), row by row."""
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
    long their sequences are, or on whether it came in a prefill or a decode step.
    """
    tokens, heads, dim = q_THD.shape
    kv_heads, span = keys_SKLD.shape[1], keys_SKLD.shape[2]
    q_TKGD = q_THD.view(tokens, kv_heads, heads // kv_heads, dim)
    keys_TKLD, values_TKLD = keys_SKLD[slots_T], values_SKLD[slots_T]
    scores_TKGL = torch.matmul(q_TKGD, keys_TKLD.transpose(-1, -2)) * scaling
    future_TL = torch.arange(span, device=q_THD.device)[None, :] > positions_T[:, None]
    scores_TKGL = scores_TKGL.masked_fill(future_TL[:, None, None, :], float("-inf"))
    probs_TKGL = torch.softmax(scores_TKGL, dim=-1, dtype=torch.float32).to(q_THD.dtype)
    return torch.matmul(probs_TKGL, values_TKLD).reshape(tokens, heads * dim)
