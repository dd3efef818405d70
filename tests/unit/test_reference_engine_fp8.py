"""The reference engine serving FP8 weights, as SGLang started from an FP8 checkpoint: it keeps each projection's
FP8 weight and scales and computes with their product; FP8 syncs through each transport (tensor, distributed,
disk) leave it holding exactly the blockwise quantisation of what the trainer exported; a bf16 sync is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.checkpoint.fp8_convert import convert_hf_to_fp8
from megatron_rl.engines.engine import EngineRequestError
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.engine import ReferenceEngine
from megatron_rl.engines.reference.server import fp8_block_of, load_model
from megatron_rl.engines.reference.weights import resolve_weight
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import DiskTransport, DistributedTransport, TensorTransport
from megatron_rl.wire.fp8_blocks import dequantize_blocks, is_quantized, quantize_blocks
from tests.reference_servers import reference_process, serving
from tests.tiny_checkpoints import save_tiny_moe

BLOCK = (16, 16)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    return convert_hf_to_fp8(save_tiny_moe(root / "bf16", all_sparse=True), root / "fp8", BLOCK)


@pytest.fixture
def served(fp8_dir) -> Iterator[tuple[HttpEngine, ReferenceBackend]]:
    """The engine as the reference server's ``main`` starts it on an FP8 checkpoint."""
    block = fp8_block_of(str(fp8_dir))
    backend = ReferenceBackend(load_model(str(fp8_dir), "auto", torch.float32, "cpu"), fp8_block=block)
    backend.update_from_disk(str(fp8_dir), version=None)
    with serving(backend, "fp8") as engine:
        yield engine, backend


def _assert_serves(backend: ReferenceBackend, named: dict[str, torch.Tensor]) -> None:
    """The engine holds ``named`` as an FP8 checkpoint would, bit for bit, and computes with the dequantised
    projections and the rest as sent."""
    assert backend.fp8 is not None
    for name, tensor in named.items():
        if is_quantized(name):
            quantized, scales = quantize_blocks(tensor, BLOCK)
            assert torch.equal(backend.fp8.weights[name].view(torch.uint8), quantized.view(torch.uint8)), name
            assert torch.equal(backend.fp8.scales[name], scales), name
            assert torch.equal(
                resolve_weight(backend.params, name), dequantize_blocks(quantized, scales, BLOCK, torch.float32)
            )
        else:
            assert torch.equal(resolve_weight(backend.params, name), tensor.float()), name


def _trained(fp8_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """bf16 weights as a trainer would export them after a step: the checkpoint's, moved."""
    generator = torch.Generator().manual_seed(step)
    bf16 = {name: t for name, t in load_file(fp8_dir.parent / "bf16" / "model.safetensors").items()}
    return {
        name: (t.float() + 0.01 * torch.randn(t.shape, generator=generator)).to(torch.bfloat16)
        for name, t in bf16.items()
    }


def test_the_engine_starts_from_the_fp8_checkpoint_and_generates(served, fp8_dir):
    engine, backend = served
    _assert_serves(backend, load_file(fp8_dir.parent / "bf16" / "model.safetensors"))
    checkpoint = load_file(fp8_dir / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    assert engine.request("/get_weights_by_name", {"name": name, "truncate_size": 1}) == [checkpoint[name][0].tolist()]
    (result,) = engine.generate(GenerateRequest([5, 17, 42], SamplingParams(max_new_tokens=4, temperature=0.0)))
    assert len(result.output_ids) == 4


@pytest.fixture(scope="module")
def server_process(fp8_dir, tmp_path_factory) -> Iterator[ReferenceEngine]:
    """The reference server started on the FP8 checkpoint as a run starts it (its own process)."""
    with reference_process(fp8_dir, tmp_path_factory.mktemp("logs")) as engine:
        yield engine


@pytest.mark.parametrize("transport", ["tensor", "distributed", "disk"])
def test_fp8_syncs_leave_the_engine_holding_the_blockwise_quantisation_of_the_export(
    server_process, fp8_dir, tmp_path, transport
):
    engine = server_process
    senders = {
        "tensor": lambda: TensorTransport([engine]),
        "distributed": lambda: DistributedTransport([engine]),  # gloo: FP8 crosses as its bytes
        "disk": lambda: DiskTransport([engine], tmp_path / "sync", fp8_dir),
    }
    syncer = WeightSyncer([engine], senders[transport](), bucket_bytes=4096, fp8_block=BLOCK)  # pairs may part
    for step in (1, 2):
        trained = _trained(fp8_dir, step)
        stats = syncer.sync(trained.items(), f"{transport}-{step}")
        assert stats.num_buckets > 1
        for name, tensor in trained.items():
            if is_quantized(name):  # the FP8 weight (exact as fp32) and its scales, as the engine holds them
                quantized, scales = quantize_blocks(tensor, BLOCK)
                assert engine.weights_by_name(name) == quantized.float().tolist(), name
                assert engine.weights_by_name(f"{name}_scale_inv") == scales.tolist(), name
            else:
                assert engine.weights_by_name(name) == tensor.float().tolist(), name
    syncer.close()


def test_a_bf16_sync_into_an_fp8_engine_is_refused_naming_the_setting(served, fp8_dir):
    engine, backend = served
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=1 << 20)
    before = {name: p.clone() for name, p in backend.params.items()}
    with pytest.raises(EngineRequestError, match="serves FP8 weights"):
        syncer.sync(_trained(fp8_dir, 1).items(), "bf16")
    syncer.close()
    assert all(torch.equal(before[name], p) for name, p in backend.params.items())
