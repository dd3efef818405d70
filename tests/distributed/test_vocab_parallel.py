"""Vocabulary-parallel log-probs and entropy equal the full-softmax reference."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
from tests.distributed_utils import run_distributed

VOCAB, PADDED, TOKENS = 13, 16, 7
TEMPERATURES = [1.0, 0.7]


def _reference(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, TOKENS, PADDED, generator=generator) * 4
    targets = torch.randint(0, VOCAB, (2, TOKENS), generator=generator)
    weights = torch.randn(2, TOKENS, generator=generator)
    return logits, targets, weights, torch.randn(2, TOKENS, generator=generator)


def _loss(logp: torch.Tensor, entropy: torch.Tensor, w_logp: torch.Tensor, w_ent: torch.Tensor) -> torch.Tensor:
    return (logp * w_logp).sum() + (entropy * w_ent).sum()


def _sharded_rank(
    rank: int, world_size: int, temperature: float, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dist.init_process_group("gloo")
    logits, targets, w_logp, w_ent = _inputs()
    local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs_entropy(
        local, targets, vocab_size=VOCAB, group=dist.group.WORLD, temperature=temperature, chunk_tokens=chunk_tokens
    )
    _loss(logp, entropy, w_logp, w_ent).backward()
    dist.destroy_process_group()
    assert local.grad is not None
    return logp.detach(), entropy.detach(), local.grad


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_unsharded_logprobs_entropy_and_grads_match_full_softmax_ignoring_padding(temperature):
    logits, targets, w_logp, w_ent = _inputs()
    ours_in = logits.clone().requires_grad_(True)
    ref_in = logits[..., :VOCAB].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs_entropy(ours_in, targets, vocab_size=VOCAB, temperature=temperature)
    ref_logp, ref_entropy = _reference(ref_in, targets, temperature)
    _loss(logp, entropy, w_logp, w_ent).backward()
    _loss(ref_logp, ref_entropy, w_logp, w_ent).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)
    assert ours_in.grad is not None
    torch.testing.assert_close(ours_in.grad[..., :VOCAB], ref_in.grad, rtol=0, atol=1e-5)
    assert torch.all(ours_in.grad[..., VOCAB:] == 0)


@settings(max_examples=30, deadline=None)
@given(
    vocab=st.integers(2, 40),
    padding=st.integers(0, 7),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_logprobs_and_entropy_are_finite_and_exact_for_any_logit_scale(vocab, padding, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, vocab + padding, generator=generator, dtype=torch.float64).float() * scale
    targets = torch.randint(0, vocab, (3,), generator=generator)
    logp, entropy = vocab_parallel_logprobs_entropy(logits, targets, vocab_size=vocab)
    ref_logp, ref_entropy = _reference(logits[:, :vocab].double(), targets)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5 * max(1.0, scale))
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 5, 13])
def test_chunked_values_and_gradients_equal_the_unchunked_ones(chunk_tokens):
    """The same per-token arithmetic in chunks (each checkpointed and recomputed in backward): bitwise equal."""
    logits, targets, w_logp, w_ent = _inputs()
    results = []
    for chunk in (0, chunk_tokens):
        given = (logits.to(torch.bfloat16) if chunk_tokens == 13 else logits).clone().requires_grad_(True)
        logp, entropy = vocab_parallel_logprobs_entropy(
            given, targets, vocab_size=VOCAB, temperature=0.7, chunk_tokens=chunk
        )
        _loss(logp, entropy, w_logp, w_ent).backward()
        results.append((logp.detach(), entropy.detach(), given.grad))
    for unchunked, chunked in zip(*results, strict=True):
        assert torch.equal(unchunked, chunked)


_PEAK_SCRIPT = """
import resource, sys, torch
from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
logits = torch.randn(16384, 2048)
targets = torch.randint(0, 2048, (16384,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():
    vocab_parallel_logprobs_entropy(logits, targets, chunk_tokens=int(sys.argv[1]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_chunks_bound_the_working_set():
    """Peak RSS growth of one forward over 16384 tokens x 2048 columns (128 MiB of fp32 logits).

    Unchunked, the function holds about 21 bytes per element at its peak (about 0.7 GB here);
    in chunks of 1024 tokens, 1/16 of that (measured: 551 vs 42 MiB). glibc is told to map every
    allocation above 64 KiB on its own, so a freed chunk's memory leaves the RSS at once. A factor 4
    leaves room for the allocator.
    """
    growth = {}
    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536"}
    for chunk in (0, 1024):
        result = subprocess.run(
            [sys.executable, "-c", _PEAK_SCRIPT, str(chunk)], capture_output=True, text=True, check=True, env=env
        )
        growth[chunk] = int(result.stdout.split()[-1])
    assert growth[1024] * 4 < growth[0], growth


def test_temperature_leaves_the_callers_logits_untouched_in_every_dtype():
    logits, targets, _, _ = _inputs()
    for dtype in (torch.float32, torch.bfloat16):
        given = logits.to(dtype).requires_grad_(True)
        before, version = given.detach().clone(), given._version
        logp, entropy = vocab_parallel_logprobs_entropy(given, targets, vocab_size=VOCAB, temperature=0.5)
        (logp.sum() + entropy.sum()).backward()
        assert given._version == version and torch.equal(given.detach(), before), dtype
        ref_logp, _ = _reference(given.detach().float()[..., :VOCAB], targets, 0.5)
        torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size, temperature, chunk_tokens", [(2, 1.0, 0), (4, 1.0, 0), (2, 0.7, 0), (2, 0.7, 3)])
def test_tensor_parallel_logprobs_entropy_and_grads_match_full_softmax(world_size, temperature, chunk_tokens):
    logits, targets, w_logp, w_ent = _inputs()
    ref_in = logits[..., :VOCAB].clone().requires_grad_(True)
    ref_logp, ref_entropy = _reference(ref_in, targets, temperature)
    _loss(ref_logp, ref_entropy, w_logp, w_ent).backward()
    assert ref_in.grad is not None
    ref_grad = torch.cat([ref_in.grad, torch.zeros(2, TOKENS, PADDED - VOCAB)], dim=-1)
    results = run_distributed(_sharded_rank, world_size, temperature, chunk_tokens)
    for rank, (logp, entropy, grad) in enumerate(results):
        torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)
        torch.testing.assert_close(grad, ref_grad.chunk(world_size, dim=-1)[rank], rtol=0, atol=1e-5)
