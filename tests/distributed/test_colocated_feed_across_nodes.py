"""The per-GPU colocated weight sync into an engine whose processes sit on two nodes.

SGLang gives node k of an engine spanning nodes the TP ranks ``tp/nnodes*k ..``, and each TP rank takes entry
``tp_rank`` of ``/update_weights_from_tensor``'s payloads, whichever node the request reached. Here a reference
engine of two node processes (SGLang's launch contract: ``--nnodes 2 --node-rank k --dist-init-addr``), each one
TP rank, is fed by two gloo trainer ranks through the real ``WeightSyncer`` and ``TensorTransport``: trainer rank
k feeds node k's rank, rank 0 gathers both payloads and posts each bucket to node 0, which hands it to node 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.engines import EngineError, ReferenceEngine
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import UpdateWeightsFromTensorRequest
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.weight_transfer import load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.parallel.local_launch import free_port
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import TensorTransport
from megatron_rl.wire.tensor_serialization import serialize_named_tensors
from tests.distributed_utils import run_distributed
from tests.tiny_checkpoints import save_tiny_moe

PROBED = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.2.mlp.experts.3.up_proj.weight",
)


def _feed_rank(rank: int, world_size: int, hf_dir: Path, port: int) -> None:
    initialize_parallel(ParallelSizes())
    arch, _, chunks = build_qwen_model(load_hf_config(hf_dir), ParallelSizes(), params_dtype=torch.float32)
    load_hf_weights(chunks, arch, hf_dir)
    engines = [HttpEngine("two-nodes", "127.0.0.1", port)]
    syncer = WeightSyncer(engines, TensorTransport(engines, [2]), bucket_bytes=4096, flush_cache=False)
    try:
        syncer.sync_megatron(chunks, arch, "v1")
    finally:
        syncer.close()
        destroy_parallel()


def _weights(engine: HttpEngine) -> dict[str, torch.Tensor]:
    """The probed weights as node 0 reads them on every node (it answers 500 when the nodes disagree)."""
    return {
        name: torch.tensor(engine.request("/get_weights_by_name", {"name": name, "truncate_size": 64}))
        for name in PROBED
    }


def _changed_copy(source: Path, target: Path) -> Path:
    """``source``'s checkpoint with every weight moved: what the trainer syncs into the engine."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(target)
    return target


@pytest.fixture
def two_node_engine(tmp_path):
    start, target = save_tiny_moe(tmp_path / "start"), _changed_copy(tmp_path / "start", tmp_path / "target")
    port, address = free_port(), f"127.0.0.1:{free_port()}"
    nodes = [
        ReferenceEngine(
            f"node{rank}",
            start,
            port if rank == 0 else free_port(),
            log_dir=tmp_path,
            nnodes=2,
            node_rank=rank,
            dist_init_addr=address,
        )
        for rank in (1, 0)
    ]
    for node in nodes:
        node.start()
    nodes[1].wait_healthy(120.0)
    try:
        yield nodes[1], start, target
    finally:
        for node in nodes:
            node.shutdown()


@pytest.mark.distributed
def test_each_node_loads_the_payload_of_its_own_trainer_rank(two_node_engine):
    engine, start, target = two_node_engine
    embedding = load_file(start / "model.safetensors")[PROBED[0]]
    assert torch.equal(_weights(engine)[PROBED[0]], embedding[:64])
    # Node 1 does not take payload 0: with payloads +1 and +2 the nodes disagree; with +2 twice both hold +2.
    for shifts in ((1.0, 2.0), (2.0, 2.0)):
        payloads = [serialize_named_tensors([(PROBED[0], embedding + shift)]) for shift in shifts]
        engine.begin_weight_update()
        engine.update_weights_from_tensor(UpdateWeightsFromTensorRequest(payloads, flush_cache=False))
        engine.end_weight_update()
        if shifts[0] != shifts[1]:
            with pytest.raises(EngineError):
                _weights(engine)
    assert torch.equal(_weights(engine)[PROBED[0]], embedding[:64] + 2.0)
    run_distributed(_feed_rank, 2, target, engine.port)
    expected = load_file(target / "model.safetensors")
    for name, tensor in _weights(engine).items():
        assert torch.equal(tensor, expected[name][: tensor.shape[0]]), name
