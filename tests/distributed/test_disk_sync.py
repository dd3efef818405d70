"""Disk transport and memory release against a real reference engine (single trainer process, no Megatron)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.engines import EngineRequestError, GenerateRequest, ReferenceEngine, SamplingParams
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import DiskTransport
from tests.distributed_utils import free_port
from tests.tiny_checkpoints import save_tiny_moe


@pytest.mark.distributed
def test_release_refuses_generation_until_a_disk_sync_restores_the_weights(tmp_path):
    hf_dir = save_tiny_moe(tmp_path / "moe")
    engine = ReferenceEngine("ref", hf_dir, free_port(), log_dir=tmp_path, load_format="dummy")
    engine.start()
    try:
        engine.wait_healthy(120)
        engine.release_memory(["weights", "kv_cache"])
        with pytest.raises(EngineRequestError, match="weights are released"):
            engine.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2)))
        engine.resume_memory(["weights", "kv_cache"])

        named = sorted(load_file(hf_dir / "model.safetensors").items())
        syncer = WeightSyncer([engine], DiskTransport([engine], tmp_path / "sync", hf_dir), bucket_bytes=16 << 10)
        stats = syncer.sync(named, "step-7")
        assert stats.num_buckets > 1 and stats.num_tensors == len(named)
        for name, tensor in named:
            assert torch.equal(torch.tensor(engine.weights_by_name(name)), tensor), name
        result = engine.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2)))[0]
        assert result.weight_version == "step-7"
    finally:
        engine.shutdown()
