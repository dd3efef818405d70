"""The trainer's step on per-rank shards equals the step on one global batch; the reference model routes itself.

Two gloo ranks at DP2 train once on the same 8 sequences (2 mini-batches, KL loss on): once as a
global :class:`ActorBatch` (old and reference log-probs computed over the whole batch and shared,
then ``train_step``) and once as :class:`StepData` shards (each rank gets only its samples and
computes old and reference log-probs for them alone, ``train_on_shard``). The same rows meet the
same weights in both, so the updates agree up to float32 rounding: the old log-probs are the same
forward pass over differently padded micro-batches (another summation order in the matmuls).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor import ActorBatch
from megatron_rl.actor.step_data import StepData
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.actor_setup import (
    PROMPT_LENGTHS,
    algorithm_config,
    fixed_batch,
    save_tiny_moe_2layer,
    tiny_actor,
    train_config,
    transformers_log_probs,
)
from tests.distributed_utils import run_distributed

MINI_BATCHES = 2


def _step_data(batch: ActorBatch) -> StepData:
    lengths = batch.lengths
    rows = [batch.input_ids[b, : int(n)] for b, n in enumerate(lengths)]
    response = [
        batch.response_mask[b, p : int(n)] for b, (p, n) in enumerate(zip(PROMPT_LENGTHS, lengths, strict=True))
    ]
    log_probs = [-0.5 - 0.1 * torch.arange(len(r), dtype=torch.float32) for r in response]
    return StepData(
        token_ids=torch.cat(rows).to(torch.int32),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]),
        prompt_lengths=torch.tensor(PROMPT_LENGTHS),
        advantages=batch.advantages,
        loss_mask=torch.cat(response),
        rollout_log_probs=torch.cat(log_probs),
        routed_experts=None,
        sample_ids=torch.arange(len(rows)),
        mini_batch_sizes=(len(rows),),
    )


def _actor(hf_dir):
    algorithm = algorithm_config(use_kl_loss=True, kl_coef=0.5, entropy_coef=0.01)
    return tiny_actor(
        hf_dir, ParallelSizes(), train=train_config(lr=0.1, mini_batches_per_step=MINI_BATCHES), algorithm=algorithm
    )


def _parameters(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for model in actor.models for p in model.parameters()]


def _global_rank(rank, world_size, hf_dir, step):
    initialize_parallel(ParallelSizes())
    actor = _actor(hf_dir)
    batch = step.to_actor_batch()
    batch = batch.replace(
        old_log_probs=actor.compute_log_probs(batch).log_probs, ref_log_probs=actor.compute_ref_log_probs(batch)
    )
    metrics = actor.train_step(batch)
    result = {"metrics": metrics, "params": _parameters(actor)}
    destroy_parallel()
    return result


def _shard_rank(rank, world_size, hf_dir, step):
    initialize_parallel(ParallelSizes())
    actor = _actor(hf_dir)
    shard = step.shard(world_size, MINI_BATCHES)[rank]
    metrics = actor.train_on_shard(shard)
    result = {"metrics": metrics, "params": _parameters(actor), "ids": shard.sample_ids.tolist()}
    destroy_parallel()
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    hf_dir = save_tiny_moe_2layer(tmp_path_factory.mktemp("shards") / "moe")
    step = _step_data(fixed_batch())
    return run_distributed(_global_rank, 2, hf_dir, step), run_distributed(_shard_rank, 2, hf_dir, step)


@pytest.mark.distributed
def test_each_rank_trains_only_on_its_own_samples(runs):
    _, shard_runs = runs
    ids = [run["ids"] for run in shard_runs]
    assert sorted(ids[0] + ids[1]) == list(range(8)) and not set(ids[0]) & set(ids[1])
    assert len(ids[0]) == len(ids[1]) == 4


@pytest.mark.distributed
def test_shard_step_equals_the_global_batch_step(runs):
    global_runs, shard_runs = runs
    for reference, shard in zip(global_runs, shard_runs, strict=True):
        for name in ("loss", "policy_loss", "kl_loss", "entropy", "clip_frac_upper", "approx_kl", "tokens"):
            # fp32 forwards of the same rows: a few ulps per log-prob, summed over ~60 response tokens.
            assert shard["metrics"][name] == pytest.approx(reference["metrics"][name], rel=1e-5, abs=1e-6), name
        for ours, theirs in zip(shard["params"], reference["params"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert "time_old_log_probs_s" in shard_runs[0]["metrics"] and "time_ref_log_probs_s" in shard_runs[0]["metrics"]


def _reference_routing_rank(rank, world_size, hf_dir, batch):
    initialize_parallel(ParallelSizes())
    actor = tiny_actor(hf_dir, ParallelSizes(), algorithm=algorithm_config(routing_replay=True), keep_reference=True)
    result = {"policy": actor.compute_log_probs(batch).log_probs, "ref": actor.compute_ref_log_probs(batch)}
    destroy_parallel()
    return result


@pytest.mark.distributed
def test_the_reference_model_routes_with_its_own_routers(tmp_path):
    hf_dir = save_tiny_moe_2layer(tmp_path / "moe")
    batch = fixed_batch()
    scores = torch.rand((batch.num_sequences, batch.seq_length, 2, 4), generator=torch.Generator().manual_seed(5))
    batch = batch.replace(routed_experts=scores.topk(2, dim=-1).indices)  # not what the routers would choose
    natural, _ = transformers_log_probs(hf_dir, batch)
    result = run_distributed(_reference_routing_rank, 2, hf_dir, batch)[0]
    valid = batch.response_mask
    # Reference weights are the initial ones: with its own routing it is transformers' model (parity 1e-5).
    torch.testing.assert_close(result["ref"][valid], natural[valid], rtol=0, atol=1e-5)
    assert (result["policy"][valid] - natural[valid]).abs().max() > 1e-2  # the policy replayed the given experts


def _device_reference_rank(rank, world_size, hf_dir, batch):
    initialize_parallel(ParallelSizes())
    algorithm = algorithm_config(use_kl_loss=True, kl_coef=0.5, reference_placement="device")
    actor = tiny_actor(hf_dir, ParallelSizes(), train=train_config(lr=0.1), algorithm=algorithm)
    reference = [t.clone() for t in actor._reference.tensors]
    policy_before = [p.detach().clone() for model in actor.models for p in model.parameters()]
    ref_log_probs = actor.compute_ref_log_probs(batch)
    policy_after = [p.detach() for model in actor.models for p in model.parameters()]
    exchanged_back = all(torch.equal(a, b) for a, b in zip(policy_before, policy_after, strict=True))
    actor.offload(keep_params=True)  # the weight-sync stage: the device reference goes with the optimizer state
    freed = all(t.untyped_storage().nbytes() == 0 for t in actor._reference.tensors)
    actor.reload()
    restored = all(torch.equal(a, b) for a, b in zip(reference, actor._reference.tensors, strict=True))
    result = {"ref": ref_log_probs, "exchanged_back": exchanged_back, "freed": freed, "restored": restored}
    destroy_parallel()
    return result


@pytest.mark.distributed
def test_reference_weights_on_the_device_are_exchanged_and_offloaded_with_the_optimizer(tmp_path):
    hf_dir = save_tiny_moe_2layer(tmp_path / "moe")
    batch = fixed_batch()
    natural, _ = transformers_log_probs(hf_dir, batch)
    for result in run_distributed(_device_reference_rank, 2, hf_dir, batch):
        assert result["exchanged_back"] and result["freed"] and result["restored"]
        torch.testing.assert_close(result["ref"][batch.response_mask], natural[batch.response_mask], rtol=0, atol=1e-5)
