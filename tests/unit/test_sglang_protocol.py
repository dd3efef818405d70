"""Our SGLang request bodies, server command and response parsing against SGLang 0.5.23.

Always: every body is checked against ``SGLANG_0_5_23`` below, the field sets of
the request types written from sglang 0.5.23's ``srt/managers/io_struct.py``
(``rid``/``http_worker_ipc`` omitted: internal routing fields).

When ``sglang`` is importable, also against SGLang's own code (CI installs
``tests/sglang_protocol_requirements.txt``, sglang 0.5.23 and the light modules
it imports, with ``--no-deps --target .sglang-protocol`` and runs this module with
``PYTHONPATH=.sglang-protocol``, failing if any test skips; see .ci/run): the
request types built from our bodies exactly as its FastAPI layer does
(pydantic over the msgspec structs), ``GenerateReqInput`` normalised, its
``sampling_params`` verified, the ``/generate`` JSON contract, our response
JSON decoded by its ``GenerateResponse``, our command line parsed by its
``ServerArgs`` parser, the field sets above compared with its structs, and our
tensor payloads read by its ``MultiprocessingSerializer`` (CPU tensors exactly;
a CUDA tensor's device UUID where its patched ``rebuild_cuda_tensor`` looks),
and the weight-update group: engine ranks built with SGLang's own
``init_custom_process_group`` (gloo, in spawned processes with a default
group of their own, as SGLang's TP workers have) receive every tensor of a
tiny Qwen3-MoE broadcast by our trainer side (``wire.weight_group``)
bit for bit, the way its ``receive_weights_from_distributed`` receives them; and
``--api-key``: our command's private config file read by SGLang's own config merger,
and the reference server answering a table of requests (no key, wrong key, wrong
scheme, open paths, unknown paths, malformed bodies) with the status, content type and
body SGLang's app answers behind its own API-key middleware.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import multiprocessing
import os
import stat
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.multiprocessing import reductions

from megatron_rl.config.schema import LoRAConfig, RolloutConfig
from megatron_rl.engines.protocol import (
    AbortRequest,
    BeginWeightUpdateRequest,
    CheckWeightsRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterFromTensorsRequest,
    LoadLoRAAdapterRequest,
    MemoryOccupationRequest,
    PauseGenerationRequest,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.generator import SampleOutput
from megatron_rl.engines.sglang_engine import SGLangEngine, SGLangPlacement, build_sglang_command, write_private_config
from megatron_rl.parallel.local_launch import free_port, run_local_ranks
from megatron_rl.rollout.partial import sample_seeds
from megatron_rl.weight_sync.bucket_buffers import BucketBuffers
from megatron_rl.weight_sync.lora_sync import packed
from megatron_rl.wire.dense_buckets import aligned_runs, pack
from megatron_rl.wire.tensor_serialization import (
    FLATTENED_BUCKET,
    flattened_bucket,
    rebuild_args_with_uuid,
    serialize_flattened_bucket,
    serialize_named_tensors,
    serialize_tensor_dict,
)
from megatron_rl.wire.weight_group import broadcast_from_trainer, create_weight_group, destroy_weight_group
from tests.api_key_cases import API_KEY, KEY_CASES, raw_request
from tests.fake_engines import PartialEngine
from tests.ipc_payloads import cuda_payload, cuda_rebuild_args
from tests.tiny_checkpoints import save_tiny_moe

SGLANG_0_5_23: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {
    # our class: (io_struct class, its fields, required fields)
    "UpdateWeightsFromTensorRequest": (
        "UpdateWeightsFromTensorReqInput",
        frozenset({"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
                   "selector", "torch_empty_cache"}),
        frozenset({"serialized_named_tensors"}),
    ),
    "InitWeightsUpdateGroupRequest": (
        "InitWeightsUpdateGroupReqInput",
        frozenset({"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}),
        frozenset({"master_address", "master_port", "rank_offset", "world_size"}),
    ),
    "DestroyWeightsUpdateGroupRequest": ("DestroyWeightsUpdateGroupReqInput", frozenset({"group_name"}), frozenset()),
    "UpdateWeightsFromDistributedRequest": (
        "UpdateWeightsFromDistributedReqInput",
        frozenset({"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
                   "load_format", "selector", "torch_empty_cache"}),
        frozenset({"names", "dtypes", "shapes"}),
    ),
    "UpdateWeightsFromDiskRequest": (
        "UpdateWeightFromDiskReqInput",
        frozenset({"model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
                   "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest"}),
        frozenset({"model_path"}),
    ),
    "BeginWeightUpdateRequest": ("BeginWeightUpdateReqInput", frozenset({"selector"}), frozenset()),
    "EndWeightUpdateRequest": ("EndWeightUpdateReqInput", frozenset(), frozenset()),
    "MemoryOccupationRequest": ("ReleaseMemoryOccupationReqInput", frozenset({"tags"}), frozenset()),
    "PauseGenerationRequest": ("PauseGenerationReqInput", frozenset({"mode"}), frozenset()),
    "AbortRequest": (
        "AbortReq", frozenset({"rid", "abort_all", "finished_reason", "abort_message", "weight_versions"}), frozenset()
    ),
    "GetWeightsByNameRequest": ("GetWeightsByNameReqInput", frozenset({"name", "truncate_size"}), frozenset({"name"})),
    "CheckWeightsRequest": (
        "CheckWeightsReqInput", frozenset({"action", "allow_quant_error", "skip_tensor_list", "selector"}), frozenset()
    ),
    "LoadLoRAAdapterFromTensorsRequest": (
        "LoadLoRAAdapterFromTensorsReqInput",
        frozenset({"lora_name", "config_dict", "serialized_named_tensors", "pinned", "added_tokens_config", "lora_id",
                   "load_format", "expected_checksums"}),
        frozenset({"lora_name", "config_dict", "serialized_named_tensors"}),
    ),
    "LoadLoRAAdapterRequest": (
        "LoadLoRAAdapterReqInput", frozenset({"lora_name", "lora_path", "pinned", "lora_id"}),
        frozenset({"lora_name", "lora_path"}),
    ),
    "UnloadLoRAAdapterRequest": ("UnloadLoRAAdapterReqInput", frozenset({"lora_name", "lora_id"}), frozenset({"lora_name"})),
    "UpdateWeightVersionRequest": (
        "UpdateWeightVersionReqInput", frozenset({"new_version", "abort_all_requests"}), frozenset({"new_version"})
    ),
}  # fmt: skip
INTERNAL_FIELDS = {"rid", "http_worker_ipc"}  # BaseReq routing fields; only AbortReq's rid is ours to set

BODIES = [
    UpdateWeightsFromTensorRequest(["aGVsbG8="], flush_cache=False, weight_version="3"),
    InitWeightsUpdateGroupRequest("10.0.0.1", 29500, 1, 5, "megatron_rl_weights_rank0", "nccl"),
    DestroyWeightsUpdateGroupRequest("megatron_rl_weights_rank0"),
    UpdateWeightsFromDistributedRequest(["a.weight"], ["bfloat16"], [[4, 8]], "g", False, weight_version="3"),
    UpdateWeightsFromDiskRequest("/ckpt/step3", weight_version="3"),
    BeginWeightUpdateRequest(),
    EndWeightUpdateRequest(),
    MemoryOccupationRequest(["weights", "kv_cache"]),
    PauseGenerationRequest("retract"),
    AbortRequest("g17"),
    GetWeightsByNameRequest("model.embed_tokens.weight", 4),
    CheckWeightsRequest("compare", allow_quant_error=True, skip_tensor_list=["embed_tokens"]),
    LoadLoRAAdapterFromTensorsRequest("policy-v3", {"peft_type": "LORA", "r": 8, "lora_alpha": 16}, ["aGVsbG8="]),
    LoadLoRAAdapterRequest("policy-v3", "/ckpt/step3/adapter"),
    UnloadLoRAAdapterRequest("policy-v2"),
    UpdateWeightVersionRequest("3", abort_all_requests=False),
]
GENERATE = GenerateRequest(
    [1, 2, 3],
    SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, n=4, stop_token_ids=[2]),
    rid="g0",
    return_routed_experts=True,
    lora_path="policy-v3",
)
SGLANG_IMPORTABLE = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(not SGLANG_IMPORTABLE, reason="sglang 0.5.23 not installed (see module docstring)")


@pytest.mark.parametrize("request_body", BODIES, ids=lambda b: type(b).__name__)
def test_body_fields_match_sglang_0_5_23_schema(request_body):
    _, fields, required = SGLANG_0_5_23[type(request_body).__name__]
    body = request_body.to_json()
    assert set(body) <= fields, f"fields SGLang does not know: {set(body) - fields}"
    assert required <= set(body)
    assert type(request_body).from_json(body) == request_body


@needs_sglang
@pytest.mark.parametrize("request_body", BODIES, ids=lambda b: type(b).__name__)
def test_body_builds_sglangs_own_request_type(request_body):
    from pydantic import TypeAdapter
    from sglang.srt.managers import io_struct

    name, fields, _ = SGLANG_0_5_23[type(request_body).__name__]
    cls = getattr(io_struct, name)
    expected = set(cls.__struct_fields__) - INTERNAL_FIELDS
    assert expected == fields - {"rid"}, "the written schema drifted from sglang's source"
    built = TypeAdapter(cls).validate_python(request_body.to_json())
    for key, value in request_body.to_json().items():
        if key != "serialized_named_tensors":
            assert getattr(built, key) == value, key


@needs_sglang
def test_generate_body_passes_sglangs_contract_and_sampling_checks():
    from sglang.api.v1.api_types import GenerateRequest as ContractRequest
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    body = GENERATE.to_json()
    ContractRequest.from_json_value(body)
    request = GenerateReqInput(**body)
    request.normalize_batch_and_arguments()
    # n samples go as a batch of n one-sample requests, so each keeps the id HttpEngine.abort(rid) aborts
    assert (request.batch_size, request.parallel_sample_num) == (4, 1)
    assert [request[i].rid for i in range(4)] == ["g0_0", "g0_1", "g0_2", "g0_3"]
    assert all(request[i].input_ids == [1, 2, 3] and request[i].return_routed_experts for i in range(4))
    assert [request[i].lora_path for i in range(4)] == ["policy-v3"] * 4
    params = SGLangSamplingParams(**request[0].sampling_params)
    params.normalize(None)
    params.verify(100)
    assert (params.top_k, params.n, params.stop_token_ids) == (20, 1, {2})
    assert GenerateRequest.from_json(body) == dataclasses.replace(GENERATE, rid=["g0_0", "g0_1", "g0_2", "g0_3"])


def _reference_sample_json() -> dict:
    routed = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    sample = SampleOutput([7, 2], [-0.5, -1.25], FinishReason("stop", matched=2), routed)
    return ReferenceBackend._sample_json("g0", 0, sample, prompt_tokens=1, version="3")


def test_reference_response_round_trips_through_our_parser():
    result = GenerateResult.from_json(_reference_sample_json(), routed_experts_shape=(3, 2))
    assert result.output_ids == [7, 2] and result.output_logprobs == [-0.5, -1.25]
    assert result.finish_reason == FinishReason("stop", matched=2) and result.weight_version == "3"
    assert result.routed_experts is not None
    assert result.routed_experts.shape == (2, 3, 2) and result.routed_experts[1, 2, 1] == 11


@needs_sglang
def test_reference_response_decodes_as_sglangs_generate_response():
    from sglang.api.v1.api_types import GenerateResponse

    decoded = GenerateResponse.from_json_value(_reference_sample_json())
    assert decoded.output_ids == [7, 2] and decoded.meta_info.weight_version == "3"
    assert [entry.logprob for entry in decoded.meta_info.output_token_logprobs] == [-0.5, -1.25]


def _command() -> list[str]:
    config = RolloutConfig(tp=4, ep=4, dp=1, placement="colocated", quantization="fp8", mem_fraction=0.6)
    return build_sglang_command(config, SGLangPlacement(4, 30000, 30001), "/models/qwen3", routing_replay=True)


def test_command_carries_the_rl_flags():
    command = _command()
    assert command[1:3] == ["-m", "sglang.launch_server"]
    for flag in ("--enable-memory-saver", "--skip-tokenizer-init", "--enable-return-routed-experts"):
        assert flag in command
    assert command[command.index("--base-gpu-id") + 1] == "4" and command[command.index("--quantization") + 1] == "fp8"


def test_command_refuses_a_bad_placement():
    with pytest.raises(ValueError, match="needs dist_init_addr"):
        build_sglang_command(RolloutConfig(), SGLangPlacement(0, 30000, 30001, nnodes=2), "/m")


LORA = LoRAConfig(rank=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], max_loras_per_batch=2)


def test_a_lora_command_carries_the_lora_flags_and_the_torch_backend_on_cpu():
    command = build_sglang_command(RolloutConfig(), SGLangPlacement(0, 30000, 30001), "/m", lora=LORA, python="py")
    at = command.index("--enable-lora")
    assert command[at:] == [
        "--enable-lora", "--max-lora-rank", "32", "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
        "--max-loras-per-batch", "2",
    ]  # fmt: skip
    cpu = SGLangPlacement(0, 30000, 30001, device="cpu")
    command = build_sglang_command(RolloutConfig(max_total_tokens=4096), cpu, "/m", lora=LORA, python="py")
    assert command[-2:] == ["--lora-backend", "torch_native"]


@needs_sglang
def test_a_lora_command_parses_into_sglangs_server_args():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    lora = LORA.model_copy(update={"experts_shared_outer": True})
    command = build_sglang_command(RolloutConfig(), SGLangPlacement(0, 30000, 30001), "/m", lora=lora, python="py")
    args = parser.parse_args(command[3:])
    assert args.enable_lora and (args.max_lora_rank, args.max_loras_per_batch) == (32, 2)
    assert args.lora_target_modules == list(LORA.target_modules) and args.experts_shared_outer_loras is True
    assert args.lora_backend == "csgmv"  # SGLang's GPU default (Triton kernels)
    cpu = SGLangPlacement(0, 30000, 30001, device="cpu")
    command = build_sglang_command(RolloutConfig(max_total_tokens=4096), cpu, "/m", lora=lora, python="py")
    assert parser.parse_args(command[3:]).lora_backend == "torch_native"


@needs_sglang
def test_command_parses_into_sglangs_server_args():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(_command()[3:])
    assert (args.tp_size, args.ep_size, args.dp_size, args.base_gpu_id, args.port) == (4, 4, 1, 4, 30000)
    assert args.enable_memory_saver and args.skip_tokenizer_init and args.enable_return_routed_experts
    assert args.quantization == "fp8" and args.mem_fraction_static == 0.6


@contextlib.contextmanager
def _sglang_reductions() -> Iterator[None]:
    """Torch's reductions patched by SGLang, as in its workers; torch's own restored afterwards."""
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    originals = reductions.reduce_tensor, reductions.rebuild_cuda_tensor
    monkey_patch_torch_reductions()
    try:
        yield
    finally:
        reductions.reduce_tensor, reductions.rebuild_cuda_tensor = originals
        delattr(reductions, "_reduce_tensor_original")  # SGLang's patch keeps torch's functions there
        delattr(reductions, "_rebuild_cuda_tensor_original")
        reductions.init_reductions()


@pytest.fixture
def sglang_torch_reductions() -> Iterator[None]:
    with _sglang_reductions():
        yield


@needs_sglang
def test_sglang_deserializes_our_cpu_payload_exactly():
    from sglang.srt.utils.common import MultiprocessingSerializer

    tensors = [("a", torch.randn(3, 4)), ("b", torch.arange(6, dtype=torch.bfloat16))]
    restored = MultiprocessingSerializer.deserialize(serialize_named_tensors(tensors))
    assert [name for name, _ in restored] == ["a", "b"]
    assert all(torch.equal(copy, original) for (_, copy), (_, original) in zip(restored, tensors, strict=True))


@needs_sglang
def test_sglang_loads_our_flattened_bucket_exactly():
    """SGLang's allow-list unpickler opens our ``flattened_bucket`` payload (metadata as SimpleNamespace) and its
    own weight updater rebuilds every tensor from it, bit for bit, in order."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.utils.common import MultiprocessingSerializer

    sent = [("a", torch.randn(3, 4)), ("b", torch.arange(6, dtype=torch.bfloat16)), ("c", torch.randn(5).double())]
    buffers = BucketBuffers(num_buffers=1)
    buffers.seal([(name, buffers.copy_in(tensor)) for name, tensor in sent])  # sizes the buffer for the bucket
    buffers.restart()
    bucket = [(name, buffers.copy_in(tensor)) for name, tensor in sent]
    flat = flattened_bucket(bucket)
    assert flat is not None
    loaded: list[tuple[str, torch.Tensor]] = []
    runner = types.SimpleNamespace(get_model=lambda: types.SimpleNamespace(load_weights=loaded.extend))
    payload = MultiprocessingSerializer.deserialize(serialize_flattened_bucket(*flat))
    assert WeightUpdater._update_weights_from_flattened_bucket(runner, flattened_tensor_bucket_dict=payload)[0]
    assert [name for name, _ in loaded] == ["a", "b", "c"]
    assert all(t.dtype == o.dtype and torch.equal(t, o) for (_, t), (_, o) in zip(loaded, sent, strict=True))


@needs_sglang
@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "dict"])
def test_sglangs_tp_worker_hands_its_lora_manager_our_adapter_exactly(flattened):
    """Our adapter payload through SGLang's own request parsing, payload normalisation and TP worker
    (``TpModelWorker.load_lora_adapter_from_tensors``): its LoRA manager gets the PEFT dict, bit for bit, in the
    engine's dtype; SGLang's adapter then stacks q/k/v into one ``qkv_proj`` weight as it serves it."""
    from pydantic import TypeAdapter
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig as SGLangLoRAConfig
    from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
    from transformers import Qwen3Config

    prefix = "base_model.model.model.layers.0.self_attn"
    shapes = {"q_proj": (16, 8), "k_proj": (8, 8), "v_proj": (8, 8)}  # (out, in)
    adapter = {}
    for proj, (out_features, in_features) in shapes.items():
        adapter[f"{prefix}.{proj}.lora_A.weight"] = torch.randn(4, in_features)
        adapter[f"{prefix}.{proj}.lora_B.weight"] = torch.randn(out_features, 4)
    views = packed(adapter, torch.device("cpu"), torch.bfloat16)
    flat = flattened_bucket(views)
    assert flat is not None
    payload = serialize_flattened_bucket(*flat) if flattened else serialize_tensor_dict(dict(views))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(shapes)}
    request = LoadLoRAAdapterFromTensorsRequest(
        "policy-v3", config, [payload], load_format=FLATTENED_BUCKET if flattened else None
    )
    received = TypeAdapter(LoadLoRAAdapterFromTensorsReqInput).validate_python(request.to_json())
    received.serialized_named_tensors = normalize_serialized_named_tensor_payloads(received.serialized_named_tensors)
    received.lora_id = "id"  # the tokenizer manager's, as it sends the request on (tokenizer_control_mixin.py:782)
    handed: dict[str, torch.Tensor] = {}
    worker = types.SimpleNamespace(
        deserialize_own_rank=lambda payloads: MultiprocessingSerializer.deserialize(payloads[0]),
        model_runner=types.SimpleNamespace(
            load_lora_adapter_from_tensors=lambda ref, tensors, *_: handed.update(tensors)
        ),
    )
    TpModelWorker.load_lora_adapter_from_tensors(worker, received)
    assert list(handed) == list(adapter)
    assert all(handed[k].dtype == torch.bfloat16 and torch.equal(handed[k], v.bfloat16()) for k, v in adapter.items())
    base = Qwen3Config(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    served = LoRAAdapter("id", SGLangLoRAConfig.from_dict(config, None, base_vocab_size=100), base, None, None)
    served.initialize_weights_from_tensors(handed)
    stacked = served.layers[0].weights[f"{prefix}.qkv_proj.lora_B.weight"]
    expected = torch.cat([adapter[f"{prefix}.{p}.lora_B.weight"] for p in shapes]).bfloat16()
    assert torch.equal(stacked, expected)


@needs_sglang
def test_sglang_reads_the_device_uuid_of_our_cuda_payload(sglang_torch_reductions):
    from sglang.srt.utils.common import MultiprocessingSerializer

    uuid = "8f1c0d2e-0000-4000-8000-00000000000a"
    payload = cuda_payload("w", rebuild_args_with_uuid(cuda_rebuild_args(0), uuid_of=lambda index: uuid))
    with pytest.raises(Exception, match=f"^Invalid device_uuid={uuid}$"):  # no such GPU here: it looked the UUID up
        MultiprocessingSerializer.deserialize(payload)


class _PostedRequests(PartialEngine):
    """An engine that keeps the /update_weights_from_tensor bodies our poster sends (as JSON)."""

    name = "engine0"

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> None:
        self.bodies.append(request.to_json())


def _feeder_bucket(rank: int) -> list[tuple[str, torch.Tensor]]:
    """Feeder ``rank``'s bucket: the same names on every feeder, values that say whose it is."""
    return [("w.a", torch.full((4, 3), float(rank))), ("w.b", torch.arange(6, dtype=torch.bfloat16) + rank)]


def _feed_one_engine_rank(rank: int, world_size: int, flattened: bool) -> list[dict] | None:
    """Trainer rank ``rank`` feeds TP rank ``rank`` of one engine of TP 2 through our tensor transport; the
    poster (rank 0) returns the request bodies it sent. Each payload holds a reference to its shared memory
    (torch's ``file_system`` sharing) until an engine rank opens it, so the test opens them after the ranks end."""
    import torch.distributed as dist

    from megatron_rl.weight_sync.transports import TensorTransport

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    engine = _PostedRequests()
    transport = TensorTransport([engine], [2])
    for _ in range(2 if flattened else 1):  # the first sync sizes the bucket buffer: the second fills one
        transport.begin("v1")
        bucket = _feeder_bucket(rank)
        if flattened:
            allocate = transport.allocate
            assert allocate is not None, "a transport that feeds engines hands out bucket memory"
            bucket = [(name, allocate([tuple(t.shape)], t.dtype)[0].copy_(t)) for name, t in bucket]
        transport.send_bucket(bucket, "v1")
        transport.finish("v1")
    dist.barrier()  # the poster's engine has read both entries
    transport.close()
    dist.destroy_process_group()
    return engine.bodies if rank == 0 else None


@needs_sglang
@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_sglang_hands_tp_rank_i_the_payload_of_the_trainer_rank_on_its_device(monkeypatch, flattened):
    """Our colocated poster's request for an engine of TP 2, fed by trainer ranks 0 and 1, goes through
    SGLang's own request type, and SGLang's ``TpModelWorker.deserialize_own_rank`` (what its scheduler's
    weight updater calls on every TP rank) gives TP rank i exactly trainer rank i's tensors."""
    body = run_local_ranks(_feed_one_engine_rank, 2, flattened)[0][-1]  # before SGLang patches torch here
    from sglang.srt.managers import tp_worker
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    request = UpdateWeightsFromTensorReqInput(**body)
    assert len(request.serialized_named_tensors) == 2
    assert request.load_format == ("flattened_bucket" if flattened else None)
    for tp_rank in (0, 1):
        monkeypatch.setattr(tp_worker, "get_parallel", lambda rank=tp_rank: types.SimpleNamespace(tp_rank=rank))
        with _sglang_reductions():  # deserialize_own_rank patches them itself; restored afterwards
            data = tp_worker.TpModelWorker.deserialize_own_rank(None, request.serialized_named_tensors)
        if flattened:
            data = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
            data = data.reconstruct_tensors()
        expected = _feeder_bucket(tp_rank)
        assert [name for name, _ in data] == [name for name, _ in expected]
        assert all(t.dtype == e.dtype and torch.equal(t, e) for (_, t), (_, e) in zip(data, expected, strict=True))


@needs_sglang
@pytest.mark.parametrize(("tp", "ep"), [(4, 4), (4, 2), (8, 4), (2, 1)])
def test_an_engine_rank_is_fed_exactly_the_experts_sglangs_moe_loader_keeps(tp, ep):
    """SGLang's own ``FusedMoE.weight_loader`` (trivial expert placement, as an engine starts) on each TP rank:
    the experts it passes on to the rank's parameters are :func:`engine_rank_experts`'s, the rest it drops.
    The rank's MoE EP rank is ``tp_rank // (tp // ep)``, as its ``parallel_state`` groups ranks (one MoE DP)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    from megatron_rl.weight_sync.engine_feeds import engine_rank_experts

    experts = 16
    for tp_rank in range(tp):
        loaded: list[int] = []
        layer = types.SimpleNamespace(
            quant_config=None,
            uses_expert_location=False,
            _expert_storage_rank=tp_rank // (tp // ep),
            _num_local_routed=experts // ep,
            _has_fused_shared=False,
            _weight_loader_impl=lambda expert_id, loaded=loaded, **_: loaded.append(expert_id),
        )
        mapping = FusedMoE._map_global_expert_id_to_local_expert_id
        layer._map_global_expert_id_to_local_expert_id = types.MethodType(mapping, layer)
        param = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        kept = []
        for expert in range(experts):
            before = len(loaded)
            FusedMoE.weight_loader(layer, param, torch.empty(0), "experts.w13_weight", "w1", expert)
            kept += [expert] * (len(loaded) > before)
        share = engine_rank_experts(tp_rank, tp, ep, experts)
        assert kept == list(share)
        assert loaded == [expert - share.start for expert in share]  # local slots 0.. in order


ENGINE_RANKS = 2  # one engine with TP 2 (rank offset 1), as SGLang joins it: rank = rank_offset + tp_rank
GROUP_TIMEOUT_S = 60.0


def _sglang_engine_rank(tp_rank: int, port: int, named: list, runs: list | None, results) -> None:
    """One SGLang TP worker's side of /init_weights_update_group + /update_weights_from_distributed.

    ``runs``: None for one broadcast per tensor, else each flattened request's (names, dtypes, shapes),
    received as SGLang 0.5.23 does (``FlattenedTensorBucket.empty``, one broadcast, ``reconstruct_tensors``).
    """
    import torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    group = init_custom_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        world_size=1 + ENGINE_RANKS,
        rank=1 + tp_rank,
        group_name="megatron_rl_weights_rank0",
    )
    if runs is None:
        received = [(name, torch.empty(t.shape, dtype=t.dtype)) for name, t in named]
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in received]
        for handle in handles:
            assert handle is not None  # async_op=True returns the work to wait on
            handle.wait()
    else:
        received = []
        for names, dtypes, shapes in runs:
            bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            received += bucket.reconstruct_tensors()
    differing = [
        name for (name, t), (got, r) in zip(named, received, strict=True) if got != name or not torch.equal(t, r)
    ]
    results.put((tp_rank, len(received), differing))
    dist.destroy_process_group(group)
    dist.destroy_process_group()


@needs_sglang
@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_sglang_init_custom_process_group_receives_our_broadcast_bit_exact(tmp_path, flattened):
    """SGLang's own group join and receive path gets our broadcasts bit for bit: one per tensor, or our dense
    packing of each aligned run against SGLang's flattened-bucket layout (an odd bfloat16 tensor before
    float32 ones forces a second run)."""
    from safetensors.torch import load_file

    hf_dir = save_tiny_moe(tmp_path / "moe")
    named = sorted(load_file(hf_dir / "model.safetensors").items())
    named = [*named[:3], ("odd.bfloat16", torch.randn(7).bfloat16()), *named[3:]]
    runs = aligned_runs(named) if flattened else None
    assert runs is None or len(runs) == 2
    metadata = None
    if runs is not None:
        metadata = [([n for n, _ in r], [t.dtype for _, t in r], [list(t.shape) for _, t in r]) for r in runs]
    port = free_port()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    engines = [context.Process(target=_sglang_engine_rank, args=(r, port, named, metadata, results)) for r in (0, 1)]
    for process in engines:
        process.start()
    try:
        group = create_weight_group(
            "127.0.0.1", port, 0, 1 + ENGINE_RANKS, "megatron_rl_weights_rank0", "gloo", timeout_s=GROUP_TIMEOUT_S
        )
        for tensor in [pack(run) for run in runs] if runs else [t for _, t in named]:
            broadcast_from_trainer(group, tensor)
        reports = sorted(results.get(timeout=GROUP_TIMEOUT_S) for _ in engines)
        destroy_weight_group(group)
    finally:
        for process in engines:
            process.join(GROUP_TIMEOUT_S)
            if process.exitcode is None:
                process.kill()
    assert reports == [(0, len(named), []), (1, len(named), [])]
    assert [process.exitcode for process in engines] == [0, 0]


# ---------------------------------------------------------------- our client against SGLang's own HTTP layer


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    return save_tiny_moe(tmp_path_factory.mktemp("hf") / "moe")


def _sglang_http(hf_dir: Path, dp_size: int = 1):
    """(HttpEngine, backend) with SGLang's FastAPI app in front of a reference backend (tests/sglang_http_standin.py)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.engines.http_engine import HttpEngine
    from tests.sglang_http_standin import serve_sglang_http

    backend = ReferenceBackend(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), dp_size=dp_size)
    with serve_sglang_http(backend) as port:
        engine = HttpEngine("sglang-http", "127.0.0.1", port, request_timeout_s=60)
        engine.wait_healthy(30)
        yield engine, backend


@pytest.fixture
def sglang_http(tiny_moe_dir):
    yield from _sglang_http(tiny_moe_dir)


@needs_sglang
def test_flush_cache_through_sglangs_http_layer_is_plain_text(sglang_http):
    from megatron_rl.engines.protocol import FLUSH_CACHE_OK

    engine, _ = sglang_http
    assert engine.request("/flush_cache", {}) == FLUSH_CACHE_OK  # SGLang's text, not JSON
    engine.flush_cache()


@needs_sglang
def test_weight_update_session_through_sglangs_http_layer(sglang_http):
    from megatron_rl.engines.engine import EngineRequestError

    engine, backend = sglang_http
    update = UpdateWeightsFromTensorRequest(
        [serialize_named_tensors([("model.norm.weight", torch.full((32,), 5.0))])], flush_cache=False
    )
    with pytest.raises(EngineRequestError) as refused:
        engine.update_weights_from_tensor(update)
    assert refused.value.status == 400 and '"success":false' in refused.value.body.replace(" ", "")
    engine.begin_weight_update()
    with pytest.raises(EngineRequestError, match="already open"):
        engine.begin_weight_update()
    engine.update_weights_from_tensor(update)
    engine.end_weight_update()
    assert torch.equal(backend.params["model.norm.weight"], torch.full((32,), 5.0))


@needs_sglang
def test_generate_pause_and_abort_through_sglangs_http_layer(sglang_http):
    engine, _ = sglang_http
    params = SamplingParams(max_new_tokens=4, temperature=0.7, n=2, sampling_seed=3)
    results = engine.generate(GenerateRequest([5, 17, 42], params, rid="g1", return_routed_experts=True))
    assert len(results) == 2 and all(len(r.output_ids) == len(r.output_logprobs) for r in results)
    assert {r.rid for r in results} == {"g1_0", "g1_1"} and results[0].weight_version == "default"
    engine.pause_generation("retract")
    engine.continue_generation()
    engine.abort("g1")


def _sync_as_trainer(port: int, kind: str, named: list, version: str) -> None:
    """A trainer process: one WeightSyncer of transport ``kind`` into the engine at ``port``."""
    from megatron_rl.engines.http_engine import HttpEngine
    from megatron_rl.weight_sync.syncer import WeightSyncer
    from megatron_rl.weight_sync.transports import DistributedTransport, TensorTransport, WeightTransport

    engine = HttpEngine("sglang-http", "127.0.0.1", port, request_timeout_s=60)
    transport: WeightTransport
    if kind == "tensor":
        transport = TensorTransport([engine])
    else:
        transport = DistributedTransport([engine], timeout_s=60, flatten=kind == "distributed-flattened")
    syncer = WeightSyncer([engine], transport, bucket_bytes=1 << 14)
    syncer.sync(named, version)
    syncer.close()


@needs_sglang
@pytest.mark.parametrize("kind", ["tensor", "distributed", "distributed-flattened"])
def test_syncers_through_sglangs_http_layer_are_bit_exact(sglang_http, kind):
    """A trainer process syncs into the engine behind SGLang's routes (session, group join, broadcast, flush)."""
    engine, backend = sglang_http
    named = [(name, torch.randn(p.shape)) for name, p in sorted(backend.params.items()) if "experts" not in name]
    trainer = multiprocessing.get_context("spawn").Process(
        target=_sync_as_trainer, args=(int(engine.base_url.rsplit(":", 1)[1]), kind, named, f"{kind}-1")
    )
    trainer.start()
    trainer.join(GROUP_TIMEOUT_S)
    assert trainer.exitcode == 0
    assert all(torch.equal(backend.params[name], tensor) for name, tensor in named)
    assert backend.weight_version == f"{kind}-1" and not backend._session and not backend._groups


@needs_sglang
def test_weight_update_with_dp_2_fails_sglangs_assertion_through_its_http_layer(tiny_moe_dir):
    from megatron_rl.engines.engine import EngineRequestError

    for engine, _ in _sglang_http(tiny_moe_dir, dp_size=2):
        engine.begin_weight_update()
        with pytest.raises(EngineRequestError) as failed:
            engine.update_weights_from_tensor(UpdateWeightsFromTensorRequest([serialize_named_tensors([])]))
        assert failed.value.status == 500 and failed.value.body == "Internal Server Error"


# ---------------------------------------------------------------- --api-key: SGLang's checks and ours


def test_the_api_key_reaches_sglang_through_a_private_file_not_the_command_line(tmp_path):
    engine = SGLangEngine(
        "e0", RolloutConfig(), SGLangPlacement(0, 30000, 30001), "/models/qwen3", log_dir=tmp_path, api_key=API_KEY
    )
    assert engine.process is not None
    command = engine.process.command
    assert not any(API_KEY in part for part in command)
    config_file = Path(command[command.index("--config") + 1])
    assert not config_file.exists()  # written at start, deleted once SGLang has read it (healthy or stopped)
    assert stat.S_IMODE(os.stat(config_file.parent).st_mode) == 0o700
    written = write_private_config(config_file.parent, {"api-key": API_KEY})
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600 and written == config_file
    if SGLANG_IMPORTABLE:
        import argparse

        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(command[3:]))
        assert args.api_key == API_KEY and args.port == 30000 and args.skip_tokenizer_init
    engine.shutdown()
    assert not config_file.parent.exists()


@pytest.fixture(scope="module")
def servers_with_key(tiny_moe_dir) -> Iterator[tuple[int, int]]:
    """(port of SGLang's app behind its --api-key middleware, port of our reference server with the same key)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.engines.reference.server import build_server
    from tests.sglang_http_standin import serve_sglang_http

    def backend() -> ReferenceBackend:
        return ReferenceBackend(AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32))

    ours = build_server(backend(), "127.0.0.1", free_port(), api_key=API_KEY)
    threading.Thread(target=ours.serve_forever, daemon=True).start()
    try:
        with serve_sglang_http(backend(), api_key=API_KEY) as sglang_port:
            yield sglang_port, ours.server_address[1]
    finally:
        ours.shutdown()
        ours.server_close()


@needs_sglang
@pytest.mark.parametrize("case", KEY_CASES, ids=lambda c: f"{c[0]} {c[1]} {c[2]} {(c[3] or b'')[:9]!r}")
def test_the_reference_server_checks_the_api_key_as_sglang_does(servers_with_key, case):
    sglang_port, our_port = servers_with_key
    sglang = raw_request(sglang_port, *case)
    ours = raw_request(our_port, *case)
    assert ours[0] == sglang[0], (ours, sglang)
    if sglang[0] == 401:
        assert ours == sglang == (401, "application/json", b'{"error":"Unauthorized"}')


@needs_sglang
def test_our_client_sends_the_key_sglang_requires(tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    from megatron_rl.engines.engine import EngineRequestError
    from megatron_rl.engines.http_engine import HttpEngine
    from tests.sglang_http_standin import serve_sglang_http

    backend = ReferenceBackend(AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32))
    with serve_sglang_http(backend, api_key=API_KEY) as port:
        keyed = HttpEngine("sglang-http", "127.0.0.1", port, request_timeout_s=60, api_key=API_KEY)
        keyed.wait_healthy(30)
        assert keyed.generate(GenerateRequest([5, 17], SamplingParams(max_new_tokens=2, temperature=0.0)))
        keyed.pause_generation("retract")
        keyed.flush_cache()
        keyed.begin_weight_update()
        keyed.end_weight_update()
        keyed.continue_generation()
        for key in (None, "another-run"):
            stranger = HttpEngine("sglang-http", "127.0.0.1", port, request_timeout_s=60, api_key=key)
            stranger.wait_healthy(30)  # /health is open
            with pytest.raises(EngineRequestError, match="refused this run's API key") as refused:
                stranger.begin_weight_update()
            assert refused.value.status == 401 and refused.value.body == '{"error":"Unauthorized"}'


def _deterministic_command(deterministic: bool) -> list[str]:
    config = RolloutConfig(tp=4, ep=4, dp=1, deterministic_inference=deterministic)
    return build_sglang_command(config, SGLangPlacement(0, 30000, 30001), "/models/qwen3")


@needs_sglang
def test_deterministic_inference_switch_parses_into_sglangs_server_args():
    """rollout.deterministic_inference is SGLang's --enable-deterministic-inference, and off by default."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(_deterministic_command(True)[3:]).enable_deterministic_inference is True
    assert parser.parse_args(_deterministic_command(False)[3:]).enable_deterministic_inference is False
    assert "--attention-backend" not in _deterministic_command(True)  # SGLang picks fa3 / flashinfer on GPUs


SEEDED = GenerateRequest(
    [5, 17, 42],
    SamplingParams(max_new_tokens=12, temperature=1.0, n=4),
    rid="g3",
    sample_seeds=sample_seeds(1234 * 2**32 + 3, 4),
)


def test_per_sample_seeds_go_as_one_sampling_params_per_sample_and_parse_back():
    body = SEEDED.to_json()
    assert body["input_ids"] == [[5, 17, 42]] * 4 and body["rid"] == ["g3_0", "g3_1", "g3_2", "g3_3"]
    assert [params["sampling_seed"] for params in body["sampling_params"]] == SEEDED.sample_seeds
    assert all(params["n"] == 1 for params in body["sampling_params"]) and "sample_seeds" not in body
    assert len(set(SEEDED.sample_seeds or ())) == 4 and all(0 <= s < 2**63 for s in SEEDED.sample_seeds or ())
    assert GenerateRequest.from_json(body) == dataclasses.replace(SEEDED, rid=body["rid"])
    one = GenerateRequest([5], SamplingParams(n=1), rid="g4", sample_seeds=[7]).to_json()
    assert one["sampling_params"][0]["sampling_seed"] == 7 and one["rid"] == ["g4"]
    with pytest.raises(ValueError, match="2 sample_seeds for n = 4"):
        GenerateRequest([5], SamplingParams(n=4), sample_seeds=[1, 2])
    with pytest.raises(ValueError, match="replace sampling_params.sampling_seed"):
        GenerateRequest([5], SamplingParams(n=1, sampling_seed=3), sample_seeds=[1])
    other = dict(
        body, sampling_params=[dict(body["sampling_params"][0], temperature=0.5)] + body["sampling_params"][1:]
    )
    with pytest.raises(ValueError, match="differ in sampling_seed only"):
        GenerateRequest.from_json(other)


def _sglang_seeds(request: GenerateRequest) -> list[int | None]:
    """Each sample's sampling_seed as SGLang 0.5.23's GenerateReqInput and SamplingParams make it of our body."""
    from sglang.api.v1.api_types import GenerateRequest as ContractRequest
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    body = request.to_json()
    ContractRequest.from_json_value(body)
    normalised = GenerateReqInput(**body)
    normalised.normalize_batch_and_arguments()
    seeds = []
    for i in range(normalised.batch_size):
        params = SGLangSamplingParams(**normalised[i].sampling_params)
        params.normalize(None)
        params.verify(100)
        seeds.append(params.sampling_seed)
    return seeds


_SEEDED_DECODE = """
import json, sys
import torch
from sglang.kernels.ops.sampling import murmur_hash
from sglang.srt.layers import sampler


def murmur_hash32_interpreted(seed, positions, col_indices):
    hashed = torch.empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)
    grid = (seed.shape[0], 1)
    murmur_hash.murmur_hash32_kernel[grid](
        seed, positions, col_indices, hashed, seed.shape[0], col_indices.shape[0], BLOCK_SIZE=128
    )
    return hashed


sampler.murmur_hash32 = murmur_hash32_interpreted
prompt, steps, batches = json.loads(sys.argv[1])
logits = torch.randn(100, 100, generator=torch.Generator().manual_seed(0)) * 2
answers = []
for seeds in batches:
    seed_rows = torch.tensor(seeds, dtype=torch.int64)
    tokens = [[prompt[-1]] for _ in seeds]
    for step in range(steps):
        probs = torch.softmax(logits[[sample[-1] for sample in tokens]], dim=-1)
        positions = torch.full((len(seeds),), len(prompt) + step - 1, dtype=torch.int64)
        drawn = sampler.sampling_from_probs_torch(probs, sampling_seed=seed_rows, positions=positions)
        for sample, token in zip(tokens, drawn.tolist()):
            sample.append(token)
    answers.append([sample[1:] for sample in tokens])
print(json.dumps(answers))
"""


def _sglang_seeded_decode(prompt: list[int], batches: list[list[int | None]], steps: int) -> list[list[list[int]]]:
    """The samples SGLang 0.5.23's seeded sampler draws for each batch of one prompt's samples (one seed per
    sample), under a fixed bigram model: ``sampling_from_probs_torch`` with ``sampling_seed``, what its
    deterministic mode runs at temperature 1 without top-k/p, whose Gumbel noise is its murmur hash of
    (seed, position, token). Its hash is a Triton kernel (GPU) or an ``sgl_kernel`` CPU op that no registry
    wheel carries, so the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``), in a process of
    its own since the interpreter is chosen when the kernel is defined; eager, since dynamo cannot trace
    the interpreter (SGLang compiles ``multinomial_with_seed``)."""
    import json
    import subprocess
    import sys

    env = os.environ | {"TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1"}
    argument = json.dumps([prompt, steps, batches])
    done = subprocess.run(
        [sys.executable, "-c", _SEEDED_DECODE, argument], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_sglang
def test_sglangs_seeded_sampler_makes_our_samples_repeatable_and_different_from_each_other():
    """Through SGLang's own request normalisation and seeded sampler: the rollout manager's per-sample seeds
    give a group's samples different tokens and the same tokens again when the request is sent again; one
    seed for the request (what we sent before) gives all its samples the same tokens."""
    seeds = _sglang_seeds(SEEDED)
    assert seeds == SEEDED.sample_seeds
    one_seed = dataclasses.replace(
        SEEDED, sampling_params=dataclasses.replace(SEEDED.sampling_params, sampling_seed=9), sample_seeds=None
    )
    assert _sglang_seeds(one_seed) == [9] * 4
    first, again, alike = _sglang_seeded_decode(SEEDED.input_ids, [seeds, _sglang_seeds(SEEDED), [9] * 4], 12)
    assert first == again
    assert len({tuple(sample) for sample in first}) == 4, first
    assert len({tuple(sample) for sample in alike}) == 1, alike


@needs_sglang
@pytest.mark.parametrize("node_rank", [0, 1])
def test_a_node_of_an_engine_spanning_two_nodes_parses_in_sglangs_server_args(node_rank):
    from sglang.srt.server_args import prepare_server_args

    config = RolloutConfig(tp=16, ep=16, dp=1, placement="disaggregated")
    placement = SGLangPlacement(0, 30000, 30001, host="10.0.0.1", dist_init_addr="10.0.0.1:29500", nnodes=2)
    placement = dataclasses.replace(placement, node_rank=node_rank)
    command = build_sglang_command(config, placement, "/models/qwen3", python="python")
    args = prepare_server_args(command[3:])
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (2, node_rank, "10.0.0.1:29500")
    assert (args.tp_size, args.ep_size, args.dp_size, args.base_gpu_id) == (16, 16, 1, 0)
