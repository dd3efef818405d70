"""Megatron (TP2 x PP2 x EP2, 8 forked gloo ranks) -> reference engines, by the tensor and distributed transports.

Three reference engines start with random (``dummy``) weights. The 8 ranks load
the tiny Qwen3-MoE checkpoint, sync it into engine ``tensor`` with the tensor
transport and into engines ``dist0``/``dist1`` (rank offsets 1 and 2) with the
distributed transport (gloo), each with a 4 KiB bucket so that every rank
sends several buckets. Then:

- the designated export (each TP group gathering to its rank 0, other data-parallel
  replicas skipping the gather) yields every checkpoint tensor exactly once, bit for bit;
- every engine weight equals the exported tensor bit for bit (fp32 values
  read back through ``/get_weights_by_name``);
- generation results carry the synced weight version;
- each engine samples responses (temperature 0.7, 2 samples per prompt) and the
  Megatron model recomputes their log-probs at that temperature (``forward_logits``
  + ``vocab_parallel_logprobs_entropy``); the mismatch measured by
  ``algorithms.importance_correction`` is below 1e-5 (observed <= 1.7e-6, fp32).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_rl.algorithms import importance_correction
from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.engines import GenerateRequest, ReferenceEngine, SamplingParams
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.forward import forward_logits
from megatron_rl.models.weight_transfer import export_hf_weights, load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import DistributedTransport, TensorTransport
from tests.distributed_utils import free_port, run_distributed
from tests.tiny_checkpoints import VOCAB, save_tiny_moe

SIZES = ParallelSizes(tp=2, pp=2, ep=2, etp=1)
WORLD = 8
PROMPTS = ([5, 17, 42], [7, 7, 1, 99], [3])
MAX_NEW = 6
TEMPERATURE = 0.7
SEQ = 12  # >= longest prompt + MAX_NEW, a multiple of TP
ATOL = 1e-5
BUCKET_BYTES = 4096


def _generate(engine: ReferenceEngine, seed: int) -> list[tuple[list[int], list[int], list[float], str | None]]:
    samples = []
    for prompt in PROMPTS:
        params = SamplingParams(
            max_new_tokens=MAX_NEW, temperature=TEMPERATURE, n=2, sampling_seed=seed, ignore_eos=True
        )
        for result in engine.generate(GenerateRequest(list(prompt), params, return_routed_experts=True)):
            assert result.routed_experts is not None
            assert result.routed_experts.shape == (len(prompt) + len(result.output_ids) - 1, 4, 2)
            samples.append((list(prompt), result.output_ids, result.output_logprobs, result.weight_version))
    return samples


def _megatron_logprobs(chunks, samples) -> torch.Tensor | None:
    """[B, MAX_NEW] log-probs of each sample's output tokens (last pipeline stage; None elsewhere)."""
    from megatron.core import parallel_state

    input_ids = torch.zeros(len(samples), SEQ, dtype=torch.long)
    for row, (prompt, output, _, _) in enumerate(samples):
        input_ids[row, : len(prompt) + len(output)] = torch.tensor(prompt + output)
    outputs = forward_logits(chunks, [input_ids])
    if not outputs:
        return None
    group = parallel_state.get_tensor_model_parallel_group()
    logp, _ = vocab_parallel_logprobs_entropy(
        outputs[0][:, :-1], input_ids[:, 1:], vocab_size=VOCAB, group=group, temperature=TEMPERATURE
    )
    picked = torch.zeros(len(samples), MAX_NEW)
    for row, (prompt, output, _, _) in enumerate(samples):
        picked[row, : len(output)] = logp[row, len(prompt) - 1 : len(prompt) - 1 + len(output)]
    return picked


def _sync_rank(rank: int, world_size: int, hf_dir, engines: dict[str, ReferenceEngine]) -> dict:
    initialize_parallel(SIZES)
    arch, _, chunks = build_qwen_model(load_hf_config(hf_dir), SIZES, params_dtype=torch.float32)
    load_hf_weights(chunks, arch, hf_dir)
    tensor_syncer = WeightSyncer([engines["tensor"]], TensorTransport([engines["tensor"]]), bucket_bytes=BUCKET_BYTES)
    dist_engines = [engines["dist0"], engines["dist1"]]
    dist_syncer = WeightSyncer(dist_engines, DistributedTransport(dist_engines), bucket_bytes=BUCKET_BYTES)
    stats = [tensor_syncer.sync_megatron(chunks, arch, "step-1"), dist_syncer.sync_megatron(chunks, arch, "step-2")]
    dist_syncer.close()
    exported = dict(export_hf_weights(chunks, arch, designated_only=True))
    samples = {}
    for name, seed in (("tensor", 11), ("dist0", 12)):
        generated = _generate(engines[name], seed) if rank == 0 else None
        holder = [generated]
        dist.broadcast_object_list(holder, src=0)
        samples[name] = (holder[0], _megatron_logprobs(chunks, holder[0]))
    destroy_parallel()
    return {"exported": exported, "samples": samples, "bytes": sum(s.num_bytes for s in stats)}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp("hf") / "moe")


@pytest.mark.distributed
def test_sync_tp2_pp2_ep2_is_bit_exact_and_logprobs_match(hf_dir, tmp_path, record_property):
    engines = {
        name: ReferenceEngine(
            name, hf_dir, free_port(), log_dir=tmp_path, load_format="dummy", seed=i, routed_experts_shape=(4, 2)
        )
        for i, name in enumerate(("tensor", "dist0", "dist1"))
    }
    try:
        for engine in engines.values():
            engine.start()
        for engine in engines.values():
            engine.wait_healthy(120)
        per_rank = run_distributed(_sync_rank, WORLD, hf_dir, engines)

        exported: dict[str, torch.Tensor] = {}
        for result in per_rank:
            assert not set(exported) & set(result["exported"]), "a tensor was exported by two ranks"
            exported.update(result["exported"])
        checkpoint = {name: t for path in sorted(hf_dir.glob("*.safetensors")) for name, t in load_file(path).items()}
        assert sorted(exported) == sorted(checkpoint)
        assert all(torch.equal(exported[name], tensor) for name, tensor in checkpoint.items())
        assert sum(r["bytes"] for r in per_rank) == 2 * sum(t.numel() * 4 for t in exported.values())
        for name, engine in engines.items():
            differing = [n for n, t in exported.items() if not torch.equal(torch.tensor(engine.weights_by_name(n)), t)]
            assert not differing, f"engine {name}: weights differ from the export: {differing[:5]}"

        last_stage = [r["samples"] for r in per_rank if r["samples"]["tensor"][1] is not None]
        assert len(last_stage) == 4  # pp rank 1 x (tp 2 x dp 2)
        for name, version in (("tensor", "step-1"), ("dist0", "step-2")):
            samples, megatron_logp = last_stage[0][name]
            assert {s[3] for s in samples} == {version}
            engine_logp = torch.zeros_like(megatron_logp)
            mask = torch.zeros_like(megatron_logp)
            for row, (_, output, logprobs, _) in enumerate(samples):
                engine_logp[row, : len(output)] = torch.tensor(logprobs)
                mask[row, : len(output)] = 1
            _, metrics = importance_correction(megatron_logp, engine_logp, mask, cap=None)
            record_property(f"{name}_mismatch_abs_max", metrics["mismatch_abs_max"].item())
            record_property(f"{name}_mismatch_kl", metrics["mismatch_kl"].item())
            print(f"{name}: " + ", ".join(f"{k}={v.item():.3e}" for k, v in metrics.items()))
            assert metrics["mismatch_abs_max"].item() < ATOL
    finally:
        for engine in engines.values():
            engine.shutdown()
