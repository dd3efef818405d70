"""Several sending ranks x several engines by broadcast: the send lock keeps them from deadlocking.

Two trainer ranks (forked gloo ranks) each own a broadcast group with both of two
reference engines, and each sends its own half of a tiny Qwen3-MoE's tensors in
4 KiB buckets (dozens of rounds). The reference engine serves one weight request
at a time and blocks in it until the sending rank's group takes part, as
SGLang's scheduler does; without one lock across the sending ranks, the two
engines take the two ranks' requests in opposite orders in some round and each
waits for the other (the old transport hung there until its 60 s group timeout).
With the lock every engine ends up holding every tensor bit for bit, in three
consecutive syncs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_rl.engines import ReferenceEngine
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import DistributedTransport
from tests.distributed_utils import free_port, run_distributed
from tests.tiny_checkpoints import save_tiny_moe

BUCKET_BYTES = 4096
SYNCS = 3
GROUP_TIMEOUT_S = 60.0


def _send_half(rank: int, world_size: int, hf_dir, engines: list[ReferenceEngine], flatten: bool) -> int:
    dist.init_process_group("gloo")
    named = sorted(load_file(hf_dir / "model.safetensors").items())
    share = [(name, tensor * (1 + sync)) for sync in range(SYNCS) for name, tensor in named[rank::world_size]]
    transport = DistributedTransport(engines, timeout_s=GROUP_TIMEOUT_S, flatten=flatten)
    syncer = WeightSyncer(engines, transport, bucket_bytes=BUCKET_BYTES)
    per_sync = len(share) // SYNCS
    buckets = 0
    for sync in range(SYNCS):
        buckets += syncer.sync(share[sync * per_sync : (sync + 1) * per_sync], f"step-{sync}").num_buckets
    syncer.close()
    dist.destroy_process_group()
    return buckets


@pytest.mark.distributed
@pytest.mark.parametrize("flatten", [False, True], ids=["per-tensor", "flattened"])
def test_two_senders_into_two_engines_do_not_deadlock(tmp_path, flatten):
    hf_dir = save_tiny_moe(tmp_path / "moe")
    engines = [
        ReferenceEngine(f"e{i}", hf_dir, free_port(), log_dir=tmp_path, load_format="dummy", seed=i) for i in range(2)
    ]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy(120)
        buckets = run_distributed(_send_half, 2, hf_dir, engines, flatten)
        assert min(buckets) >= 10 * SYNCS, buckets  # enough rounds for crossed orders to occur without the lock
        named = load_file(hf_dir / "model.safetensors")
        for engine in engines:
            differing = [
                name
                for name, tensor in named.items()
                if not torch.equal(torch.tensor(engine.weights_by_name(name)), tensor * SYNCS)
            ]
            assert not differing, f"{engine.name}: {differing[:5]}"
    finally:
        for engine in engines:
            engine.shutdown()
