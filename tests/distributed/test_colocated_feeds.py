"""Each engine rank is fed by its own trainer rank: 4 gloo ranks (EP2 x DP2), 2 engines of 2 TP ranks each.

Through the real :class:`~megatron_rl.weight_sync.syncer.WeightSyncer` and
:class:`~megatron_rl.weight_sync.transports.TensorTransport` with a 2 KiB bucket (many buckets):
engine 0's TP ranks are fed by trainer ranks 0 and 1, engine 1's by ranks 2 and 3. Asserted from
what each engine receives (a recording engine that opens every payload as an engine rank would):
each request holds one payload per TP rank, entry ``t``'s memory belongs to the process of trainer
rank ``e*2+t`` alone (torch names a shared-memory file after its creating process), every entry
holds the whole checkpoint bit for bit over the sync, only the feeders of TP rank 0 post, and a
bucket that fails to load fails the sync on both of the engine's feeders. With engines of EP 2, entry
``t`` holds the dense tensors and only the experts SGLang's TP rank ``t`` loads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.engines.protocol import UpdateWeightsFromTensorRequest
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.weight_map import hf_expert_index
from megatron_rl.models.weight_transfer import load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import TensorTransport
from megatron_rl.wire.tensor_serialization import deserialize_payload, shared_memory_owners
from tests.distributed_utils import run_distributed
from tests.fake_engines import PartialEngine
from tests.tiny_checkpoints import save_tiny_moe

SIZES = ParallelSizes(tp=1, ep=2)
ENGINE_TP = [2, 2]


class EngineRanks(PartialEngine):
    """Opens each TP rank's payload as that rank would and records whose memory it was and what it held."""

    name = "recording"

    def __init__(self, fail_on: int | None = None) -> None:
        self.owners: list[list[set[int]]] = []
        self.received: list[dict[str, torch.Tensor]] = [{} for _ in range(max(ENGINE_TP))]
        self.fail_on = fail_on

    def pause_generation(self, mode: str = "retract") -> None:
        pass

    def begin_weight_update(self) -> None:
        pass

    def end_weight_update(self) -> None:
        pass

    def continue_generation(self) -> None:
        pass

    def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> None:
        if self.fail_on == len(self.owners):
            raise RuntimeError("engine refused the bucket")
        opened = [deserialize_payload(p, request.load_format) for p in request.serialized_named_tensors]
        self.owners.append([shared_memory_owners(named) for named in opened])
        for tp_rank, named in enumerate(opened):
            self.received[tp_rank].update((name, tensor.clone()) for name, tensor in named)


def _sync_rank(rank: int, world_size: int, hf_dir: Path, fail_on: int | None, engine_ep: int = 1) -> dict:
    initialize_parallel(SIZES)
    arch, _, chunks = build_qwen_model(load_hf_config(hf_dir), SIZES, params_dtype=torch.float32)
    load_hf_weights(chunks, arch, hf_dir)
    engines = [EngineRanks(fail_on), EngineRanks(fail_on)]
    transport = TensorTransport(engines, ENGINE_TP, engine_ep_size=engine_ep)
    syncer = WeightSyncer(engines, transport, bucket_bytes=2048, flush_cache=False)
    try:
        syncer.sync_megatron(chunks, arch, "v1")
        error = None
    except Exception as failure:
        error = type(failure).__name__
    finally:
        syncer.close() if fail_on is None else None
        pids: list[int | None] = [None] * world_size
        torch.distributed.all_gather_object(pids, os.getpid())
        destroy_parallel()
    return {"engines": engines, "pids": pids, "error": error}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp("hf") / "moe")


@pytest.mark.distributed
def test_every_engine_rank_gets_the_whole_model_from_the_trainer_rank_on_its_device(hf_dir):
    per_rank = run_distributed(_sync_rank, 4, hf_dir, None)
    pids = per_rank[0]["pids"]
    checkpoint = {name: t for path in sorted(hf_dir.glob("*.safetensors")) for name, t in load_file(path).items()}
    for engine in (0, 1):
        poster = per_rank[2 * engine]["engines"][engine]
        assert poster.owners, f"engine {engine} received nothing"
        assert all(owners == [{pids[2 * engine]}, {pids[2 * engine + 1]}] for owners in poster.owners)
        for tp_rank in (0, 1):
            received = poster.received[tp_rank]
            assert sorted(received) == sorted(checkpoint)
            assert all(torch.equal(received[name], tensor) for name, tensor in checkpoint.items())
    for rank, result in enumerate(per_rank):  # nobody else posted to any engine
        others = [e for i, e in enumerate(result["engines"]) if not (rank % 2 == 0 and i == rank // 2)]
        assert all(not engine.owners for engine in others)


@pytest.mark.distributed
def test_a_bucket_that_fails_to_load_fails_the_sync_on_every_feeder_of_its_engine(hf_dir):
    per_rank = run_distributed(_sync_rank, 4, hf_dir, 1)
    assert [result["error"] for result in per_rank] == ["RuntimeError", "EngineError"] * 2


@pytest.mark.distributed
def test_engine_ranks_with_expert_parallelism_are_fed_only_their_own_experts(hf_dir):
    per_rank = run_distributed(_sync_rank, 4, hf_dir, None, 2)
    checkpoint = {name: t for path in sorted(hf_dir.glob("*.safetensors")) for name, t in load_file(path).items()}
    for engine in (0, 1):
        poster = per_rank[2 * engine]["engines"][engine]
        for tp_rank, share in enumerate((range(0, 2), range(2, 4))):  # 4 experts, EP 2
            received = poster.received[tp_rank]
            expected = [name for name in checkpoint if hf_expert_index(name) in (None, *share)]
            assert sorted(received) == sorted(expected)
            assert all(torch.equal(received[name], checkpoint[name]) for name in expected)
