"""The actor computes everything at the rollout's sampling temperature T (here 0.7), as the engine does.

At TP1 (whole vocabulary) and TP2 (vocab-parallel, padded vocabulary), with
the 2-layer Qwen3-MoE checkpoint of ``tests.actor_setup``:

- old and reference log-probs and entropies equal those of
  log_softmax(logits / T) of transformers on the same weights;
- the reference engine's log-probs of its own samples at T (its backend,
  ``ReferenceBackend``, in this process) equal the actor's log-probs of
  the same tokens: the rollout/train mismatch is fp32 noise;
- the gradient of the training loss (PPO clip, token-mean, entropy bonus) is
  that of the tempered distribution: Megatron's ``main_grad`` after one
  training step (``train_step``, its old log-probs its own, so the ratio is 1)
  equals ``backward()`` of the same loss written out in plain torch on the
  transformers model.

Each check also asserts that temperature 1 would fail it, so that it can tell.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.train_step import train_step
from megatron_rl.engines import GenerateRequest, SamplingParams
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.server import load_model
from megatron_rl.models.weight_transfer import export_hf_tensors
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from tests.actor_setup import (
    algorithm_config,
    batch_rows,
    fixed_batch,
    rank_shard,
    save_tiny_moe_2layer,
    tiny_actor,
    transformers_log_probs,
)
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import checkpoint_named_grads

TEMPERATURE = 0.7
CLIP_LOW, CLIP_HIGH, ENTROPY_COEF = 0.2, 0.28, 0.01
ATOL, GRAD_RTOL = 1e-5, 1e-5
PROMPTS = ([5, 17, 42], [7, 7, 1, 99], [3, 8])
MAX_NEW = 6
LAYOUTS = {"tp1": (ParallelSizes(), 1), "tp2": (ParallelSizes(tp=2), 2)}


def _engine_samples(hf_dir: Path) -> ActorBatch:
    """Two samples per prompt from the reference engine's backend at TEMPERATURE, with its log-probs.

    ``rollout_log_probs`` holds the engine's log-prob of each response token at
    that token's position; ``response_mask`` marks the response tokens.
    """
    backend = ReferenceBackend(load_model(str(hf_dir), "auto", torch.float32, "cpu"))
    rows = []
    for seed, prompt in enumerate(PROMPTS):
        params = SamplingParams(
            max_new_tokens=MAX_NEW, temperature=TEMPERATURE, n=2, sampling_seed=seed, ignore_eos=True
        )
        answers = backend.generate(GenerateRequest(list(prompt), params))
        assert isinstance(answers, list)  # n=2: one answer per sample
        for answer in answers:
            logprobs = [logprob for logprob, _, _ in answer["meta_info"]["output_token_logprobs"]]
            rows.append((list(prompt), answer["output_ids"], logprobs))
    seq_length = max(len(prompt) + len(output) for prompt, output, _ in rows)
    input_ids = torch.zeros(len(rows), seq_length, dtype=torch.long)
    response_mask = torch.zeros(len(rows), seq_length, dtype=torch.bool)
    rollout_log_probs = torch.zeros(len(rows), seq_length)
    for row, (prompt, output, logprobs) in enumerate(rows):
        start, end = len(prompt), len(prompt) + len(output)
        input_ids[row, :end] = torch.tensor(prompt + output)
        response_mask[row, start:end] = True
        rollout_log_probs[row, start:end] = torch.tensor(logprobs)
    lengths = torch.tensor([len(prompt) + len(output) for prompt, output, _ in rows])
    return ActorBatch(input_ids, lengths, response_mask, rollout_log_probs=rollout_log_probs)


def _actor_rank(rank, world_size, sizes, hf_dir, fixed, sampled):
    initialize_parallel(sizes)
    actor = tiny_actor(
        hf_dir,
        sizes,
        algorithm=algorithm_config(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, entropy_coef=ENTROPY_COEF),
        temperature=TEMPERATURE,
        keep_reference=True,
    )
    shard, sampled_shard = rank_shard(fixed), rank_shard(sampled)
    policy = actor.log_probs(shard)
    result: dict[str, object] = {
        "log_probs": batch_rows([(shard.sample_ids, policy.log_probs)], fixed),
        "entropy": batch_rows([(shard.sample_ids, policy.entropy)], fixed),
        "ref": batch_rows([(shard.sample_ids, actor.log_probs(shard, reference=True).log_probs)], fixed),
        "sampled": batch_rows([(sampled_shard.sample_ids, actor.log_probs(sampled_shard).log_probs)], sampled),
    }
    train_step(actor, shard)
    result["grads"] = {
        # main_grad: the gradient buffer Megatron's DDP adds to each parameter (torch's Parameter does not declare it)
        name: g.clone()
        for name, g in export_hf_tensors(actor.chunks, actor.arch, lambda p: p.main_grad)  # type: ignore[attr-defined]
    }
    destroy_parallel()
    return result


def _transformers_loss_grads(hf_dir: Path, batch: ActorBatch, temperature: float) -> dict[str, torch.Tensor]:
    """Gradient of the actor's loss on ``batch`` under softmax(logits / temperature), written out in plain torch.

    The old log-probs are the model's own (detached), as ``train_step`` computes them.
    """
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    log_softmax = torch.log_softmax(model(batch.input_ids).logits[:, :-1] / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    mask = batch.response_mask[:, 1:]
    ratio = torch.exp(log_probs - log_probs.detach())
    assert batch.advantages is not None, "the batch carries its advantages"
    advantages = batch.advantages.unsqueeze(1)
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
    (per_token[mask].mean() - ENTROPY_COEF * entropy[mask].mean()).backward()
    return checkpoint_named_grads(model)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    hf_dir = save_tiny_moe_2layer(tmp_path_factory.mktemp("actor") / "moe")
    return hf_dir, fixed_batch(), _engine_samples(hf_dir)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, setup):
    hf_dir, fixed, sampled = setup
    sizes, world_size = LAYOUTS[request.param]
    return run_distributed(_actor_rank, world_size, sizes, hf_dir, fixed, sampled)


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b)[mask].abs().max().item()


@pytest.mark.distributed
def test_old_and_reference_log_probs_and_entropy_are_the_tempered_distributions(setup, run):
    hf_dir, fixed, _ = setup
    valid = torch.arange(fixed.seq_length) < fixed.lengths.unsqueeze(1)
    valid[:, 0] = False
    expected_log_probs, expected_entropy = transformers_log_probs(hf_dir, fixed, TEMPERATURE)
    untempered_log_probs, untempered_entropy = transformers_log_probs(hf_dir, fixed)
    for rank in run:
        torch.testing.assert_close(rank["log_probs"][valid], expected_log_probs[valid], atol=ATOL, rtol=0)
        torch.testing.assert_close(rank["entropy"][valid], expected_entropy[valid], atol=ATOL, rtol=0)
        torch.testing.assert_close(rank["ref"][valid], expected_log_probs[valid], atol=ATOL, rtol=0)
    assert _max_diff(untempered_log_probs, expected_log_probs, valid) > 100 * ATOL
    assert _max_diff(untempered_entropy, expected_entropy, valid) > 100 * ATOL


@pytest.mark.distributed
def test_engine_log_probs_at_the_temperature_match_the_actor_on_its_samples(setup, run):
    hf_dir, _, sampled = setup
    mask = sampled.response_mask
    for rank in run:
        mismatch = _max_diff(rank["sampled"], sampled.rollout_log_probs, mask)
        print(f"engine vs actor at T={TEMPERATURE}: max |diff| {mismatch:.2e}")
        assert mismatch <= ATOL
    untempered, _ = transformers_log_probs(hf_dir, sampled)
    assert _max_diff(untempered, sampled.rollout_log_probs, mask) > 100 * ATOL


@pytest.mark.distributed
def test_loss_gradient_is_that_of_the_tempered_distribution(setup, run):
    hf_dir, fixed, _ = setup
    expected = _transformers_loss_grads(hf_dir, fixed, TEMPERATURE)
    untempered = _transformers_loss_grads(hf_dir, fixed, 1.0)
    merged: dict[str, torch.Tensor] = {}
    for rank in run:
        merged |= rank["grads"]
    assert merged.keys() == expected.keys()
    for name, want in expected.items():
        error = (merged[name] - want).abs().max() / want.abs().max()
        assert error < GRAD_RTOL, f"{name}: relative gradient error {error:.2e}"
    worst_untempered = max((untempered[n] - w).abs().max() / w.abs().max() for n, w in expected.items())
    assert worst_untempered > 100 * GRAD_RTOL
