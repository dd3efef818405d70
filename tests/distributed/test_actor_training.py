"""Training on a fixed batch: the policy loss falls, reported metrics match an independent recomputation,
the reference policy stays the initial one, and offload/reload is bit-identical.

Runs at DP2 (two gloo ranks), each with its shard of the batch. Independent values are computed here
from transformers' log-probs of the same weights, with the formulas written out (not through
``megatron_rl.algorithms``). The first update takes the batch's noisy old log-probs (so that the PPO
ratio is off 1 and both clip bounds are active) through ``run_updates``, the second half of
``train_step.train_step``; the later steps are whole ``train_step`` calls, whose own old log-probs
are the current weights' (ratio 1 at their first update).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.policy_actor import PolicyActor
from megatron_rl.actor.train_step import run_updates, train_step
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.actor_setup import (
    algorithm_config,
    batch_rows,
    batch_with_old_log_probs,
    rank_shard,
    save_tiny_moe_2layer,
    tiny_actor,
    train_config,
    transformers_log_probs,
)
from tests.distributed_utils import run_distributed

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
METRIC_ATOL = 1e-5
LOG_PROBS = ("after", "ref_after_training", "after_ref_swap")  # [n, S] on each rank, of its shard


def _state_tensors(actor: PolicyActor) -> list[torch.Tensor]:
    params = [p.detach().clone() for model in actor.models for p in model.parameters()]
    state = []
    for optimizer in actor.optimizer.optimizer.chained_optimizers:
        for group in optimizer.optimizer.param_groups:
            state += [p.detach().clone() for p in group["params"]]
        for values in optimizer.optimizer.state.values():
            state += [v.clone() for v in values.values() if isinstance(v, torch.Tensor)]
    return params + state


def _training_rank(rank, world_size, hf_dir, batch):
    sizes = ParallelSizes()
    initialize_parallel(sizes)
    algorithm = algorithm_config(
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, use_kl_loss=True, kl_coef=0.5, entropy_coef=0.01
    )
    actor = tiny_actor(hf_dir, sizes, train=train_config(lr=0.1), algorithm=algorithm)
    shard = rank_shard(batch)
    ids = shard.sample_ids
    local = shard.to_actor_batch()
    local = local.replace(
        old_log_probs=batch.old_log_probs[ids, : local.seq_length],
        ref_log_probs=actor.log_probs(shard, reference=True).log_probs,
    )
    (step1,) = run_updates(actor.step_context, local, shard.mini_batch_rows())
    result: dict[str, object] = {"step1": step1}
    result["after"] = (ids, actor.log_probs(shard).log_probs)
    result["ref_after_training"] = (ids, actor.log_probs(shard, reference=True).log_probs)
    result["after_ref_swap"] = (ids, actor.log_probs(shard).log_probs)
    result["step2"] = train_step(actor, shard)

    saved = _state_tensors(actor)
    param_bytes = sum(p.untyped_storage().nbytes() for m in actor.models for p in m.parameters())
    actor.offload(keep_params=True)  # the weight-sync stage: gradients and optimizer state only
    result["params_kept"] = param_bytes == sum(
        p.untyped_storage().nbytes() for m in actor.models for p in m.parameters()
    )
    result["moments_left"] = sum(
        v.untyped_storage().nbytes()
        for optimizer in actor.optimizer.optimizer.chained_optimizers
        for values in optimizer.optimizer.state.values()
        for v in values.values()
        if isinstance(v, torch.Tensor)
    )
    actor.offload()
    result["freed_bytes_left"] = sum(p.untyped_storage().nbytes() for m in actor.models for p in m.parameters())
    actor.reload()
    result["identical_after_reload"] = all(torch.equal(a, b) for a, b in zip(saved, _state_tensors(actor), strict=True))
    result["step3"] = train_step(actor, shard)
    destroy_parallel()
    return result


@pytest.fixture(scope="module")
def training_run(tmp_path_factory):
    hf_dir = save_tiny_moe_2layer(tmp_path_factory.mktemp("actor") / "moe")
    batch = batch_with_old_log_probs(hf_dir)
    log_probs, _ = transformers_log_probs(hf_dir, batch)
    ranks = run_distributed(_training_rank, 2, hf_dir, batch)
    rows = {name: batch_rows([rank[name] for rank in ranks], batch) for name in LOG_PROBS}
    return batch, log_probs, ranks, rows


def _ppo_token_mean_loss(log_probs, batch):
    ratio = torch.exp(log_probs - batch.old_log_probs)
    advantages = batch.advantages.unsqueeze(1)
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    return per_token[batch.response_mask].mean()


def _clip_and_kl(log_probs, batch):
    mask = batch.response_mask
    ratio = torch.exp(log_probs - batch.old_log_probs)[mask]
    advantages = batch.advantages.unsqueeze(1).expand_as(mask)[mask]
    return {
        "clip_frac_upper": ((advantages > 0) & (ratio > 1 + CLIP_HIGH)).float().mean().item(),
        "clip_frac_lower": ((advantages < 0) & (ratio < 1 - CLIP_LOW)).float().mean().item(),
        "approx_kl": (ratio - 1 - ratio.log()).mean().item(),
    }


@pytest.mark.distributed
def test_training_step_reduces_the_policy_loss_on_its_batch(training_run):
    batch, log_probs, ranks, rows = training_run
    before = _ppo_token_mean_loss(log_probs, batch)
    after = _ppo_token_mean_loss(rows["after"], batch)
    assert ranks[0]["step1"]["policy_loss"] == pytest.approx(before.item(), abs=METRIC_ATOL)
    assert after < before - 1e-3


@pytest.mark.distributed
def test_reported_clip_fractions_and_kl_match_recomputation(training_run):
    batch, log_probs, ranks, rows = training_run
    expected = _clip_and_kl(log_probs, batch)
    assert expected["clip_frac_upper"] > 0 and expected["clip_frac_lower"] > 0
    for rank in ranks:
        for key, value in expected.items():
            assert rank["step1"][key] == pytest.approx(value, abs=METRIC_ATOL), key
    # train_step's own old log-probs are those of the weights it starts from (``after``): ratio 1.
    own_old = batch.replace(old_log_probs=rows["after"])
    for rank in ranks:
        assert rank["step2"]["approx_kl"] == pytest.approx(
            _clip_and_kl(rows["after"], own_old)["approx_kl"], abs=METRIC_ATOL
        )
        assert rank["step2"]["policy_loss"] == pytest.approx(
            _ppo_token_mean_loss(rows["after"], own_old).item(), abs=METRIC_ATOL
        )


@pytest.mark.distributed
def test_kl_to_reference_uses_the_initial_weights(training_run):
    batch, log_probs, ranks, rows = training_run
    mask = batch.response_mask
    torch.testing.assert_close(rows["ref_after_training"][mask], log_probs[mask], atol=1e-5, rtol=0)
    assert torch.equal(rows["after_ref_swap"], rows["after"])
    assert ranks[0]["step1"]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    diff = (log_probs - rows["after"])[mask]
    expected_k3 = (torch.exp(diff) - diff - 1).mean().item()
    assert expected_k3 > 1e-4
    assert ranks[0]["step2"]["kl_ref"] == pytest.approx(expected_k3, rel=1e-4)


@pytest.mark.distributed
def test_offload_reload_round_trip_is_bit_identical(training_run):
    _, _, ranks, _ = training_run
    for rank in ranks:
        assert rank["params_kept"] and rank["moments_left"] == 0
        assert rank["freed_bytes_left"] == 0
        assert rank["identical_after_reload"]
        assert torch.isfinite(torch.tensor(rank["step3"]["loss"]))
