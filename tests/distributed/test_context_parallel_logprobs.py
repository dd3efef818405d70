"""Token log-probs under context parallelism, padded rows and packed (THD) streams, on 2 gloo CP ranks.

Each CP rank gets its load-balanced share of the same fp64 logits (for a packed stream: its chunks of
every segment) and computes the whole rows' log-probs and entropies through
``token_log_probs`` / ``packed_token_log_probs``; both must equal the single-rank values computed from
the whole logits. A loss that both ranks compute alike from those rows is backpropagated on each: each
rank's gradient must be the single-rank gradient at its own positions (``gather_sequence(grads="own")``).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.packing import PackingRule, pack_tokens, plan_packing
from megatron_rl.actor.token_logprobs import packed_token_log_probs, token_log_probs
from megatron_rl.parallel.context_parallel import local_positions, split_sequence
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.distributed_utils import run_distributed

VOCAB, LENGTHS, SEQ = 11, (7, 3, 8, 5), 8
RULE = PackingRule(sequence_multiple=4, total_multiple=8)  # 2 * cp for cp = 2, as packing_rule gives at tp 1


def _case():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (len(LENGTHS), SEQ), generator=generator)
    layout = plan_packing(LENGTHS, SEQ, RULE)
    logits = {
        "padded": torch.randn(len(LENGTHS), SEQ, VOCAB, generator=generator, dtype=torch.float64),
        "packed": torch.randn(1, layout.total, VOCAB, generator=generator, dtype=torch.float64),
    }
    weights = torch.randn(len(LENGTHS), SEQ, generator=generator, dtype=torch.float64)
    return ids, layout, logits, weights


def _log_probs(kind, logits, ids, layout, cp_group):
    if kind == "padded":
        return token_log_probs(logits, ids, VOCAB, None, temperature=1.0, cp_group=cp_group)
    return packed_token_log_probs(
        logits, pack_tokens(ids, layout), layout, VOCAB, None, temperature=1.0, cp_group=cp_group
    )


def _run(kind, logits, ids, layout, weights, cp_group):
    logits = logits.clone().requires_grad_(True)
    current = _log_probs(kind, logits, ids, layout, cp_group)
    ((current.log_probs + 0.5 * current.entropy) * weights).sum().backward()
    return current.log_probs.detach(), current.entropy.detach(), logits.grad


def _cp_rank(rank, world_size, kind):
    from megatron.core import parallel_state

    initialize_parallel(ParallelSizes(cp=world_size))
    ids, layout, logits, weights = _case()
    group = parallel_state.get_context_parallel_group()
    segments = layout.cu_seqlens if kind == "packed" else None
    local = split_sequence(logits[kind], 1, group, segments=segments)
    result = _run(kind, local, ids, layout, weights, group)
    destroy_parallel()
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_context_parallel_log_probs_and_gradients_equal_one_ranks(kind):
    ids, layout, logits, weights = _case()
    log_probs, entropy, grad = _run(kind, logits[kind], ids, layout, weights, None)
    segments = layout.cu_seqlens if kind == "packed" else None
    for rank, (cp_log_probs, cp_entropy, cp_grad) in enumerate(run_distributed(_cp_rank, 2, kind)):
        # fp64 throughout; the only difference is the order the gathered pieces are summed in backward.
        torch.testing.assert_close(cp_log_probs, log_probs, rtol=0, atol=1e-12)
        torch.testing.assert_close(cp_entropy, entropy, rtol=0, atol=1e-12)
        own = local_positions(grad.shape[1], 2, rank, segments=segments)
        torch.testing.assert_close(cp_grad, grad[:, own], rtol=0, atol=1e-12)
