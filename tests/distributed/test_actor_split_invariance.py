"""One training step gives the same parameters however the batch is split (DESIGN.md section 3).

The same batch is trained one step (``train_step``, each DP rank on its shard, two PPO epochs)
at (DP1, one micro-batch), (DP2 with EP2, three micro-batches per rank), (TP2 x PP2, two
micro-batches), (CP2 x DP2 with EP2, three) and (TP2 x CP2, two), for each loss aggregation mode; the exported Hugging Face weights must agree to
fp32 tolerance. The same runs check the actor's log-probs and entropies against transformers,
and that the step's reported metrics agree across splits.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state

from megatron_rl.actor.train_step import train_step
from megatron_rl.algorithms import LOSS_AGG_MODES
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

PARAM_ATOL = 2e-6
LOGPROB_ATOL = 1e-5
METRIC_ATOL = 1e-6
"""The step's metrics are means of per-token terms of size about 1: summed in another order across
splits, fp32 moves them by some eps (1.2e-7) times that size, however small the mean itself
(a loss of -0.0082 differed by 1.04e-7 between TP2 x PP2 and DP1 on an AMD EPYC)."""
# name: (sizes, world size, token budget per micro-batch, expected micro-batches per rank)
SPLITS = {
    "dp1-mb1": (ParallelSizes(), 1, 256, 1),
    "dp2-ep2-mb3": (ParallelSizes(ep=2), 2, 24, 3),
    "tp2-pp2-mb2": (ParallelSizes(tp=2, pp=2), 4, 60, 2),
    "cp2-dp2-ep2-mb3": (ParallelSizes(cp=2, ep=2), 4, 24, 3),
    "tp2-cp2-mb2": (ParallelSizes(tp=2, cp=2), 4, 60, 2),
}


def _train_rank(rank, world_size, sizes, budget, hf_dir, batch):
    initialize_parallel(sizes)
    shard = rank_shard(batch)
    results: dict[str, object] = {}
    for mode in LOSS_AGG_MODES:
        actor = tiny_actor(
            hf_dir,
            sizes,
            # Two epochs: train_step's old log-probs are its own, so only the second update has the
            # ratio off 1, the clip bounds active and clip fractions to compare across splits.
            train=train_config(max_tokens_per_micro_batch=budget, ppo_epochs=2),
            algorithm=algorithm_config(loss_agg_mode=mode),
        )
        if mode == LOSS_AGG_MODES[0]:
            before = actor.log_probs(shard)  # every rank takes part; the values are on the last stage
            if parallel_state.is_pipeline_last_stage():
                results["before"] = (shard.sample_ids, before)
        metrics = train_step(actor, shard)
        results[mode] = (metrics, dict(actor.export_weights()))
    destroy_parallel()
    return results


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    hf_dir = save_tiny_moe_2layer(tmp_path_factory.mktemp("actor") / "moe")
    batch = fixed_batch()
    runs = {}
    for name, (sizes, world_size, budget, _) in SPLITS.items():
        per_rank = run_distributed(_train_rank, world_size, sizes, budget, hf_dir, batch)
        merged: dict[str, tuple[dict[str, float], dict[str, torch.Tensor]]] = {
            mode: (per_rank[-1][mode][0], {}) for mode in LOSS_AGG_MODES
        }
        for rank_result in per_rank:
            for mode in LOSS_AGG_MODES:
                merged[mode][1].update(rank_result[mode][1])
        before = [rank_result["before"] for rank_result in per_rank if "before" in rank_result]
        runs[name] = {
            "log_probs": batch_rows([(ids, values.log_probs) for ids, values in before], batch),
            "entropy": batch_rows([(ids, values.entropy) for ids, values in before], batch),
            **merged,
        }
    return hf_dir, batch, runs


@pytest.mark.distributed
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_one_step_parameters_agree_across_splits(split_runs, mode):
    _, _, runs = split_runs
    reference_metrics, reference = runs["dp1-mb1"][mode]
    for name, (_, _, _, num_micro_batches) in SPLITS.items():
        metrics, weights = runs[name][mode]
        assert metrics["num_micro_batches"] == num_micro_batches, name
        assert weights.keys() == reference.keys()
        for key, value in reference.items():
            error = (weights[key] - value).abs().max().item()
            assert error <= PARAM_ATOL, f"{name} {key}: max |diff| {error:.2e}"
        for key in ("loss", "policy_loss", "grad_norm", "clip_frac_upper", "clip_frac_lower", "approx_kl", "tokens"):
            assert metrics[key] == pytest.approx(reference_metrics[key], rel=1e-5, abs=METRIC_ATOL), f"{name} {key}"


@pytest.mark.distributed
def test_step_changes_parameters_differently_per_mode(split_runs):
    _, _, runs = split_runs
    weights = {mode: runs["dp1-mb1"][mode][1] for mode in LOSS_AGG_MODES}
    name = "model.embed_tokens.weight"
    for mode in LOSS_AGG_MODES[1:]:
        assert (weights[mode][name] - weights[LOSS_AGG_MODES[0]][name]).abs().max() > 1e-4, mode


@pytest.mark.distributed
@pytest.mark.parametrize("split", list(SPLITS))
def test_actor_log_probs_match_transformers(split_runs, split):
    hf_dir, batch, runs = split_runs
    expected_log_probs, expected_entropy = transformers_log_probs(hf_dir, batch)
    valid = torch.arange(batch.seq_length) < batch.lengths.unsqueeze(1)
    valid[:, 0] = False
    torch.testing.assert_close(runs[split]["log_probs"][valid], expected_log_probs[valid], atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(runs[split]["entropy"][valid], expected_entropy[valid], atol=LOGPROB_ATOL, rtol=0)
