"""The reference engine's ``/weights_checker`` (SGLang 0.5.23's): snapshot, reset, compare, checksum.

A preflight's read-back: the engine loads the checkpoint, snapshots, resets every weight to random values,
receives the trainer's sync, and compares bit for bit: a tensor the sync left out stays random and is named.
Driven through our client (``HttpEngine.check_weights``) and our weight sync (tensor transport, in process).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.checkpoint.fp8_convert import convert_hf_to_fp8
from megatron_rl.engines.engine import EngineRequestError
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.node_group import NodeGroup
from megatron_rl.engines.reference.server import answer, fp8_block_of, load_model
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import TensorTransport
from tests.reference_servers import serving
from tests.tiny_checkpoints import save_tiny_moe

SUCCESS = {"success": True, "message": "Success."}
BLOCK = (16, 16)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return save_tiny_moe(tmp_path_factory.mktemp("moe") / "moe", all_sparse=True)


@pytest.fixture
def served(moe_dir) -> Iterator[tuple[HttpEngine, ReferenceBackend]]:
    backend = ReferenceBackend(load_model(str(moe_dir), "auto", torch.float32, "cpu"))
    with serving(backend, "checked") as engine:
        yield engine, backend


def _sync(engine: HttpEngine, named: dict[str, torch.Tensor], fp8_block: tuple[int, int] | None = None) -> None:
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=1 << 16, fp8_block=fp8_block)
    syncer.sync(named.items(), "synced")
    syncer.close()


def _failed_names(error: EngineRequestError) -> list[str]:
    """The tensors a failed compare names (each line after the first starts with ``name=``)."""
    header, *lines = json.loads(error.body)["message"].split("\n")
    assert header == "check tensor equality failed:"
    assert all(line.startswith("name=") for line in lines), lines
    return [line.split()[0].removeprefix("name=") for line in lines]


def test_a_snapshot_compares_equal_and_a_second_compare_without_one_fails_as_sglang(served):
    engine, _ = served
    assert engine.check_weights("snapshot") == SUCCESS
    assert engine.check_weights("compare") == SUCCESS
    with pytest.raises(EngineRequestError, match="bare assertion") as failed:  # the passed compare dropped it
        engine.check_weights("compare")
    assert failed.value.status == 400 and json.loads(failed.value.body) == {"success": False, "message": ""}


def test_a_reset_fails_the_compare_naming_every_weight_but_the_skipped(served):
    engine, backend = served
    embed = backend.params["model.embed_tokens.weight"].clone()
    engine.check_weights("snapshot")
    assert engine.check_weights("reset_tensors", skip_tensor_list=["embed_tokens"]) == SUCCESS
    assert torch.equal(backend.params["model.embed_tokens.weight"], embed)
    with pytest.raises(EngineRequestError) as failed:
        engine.check_weights("compare")
    assert sorted(_failed_names(failed.value)) == sorted(set(backend.params) - {"model.embed_tokens.weight"})
    assert "expect=raw(shape=" in failed.value.body
    with pytest.raises(EngineRequestError):  # a failed compare keeps its snapshot: the same answer again
        engine.check_weights("compare")
    assert engine.check_weights("compare", skip_tensor_list=["model.", "lm_head"]) == SUCCESS  # what differs is skipped


def test_a_sync_of_the_checkpoint_after_a_reset_compares_equal_and_restores_the_checksum(served, moe_dir):
    engine, _ = served
    before = engine.check_weights("checksum")
    engine.check_weights("snapshot")
    engine.check_weights("reset_tensors")
    assert engine.check_weights("checksum")["per_engine_checksum"] != before["per_engine_checksum"]
    _sync(engine, load_file(moe_dir / "model.safetensors"))
    assert engine.check_weights("compare") == SUCCESS
    assert engine.check_weights("checksum") == before


@pytest.mark.parametrize(
    ("left_out", "named"),
    [
        ("model.layers.2.self_attn.k_proj.weight", "model.layers.2.self_attn.k_proj.weight"),
        ("model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"),  # our fused name
    ],
)
def test_a_sync_that_leaves_a_tensor_out_fails_the_compare_naming_exactly_it(served, moe_dir, left_out, named):
    engine, _ = served
    checkpoint = load_file(moe_dir / "model.safetensors")
    engine.check_weights("snapshot")
    engine.check_weights("reset_tensors")
    _sync(engine, {name: t for name, t in checkpoint.items() if name != left_out})
    with pytest.raises(EngineRequestError, match="/weights_checker compare failed \\(HTTP 400\\)") as failed:
        engine.check_weights("compare")
    assert _failed_names(failed.value) == [named]


def test_a_checksum_answers_sglangs_shape_without_the_rotary_buffers(served):
    engine, backend = served
    body = engine.check_weights("checksum", skip_tensor_list=["layers.3"])
    assert set(body) == {"success", "message", "ranks", "per_engine_checksum"}
    (rank,) = body["ranks"]
    assert set(rank["checksums"]) == {name for name in backend.params if "layers.3" not in name}
    assert all(len(value) == 16 for value in rank["checksums"].values())
    assert rank["parallelism_info"] == [
        {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1}
        | {"pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}
    ]
    assert body["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    assert engine.request("/weights_checker") == engine.check_weights("checksum")  # GET: SGLang's default action


def test_an_unknown_action_is_refused_with_sglangs_message(served):
    engine, _ = served
    with pytest.raises(EngineRequestError, match="Unsupported action='bogus'"):
        engine.check_weights("bogus")


class _InProcessNodes(NodeGroup):
    """Node 0 and node 1's backends in this process: the group's answers without its links."""

    def __init__(self, nodes: list[ReferenceBackend]) -> None:
        self.backend, self.nnodes, self._router = nodes[0], len(nodes), answer
        self._nodes = nodes
        # the group reads only its links' keys (the other nodes): this stand-in answers for them without links
        self._links = dict.fromkeys(range(1, len(nodes)))  # type: ignore[assignment]

    def _submit(self, node, path, query, body):
        return answer(self._nodes[node], path, query, body)

    @staticmethod
    def _wait(ticket):
        return ticket


def test_an_engine_spanning_nodes_checks_every_node_and_gathers_their_checksums(moe_dir):
    nodes = [
        ReferenceBackend(load_model(str(moe_dir), "auto", torch.float32, "cpu"), tp_rank=rank, tp_size=2)
        for rank in range(2)
    ]
    group = _InProcessNodes(nodes)
    status, body = group.answer("/weights_checker", "", {})
    assert status == 200 and [r["parallelism_info"][0]["tp_rank"] for r in body["ranks"]] == [0, 1]
    digest = hashlib.sha256(b"".join(r["per_gpu_checksum"].encode() for r in body["ranks"])).hexdigest()
    assert body["per_engine_checksum"] == digest
    assert group.answer("/weights_checker", "", {"action": "snapshot"}) == (200, SUCCESS)
    with torch.no_grad():
        nodes[1].params["model.norm.weight"].add_(1.0)  # only node 1's replica drifts
    status, failed = group.answer("/weights_checker", "", {"action": "compare"})
    assert status == 400 and failed["message"].split("\n")[1].startswith("name=model.norm.weight ")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8")
    return convert_hf_to_fp8(save_tiny_moe(root / "bf16", all_sparse=True), root / "fp8", BLOCK)


@pytest.fixture
def served_fp8(fp8_dir) -> Iterator[tuple[HttpEngine, ReferenceBackend]]:
    backend = ReferenceBackend(load_model(str(fp8_dir), "auto", torch.float32, "cpu"), fp8_block=fp8_block_of(fp8_dir))
    backend.update_from_disk(str(fp8_dir), version=None)
    with serving(backend, "fp8") as engine:
        yield engine, backend


def test_fp8_weights_differing_within_their_ulps_pass_only_with_allow_quant_error(served_fp8):
    engine, backend = served_fp8
    assert backend.fp8 is not None
    name = "model.layers.0.self_attn.o_proj.weight"
    engine.check_weights("snapshot")
    weight = backend.fp8.weights[name]
    bits = weight.view(torch.uint8)
    magnitude = weight.float().abs()
    bits[(magnitude > 1) & (magnitude < 448)] += 1  # one FP8 step away from zero (448, the largest, has none)
    with pytest.raises(EngineRequestError, match="is_shuffled=False") as failed:
        engine.check_weights("compare")
    assert _failed_names(failed.value) == [name]
    assert engine.check_weights("compare", allow_quant_error=True) == SUCCESS


def test_an_fp8_sync_of_the_checkpoint_after_a_reset_compares_equal(served_fp8, fp8_dir):
    engine, backend = served_fp8
    engine.check_weights("snapshot")
    engine.check_weights("reset_tensors")
    with pytest.raises(EngineRequestError) as failed:
        engine.check_weights("compare", allow_quant_error=True)  # random scales: far beyond any ULP
    assert "model.layers.0.self_attn.q_proj.weight" in _failed_names(failed.value)
    _sync(engine, load_file(fp8_dir.parent / "bf16" / "model.safetensors"), fp8_block=BLOCK)
    assert engine.check_weights("compare") == SUCCESS
