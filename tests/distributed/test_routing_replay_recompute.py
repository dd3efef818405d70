"""Routing replay under full recomputation: the same gradients as without recomputation.

Runs at PP2 x DP2 (4 gloo ranks) with four micro-batches: under 1F1B the first stage runs the
forward of micro-batch i+1 before the backward (and so the recomputed forward) of micro-batch
i, so a recomputed forward that took the routers' current targets would route micro-batch i
with micro-batch i+1's experts. The experts given are random (not the model's own choice), so
any mix-up changes the gradients. One training step with lr 1 and Adam eps 1 (the update is
then close to the gradient) from the same weights; the parameters after it must be equal.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.train_step import train_step
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.actor_setup import (
    algorithm_config,
    fixed_batch,
    rank_shard,
    save_tiny_moe_2layer,
    tiny_actor,
    train_config,
)
from tests.distributed_utils import run_distributed

SIZES = ParallelSizes(pp=2)
NUM_EXPERTS, TOP_K, NUM_LAYERS = 4, 2, 2
BUDGET = 16  # one sequence (at most 16 tokens) per micro-batch: 4 micro-batches per DP rank


def _given_experts(batch) -> torch.Tensor:
    """[B, S, L, K] distinct random experts per token (fixed seed)."""
    generator = torch.Generator().manual_seed(7)
    scores = torch.rand((batch.num_sequences, batch.seq_length, NUM_LAYERS, NUM_EXPERTS), generator=generator)
    return scores.topk(TOP_K, dim=-1).indices


def _step(rank, world_size, hf_dir, batch, recompute: str) -> tuple[dict[str, float], list[torch.Tensor]]:
    initialize_parallel(SIZES)
    actor = tiny_actor(
        hf_dir,
        SIZES,
        train=train_config(max_tokens_per_micro_batch=BUDGET, recompute=recompute),
        algorithm=algorithm_config(routing_replay=True),
    )
    metrics = train_step(actor, rank_shard(batch))
    params = [p.detach().clone() for model in actor.models for p in model.parameters()]
    destroy_parallel()
    return metrics, params


@pytest.mark.distributed
def test_full_recompute_with_routing_replay_gives_the_gradients_of_no_recompute(tmp_path):
    hf_dir = save_tiny_moe_2layer(tmp_path / "moe")
    batch = fixed_batch()
    batch = batch.replace(routed_experts=_given_experts(batch))
    plain_ranks = run_distributed(_step, 4, hf_dir, batch, "none")
    recomputed_ranks = run_distributed(_step, 4, hf_dir, batch, "full")
    for (plain_metrics, plain), (recomputed_metrics, recomputed) in zip(plain_ranks, recomputed_ranks, strict=True):
        assert plain_metrics["num_micro_batches"] == 4
        assert recomputed_metrics["grad_norm"] == plain_metrics["grad_norm"]
        assert recomputed_metrics["loss"] == plain_metrics["loss"]
        for before, after in zip(plain, recomputed, strict=True):
            assert torch.equal(before, after)
