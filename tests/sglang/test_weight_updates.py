"""Weight updates into the real SGLang 0.5.23 (CPU, fp32): the session, all three transports, flattened buckets.

Each update sends every tensor of a second checkpoint (``moe_dir_b``); afterwards SGLang's greedy
tokens and log-probs must be those transformers computes from that checkpoint, so a tensor that
went missing, under a wrong name or in a wrong layout shows. The ``restore_weights`` fixture puts the
first checkpoint back from disk.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.engines.engine import EngineRequestError
from megatron_rl.engines.protocol import (
    GenerateRequest,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
)
from megatron_rl.wire.tensor_serialization import serialize_named_tensors
from tests.api_key_cases import API_KEY
from tests.sglang.transformers_decode import greedy, load_model

PROMPT = [5, 17, 42, 8]
NEW_TOKENS = 10
LOGPROB_TOLERANCE = 1e-4
"""fp32 engine against an fp64 softmax of fp32 logits (as in test_generate.py)."""
SYNC_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def expected_b(moe_dir_b: Path) -> tuple[list[int], list[float]]:
    return greedy(load_model(moe_dir_b), PROMPT, NEW_TOKENS)


def _assert_serves(engine, expected: tuple[list[int], list[float]], version: str) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    (result,) = engine.generate(GenerateRequest(PROMPT, params))
    assert result.output_ids == expected[0]
    assert result.output_logprobs == pytest.approx(expected[1], abs=LOGPROB_TOLERANCE)
    assert result.weight_version == version


def test_a_tensor_update_outside_a_session_is_refused_with_400_by_both_engines(sglang, reference, moe_weights_b):
    payload = serialize_named_tensors([("model.norm.weight", moe_weights_b["model.norm.weight"])])
    for engine in (sglang, reference):
        with pytest.raises(EngineRequestError) as refused:
            engine.update_weights_from_tensor(UpdateWeightsFromTensorRequest([payload]))
        assert refused.value.status == 400 and "begin_weight_update" in refused.value.body


def test_a_second_begin_and_an_end_without_begin_are_refused_by_both_engines(sglang, reference):
    for engine in (sglang, reference):
        engine.begin_weight_update()
        with pytest.raises(EngineRequestError) as twice:
            engine.begin_weight_update()
        engine.end_weight_update()
        with pytest.raises(EngineRequestError) as unopened:
            engine.end_weight_update()
        assert twice.value.status == unopened.value.status == 400


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_a_tensor_update_of_every_weight_serves_the_new_checkpoint(
    restore_weights, moe_weights_b, expected_b, flattened
):
    """CPU tensors in shared memory, as the tensor transport sends them (one payload per engine TP rank)."""
    from megatron_rl.wire.tensor_serialization import flattened_bucket, serialize_flattened_bucket

    engine = restore_weights
    named = sorted(moe_weights_b.items())
    if flattened:
        storage = torch.cat([t.reshape(-1) for _, t in named])  # one storage, tensors back to back
        views, offset = [], 0
        for name, tensor in named:
            views.append((name, storage[offset : offset + tensor.numel()].view(tensor.shape)))
            offset += tensor.numel()
        bucket = flattened_bucket(views)
        assert bucket is not None, "views of one storage, back to back, make one flattened bucket"
        payload, load_format = serialize_flattened_bucket(*bucket), "flattened_bucket"
    else:
        payload, load_format = serialize_named_tensors(named), None
    engine.begin_weight_update()
    engine.update_weights_from_tensor(
        UpdateWeightsFromTensorRequest([payload], load_format=load_format, weight_version="tensor-1")
    )
    engine.end_weight_update()
    _assert_serves(engine, expected_b, "tensor-1")


def test_a_disk_update_serves_the_new_checkpoint_and_reports_its_version(restore_weights, moe_dir_b, expected_b):
    restore_weights.update_weights_from_disk(UpdateWeightsFromDiskRequest(str(moe_dir_b), weight_version="disk-1"))
    _assert_serves(restore_weights, expected_b, "disk-1")


def test_a_disk_update_from_a_missing_directory_fails_and_keeps_the_weights(sglang, moe_dir, tmp_path):
    expected = greedy(load_model(moe_dir), PROMPT, NEW_TOKENS)
    with pytest.raises(EngineRequestError) as refused:
        sglang.update_weights_from_disk(UpdateWeightsFromDiskRequest(str(tmp_path / "absent")))
    assert refused.value.status == 400
    _assert_serves(sglang, expected, "default")


def _sync_as_trainer(
    port: int, api_key: str, kind: str, config_dir: str, sync_dir: str, named: list, version: str
) -> None:
    """A trainer process: our WeightSyncer with transport ``kind`` into the engine at ``port``."""
    from megatron_rl.engines.http_engine import HttpEngine
    from megatron_rl.weight_sync.syncer import WeightSyncer
    from megatron_rl.weight_sync.transports import DiskTransport, DistributedTransport, TensorTransport, WeightTransport

    engine = HttpEngine("sglang", "127.0.0.1", port, request_timeout_s=SYNC_TIMEOUT_S, api_key=api_key)
    transport: WeightTransport
    if kind == "tensor":
        transport = TensorTransport([engine])
    elif kind == "disk":
        transport = DiskTransport([engine], sync_dir, config_dir)
    else:
        transport = DistributedTransport([engine], timeout_s=SYNC_TIMEOUT_S, flatten=kind == "distributed-flattened")
    syncer = WeightSyncer([engine], transport, bucket_bytes=1 << 14, flush_cache=False)  # as a CPU run: no flush
    syncer.sync(named, version)
    syncer.close()


@pytest.mark.parametrize("kind", ["tensor", "distributed", "distributed-flattened", "disk"])
def test_our_weight_syncer_over_each_transport_serves_the_new_checkpoint(
    restore_weights, moe_dir_b, moe_weights_b, expected_b, kind, tmp_path
):
    """The production path on CPU: pause (retract), session, buckets over the transport (gloo broadcast
    groups joined through /init_weights_update_group for distributed), end, continue; no flush, since the
    CPU engine keeps no prefix cache (``--disable-radix-cache``): the prompt served under the old weights
    just before is computed afresh under the new ones."""
    engine = restore_weights
    port = int(engine.base_url.rsplit(":", 1)[1])
    engine.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)))
    named = sorted(moe_weights_b.items())
    trainer = multiprocessing.get_context("spawn").Process(
        target=_sync_as_trainer,
        args=(port, API_KEY, kind, str(moe_dir_b), str(tmp_path / "sync"), named, f"{kind}-1"),
    )
    trainer.start()
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    # Poll the exit status: join() waits on a pipe that torch_shm_manager (which the tensor transport's
    # shared memory starts from the trainer) inherits and holds open long after the trainer exits.
    while trainer.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert trainer.exitcode == 0
    _assert_serves(engine, expected_b, f"{kind}-1")
