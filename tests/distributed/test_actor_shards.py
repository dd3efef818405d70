"""The trainer's step on per-rank shards equals the step on the whole batch; the reference model routes itself.

The same 8 sequences (2 mini-batches, KL loss on, rollout log-probs given) are trained once at DP2,
each rank getting only its :class:`StepData` shard and computing old and reference log-probs for
those samples alone (``train_step.train_step``), and once at DP1, one rank holding the whole step.
Each mini-batch holds the same samples in both, so the same rows meet the same weights and the
updates agree up to float32 rounding: the old log-probs are the same forward pass over differently
padded micro-batches (another summation order in the matmuls).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.train_step import train_step
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.actor_setup import (
    algorithm_config,
    batch_rows,
    fixed_batch,
    rank_shard,
    save_tiny_moe_2layer,
    tiny_actor,
    train_config,
    transformers_log_probs,
)
from tests.distributed_utils import run_distributed

MINI_BATCHES = 2


def _with_rollout_log_probs(batch: ActorBatch) -> ActorBatch:
    """Rollout log-probs -0.5, -0.6, ... along each response."""
    steps = (torch.arange(batch.seq_length) - batch.response_mask.int().argmax(1, keepdim=True)).clamp(min=0)
    return batch.replace(rollout_log_probs=torch.where(batch.response_mask, -0.5 - 0.1 * steps.float(), 0.0))


def _actor(hf_dir):
    algorithm = algorithm_config(use_kl_loss=True, kl_coef=0.5, entropy_coef=0.01)
    return tiny_actor(
        hf_dir, ParallelSizes(), train=train_config(lr=0.1, mini_batches_per_step=MINI_BATCHES), algorithm=algorithm
    )


def _parameters(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for model in actor.models for p in model.parameters()]


def _step_rank(rank, world_size, hf_dir, batch):
    initialize_parallel(ParallelSizes())
    actor = _actor(hf_dir)
    shard = rank_shard(batch, MINI_BATCHES)
    metrics = train_step(actor, shard)
    result = {"metrics": metrics, "params": _parameters(actor), "ids": shard.sample_ids.tolist()}
    destroy_parallel()
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    hf_dir = save_tiny_moe_2layer(tmp_path_factory.mktemp("shards") / "moe")
    batch = _with_rollout_log_probs(fixed_batch())
    return run_distributed(_step_rank, 1, hf_dir, batch), run_distributed(_step_rank, 2, hf_dir, batch)


@pytest.mark.distributed
def test_each_rank_trains_only_on_its_own_samples(runs):
    _, shard_runs = runs
    ids = [run["ids"] for run in shard_runs]
    assert sorted(ids[0] + ids[1]) == list(range(8)) and not set(ids[0]) & set(ids[1])
    assert len(ids[0]) == len(ids[1]) == 4


@pytest.mark.distributed
def test_shard_step_equals_the_whole_batch_step(runs):
    (reference,), shard_runs = runs
    assert "mismatch_kl" in reference["metrics"]
    for shard in shard_runs:
        for name in ("loss", "policy_loss", "kl_loss", "entropy", "clip_frac_upper", "approx_kl", "tokens"):
            # fp32 forwards of the same rows: a few ulps per log-prob, summed over ~60 response tokens.
            assert shard["metrics"][name] == pytest.approx(reference["metrics"][name], rel=1e-5, abs=1e-6), name
        for ours, theirs in zip(shard["params"], reference["params"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert "time_old_log_probs_s" in shard_runs[0]["metrics"] and "time_ref_log_probs_s" in shard_runs[0]["metrics"]


def _reference_routing_rank(rank, world_size, hf_dir, batch):
    initialize_parallel(ParallelSizes())
    actor = tiny_actor(hf_dir, ParallelSizes(), algorithm=algorithm_config(routing_replay=True), keep_reference=True)
    shard = rank_shard(batch)
    ids = shard.sample_ids
    result = {
        "policy": (ids, actor.log_probs(shard).log_probs),
        "ref": (ids, actor.log_probs(shard, reference=True).log_probs),
    }
    destroy_parallel()
    return result


@pytest.mark.distributed
def test_the_reference_model_routes_with_its_own_routers(tmp_path):
    hf_dir = save_tiny_moe_2layer(tmp_path / "moe")
    batch = fixed_batch()
    scores = torch.rand((batch.num_sequences, batch.seq_length, 2, 4), generator=torch.Generator().manual_seed(5))
    batch = batch.replace(routed_experts=scores.topk(2, dim=-1).indices)  # not what the routers would choose
    natural, _ = transformers_log_probs(hf_dir, batch)
    ranks = run_distributed(_reference_routing_rank, 2, hf_dir, batch)
    result = {name: batch_rows([rank[name] for rank in ranks], batch) for name in ("policy", "ref")}
    valid = batch.response_mask
    # Reference weights are the initial ones: with its own routing it is transformers' model (parity 1e-5).
    torch.testing.assert_close(result["ref"][valid], natural[valid], rtol=0, atol=1e-5)
    assert (result["policy"][valid] - natural[valid]).abs().max() > 1e-2  # the policy replayed the given experts


def _device_reference_rank(rank, world_size, hf_dir, batch):
    initialize_parallel(ParallelSizes())
    algorithm = algorithm_config(use_kl_loss=True, kl_coef=0.5, reference_placement="device")
    actor = tiny_actor(hf_dir, ParallelSizes(), train=train_config(lr=0.1), algorithm=algorithm)

    def reference_tensors() -> list[torch.Tensor]:
        assert actor._reference is not None, "reference_placement=device keeps the reference weights"
        return actor._reference.tensors

    reference = [t.clone() for t in reference_tensors()]
    policy_before = [p.detach().clone() for model in actor.models for p in model.parameters()]
    shard = rank_shard(batch)
    ref_log_probs = (shard.sample_ids, actor.log_probs(shard, reference=True).log_probs)
    policy_after = [p.detach() for model in actor.models for p in model.parameters()]
    exchanged_back = all(torch.equal(a, b) for a, b in zip(policy_before, policy_after, strict=True))
    actor.offload(keep_params=True)  # the weight-sync stage: the device reference goes with the optimizer state
    freed = all(t.untyped_storage().nbytes() == 0 for t in reference_tensors())
    actor.reload()
    restored = all(torch.equal(a, b) for a, b in zip(reference, reference_tensors(), strict=True))
    result = {"ref": ref_log_probs, "exchanged_back": exchanged_back, "freed": freed, "restored": restored}
    destroy_parallel()
    return result


@pytest.mark.distributed
def test_reference_weights_on_the_device_are_exchanged_and_offloaded_with_the_optimizer(tmp_path):
    hf_dir = save_tiny_moe_2layer(tmp_path / "moe")
    batch = fixed_batch()
    natural, _ = transformers_log_probs(hf_dir, batch)
    results = run_distributed(_device_reference_rank, 2, hf_dir, batch)
    for result in results:
        assert result["exchanged_back"] and result["freed"] and result["restored"]
    ref = batch_rows([result["ref"] for result in results], batch)
    torch.testing.assert_close(ref[batch.response_mask], natural[batch.response_mask], rtol=0, atol=1e-5)
