"""Rollout routing replay: with replay on, every router uses exactly the experts the step gives.

Runs at TP2 x PP2 (sequence parallelism splits each router's tokens over TP;
each pipeline stage holds one of the two MoE layers) and at TP2 x CP2 (each CP
rank routes its load-balanced share of every row, which TP splits again), with
two micro-batches.
The experts the routers actually use are read from their ``routing_map``
outputs (forward hooks), and compared with the given ones at the same
(sequence, position, layer).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.data.micro_batching import token_budget_micro_batches
from megatron_rl.parallel.context_parallel import local_positions
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.actor_setup import (
    algorithm_config,
    fixed_batch,
    rank_shard,
    save_tiny_moe_2layer,
    step_data,
    tiny_actor,
    train_config,
)
from tests.distributed_utils import run_distributed

NUM_EXPERTS, TOP_K, NUM_LAYERS = 4, 2, 2
BUDGET = 60


def _given_experts(batch) -> torch.Tensor:
    """[B, S, L, K] distinct experts per token, drawn from a fixed seed."""
    generator = torch.Generator().manual_seed(5)
    scores = torch.rand((batch.num_sequences, batch.seq_length, NUM_LAYERS, NUM_EXPERTS), generator=generator)
    return scores.topk(TOP_K, dim=-1).indices


def _replay_rank(rank, world_size, sizes, hf_dir, batch):
    initialize_parallel(sizes)
    actor = tiny_actor(
        hf_dir,
        sizes,
        train=train_config(max_tokens_per_micro_batch=BUDGET),
        algorithm=algorithm_config(routing_replay=True),
    )
    used = []
    for chunk in actor.chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(
                    lambda router, inputs, outputs: used.append((router.layer_number - 1, outputs[1].clone()))
                )
    actor.log_probs(rank_shard(batch))
    with pytest.raises(ValueError, match="routed_experts") as missing:
        actor.log_probs(rank_shard(batch.replace(routed_experts=None)))
    result = {
        "used": used,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "cp_rank": parallel_state.get_context_parallel_rank(),
        "error": str(missing.value),
    }
    destroy_parallel()
    return result


def _expected_routing_maps(batch, sizes: ParallelSizes, tp_rank: int, cp_rank: int, layer: int) -> list[torch.Tensor]:
    """Per micro-batch: the [S/tp * rows, E] bool map of the given experts, in the router's token order.

    The rows are the step's as the actor holds them (``StepData.to_actor_batch``: the given experts
    at every routed position, 0..K-1 at each row's last token and padding), in the micro-batches the
    actor forms (token budget, padded to equal rows and length; padding rows route to 0..K-1).
    """
    batch = step_data(batch).to_actor_batch()
    plan = token_budget_micro_batches(batch.lengths.tolist(), BUDGET)
    rows = max(len(part) for part in plan)
    maps = []
    for part in plan:
        experts_BSK = batch.select(part).padded(rows, batch.seq_length).routed_experts[:, :, layer]
        if sizes.cp > 1:
            experts_BSK = experts_BSK[:, local_positions(batch.seq_length, sizes.cp, cp_rank)]
        local_BSK = experts_BSK.chunk(sizes.tp, dim=1)[tp_rank]
        experts_TK = local_BSK.transpose(0, 1).reshape(-1, TOP_K)
        maps.append(torch.zeros(experts_TK.shape[0], NUM_EXPERTS, dtype=torch.bool).scatter(1, experts_TK, True))
    return maps


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("sizes", "layers_per_rank"),
    [
        pytest.param(ParallelSizes(tp=2, pp=2), 1, id="tp2-pp2"),
        pytest.param(ParallelSizes(tp=2, cp=2), 2, id="tp2-cp2"),
    ],
)
def test_replayed_experts_are_exactly_the_given_ones(tmp_path, sizes, layers_per_rank):
    hf_dir = save_tiny_moe_2layer(tmp_path / "moe")
    batch = fixed_batch()
    batch = batch.replace(routed_experts=_given_experts(batch))
    ranks = run_distributed(_replay_rank, 4, sizes, hf_dir, batch)
    checked = set()
    for rank in ranks:
        assert "routing_replay" in rank["error"]
        layers = sorted({layer for layer, _ in rank["used"]})
        assert len(layers) == layers_per_rank
        for layer in layers:
            expected = _expected_routing_maps(batch, sizes, rank["tp_rank"], rank["cp_rank"], layer)
            used = [routing_map for used_layer, routing_map in rank["used"] if used_layer == layer]
            assert len(used) == len(expected) == 2
            for routing_map, wanted in zip(used, expected, strict=True):
                assert torch.equal(routing_map, wanted)
            checked.add((layer, rank["tp_rank"], rank["cp_rank"]))
    assert {(layer, tp) for layer, tp, _ in checked} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert {cp for _, _, cp in checked} == set(range(sizes.cp))
