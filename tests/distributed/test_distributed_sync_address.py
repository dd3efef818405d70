"""The distributed transport hosts its broadcast group at the address it is given: what a live engine joins.

A real reference engine serves on this node's IP (as an engine host starts it); the trainer side
is this process. The address is read from the engine's own log of the request it received.
"""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from megatron_rl.config.schema import WeightSyncConfig
from megatron_rl.engines import ReferenceEngine
from megatron_rl.weight_sync.syncer import build_syncer, build_transport
from tests.distributed_utils import free_port
from tests.tiny_checkpoints import save_tiny_moe

DISTRIBUTED = WeightSyncConfig(transport="distributed", bucket_size_mb=1)


@pytest.mark.distributed
def test_engine_joins_the_group_at_the_node_ip_it_was_given(tmp_path):
    node_ip = ray.util.get_node_ip_address()
    hf_dir = save_tiny_moe(tmp_path / "moe")
    engine = ReferenceEngine("ref", hf_dir, free_port(), log_dir=tmp_path, host=node_ip, load_format="dummy")
    engine.start()
    syncer = build_syncer(DISTRIBUTED, "disaggregated", [engine], engine_world_sizes=[1], master_address=node_ip)
    try:
        engine.wait_healthy(120)
        named = sorted(load_file(hf_dir / "model.safetensors").items())
        syncer.sync(named, "step-2")
        for name, tensor in named:
            assert torch.equal(torch.tensor(engine.weights_by_name(name)), tensor), name
    finally:
        syncer.close()
        engine.shutdown()
    log = (tmp_path / "ref.log").read_text()
    assert f"joining weight update group 'megatron_rl_weights_rank0' at {node_ip}:" in log
    assert "as rank 1 of 2 (gloo)" in log


def test_distributed_transport_without_an_address_is_refused():
    with pytest.raises(ValueError, match="transport=distributed needs master_address: the sending rank's node IP"):
        build_transport(DISTRIBUTED, "disaggregated", [])
