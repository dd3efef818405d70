"""Adapter-only weight sync (``weight_sync/lora_sync.py``) into reference engines that serve LoRA as SGLang 0.5.23.

A reference engine in its own process, started as a LoRA run starts its engines, gets adapters through
``/load_lora_adapter_from_tensors`` (shared-memory payloads, opened across processes) and through ``/load_lora_adapter``
(a PEFT directory): generation then gives the log-probs of the base model with the adapter merged into its weights,
each sync replaces the one before, and results report the sync's weight version. The behaviours the sync's order
rests on (an unload waits for the requests holding its adapter; a version set without aborting) are held on an
in-process engine.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from megatron_rl.config.hf_config import load_hf_config, parse_hf_config
from megatron_rl.config.schema import LoRAConfig, RolloutConfig, WeightSyncConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.engines.engine import EngineError, EngineRequestError
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import (
    GenerateRequest,
    GenerateResult,
    LoadLoRAAdapterFromTensorsRequest,
    LoRASettings,
    SamplingParams,
    lora_adapter_name,
)
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.engine import ReferenceEngine, build_reference_command
from megatron_rl.models.lora_peft import PEFT_PREFIX, peft_adapter_config
from megatron_rl.parallel.local_launch import free_port
from megatron_rl.rollout.policy_adapter import PolicyAdapter
from megatron_rl.rollout.submissions import SubmissionPlanner
from megatron_rl.weight_sync.lora_sync import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    DiskDelivery,
    LoRASyncer,
    TensorDelivery,
    build_lora_syncer,
)
from megatron_rl.wire.tensor_serialization import serialize_named_tensors, serialize_tensor_dict
from tests.distributed_utils import run_distributed
from tests.lora_adapters import random_peft_adapter
from tests.reference_servers import serving
from tests.tiny_checkpoints import save_tiny_dense

LORA = LoRAConfig(rank=4, alpha=8.0)  # every projection of the tiny dense Qwen3; scaling alpha / rank = 2
SETTINGS = LoRASettings.of(LORA)
CONFIG = peft_adapter_config(LORA)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [3, 17, 42, 7, 99]
LOGPROB_TOLERANCE = 2e-3
"""The engine adds ``scaling * B (A x)`` to each projection; the expectation runs the merged weight
``W + scaling * B A``: the same maths summed in another order, fp32 rounding only. The bound of
``test_reference_engine_batching.py::test_the_forward_computes_transformers_logits`` (1e-3 on logits: dot products
of <= 1,024 terms of magnitude <= ~10, reassociated) covers it (here <= 64 terms, plus the rank-4 path), and a
log-prob ``z_i - logsumexp(z)`` moves by at most twice the largest logit change: 2e-3."""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_dense(tmp_path_factory.mktemp("lora-sync") / "dense")


@pytest.fixture(scope="module")
def adapters(hf_dir: Path) -> list[dict[str, torch.Tensor]]:
    """Two random adapters (every A and B nonzero) under PEFT names."""
    arch = parse_hf_config(load_hf_config(hf_dir))
    return [random_peft_adapter(arch, LORA, seed=seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def engine(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceEngine]:
    """A reference server process on the tiny model, started with the LoRA flags of a ``lora:`` recipe."""
    log_dir = tmp_path_factory.mktemp("lora-sync-logs")
    server = ReferenceEngine("lora", hf_dir, free_port(), log_dir=log_dir, lora=SETTINGS)
    server.start()
    try:
        server.wait_healthy(120)
        yield server
    finally:
        server.shutdown()


def _merged_model(hf_dir: Path, adapter: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    """The base model in fp32 with ``W + (alpha / r) B A`` in every adapted projection."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    for name, a in (adapter or {}).items():
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b = adapter[name.replace(".lora_A.", ".lora_B.")]  # type: ignore[index]
            with torch.no_grad():
                modules[module].weight += LORA.alpha / LORA.rank * (b @ a)
    return model


def _expected(model: torch.nn.Module) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, each step a full forward."""
    tokens, logprobs = list(PROMPT), []
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):
            logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
    return tokens[len(PROMPT) :], logprobs


def _generate(engine: HttpEngine, lora_path: str | None) -> tuple[list[int], list[float], str | None]:
    [result] = engine.generate(GenerateRequest(PROMPT, GREEDY, lora_path=lora_path))
    return result.output_ids, result.output_logprobs, result.weight_version


def _assert_serves(engine: HttpEngine, name: str, expected: tuple[list[int], list[float]], version: str) -> None:
    tokens, logprobs, reported = _generate(engine, name)
    assert tokens == expected[0] and reported == version
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected[1]), atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.mark.parametrize("kind", ["tensor", "disk"])
def test_each_sync_serves_base_plus_its_adapter_and_replaces_the_one_before(kind, engine, hf_dir, adapters, tmp_path):
    """Two syncs of one syncer: after each, requests naming ``policy-v{version}`` get the merged model's tokens and
    log-probs and report the version; the first adapter is unloaded (a request naming it is refused, its directory
    gone); requests naming no adapter still get the base model."""
    versions = {"tensor": ("11", "12"), "disk": ("21", "22")}[kind]  # one engine for both: names of their own
    delivery = TensorDelivery([engine]) if kind == "tensor" else DiskDelivery([engine], tmp_path)
    syncer = LoRASyncer([engine], delivery, CONFIG)
    base = _expected(_merged_model(hf_dir, None))
    for adapter, version in zip(adapters, versions, strict=True):
        stats = syncer.sync(adapter, version)
        assert (stats.num_tensors, stats.num_bytes) == (len(adapter), sum(t.nbytes for t in adapter.values()))
        _assert_serves(engine, lora_adapter_name(version), _expected(_merged_model(hf_dir, adapter)), version)
    assert _generate(engine, lora_adapter_name(versions[1]))[0] != base[0], "the adapter must change the outputs"
    with pytest.raises(EngineRequestError, match=f"Failed to implicitly load LoRA adapter policy-v{versions[0]}"):
        _generate(engine, lora_adapter_name(versions[0]))
    tokens, logprobs, reported = _generate(engine, None)
    assert tokens == base[0] and reported == versions[1]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(base[1]), atol=LOGPROB_TOLERANCE, rtol=0)
    if kind == "disk":
        assert sorted(p.name for p in tmp_path.iterdir()) == [lora_adapter_name(versions[1])]
        written = tmp_path / lora_adapter_name(versions[1])
        assert json.loads((written / ADAPTER_CONFIG).read_text()) == CONFIG and (written / ADAPTER_WEIGHTS).is_file()


def test_a_resync_of_the_version_an_engine_holds_counts_as_loaded(engine, hf_dir, adapters):
    """After an engine restart every engine gets the last version again: one that still holds it answers SGLang's
    "already loaded", which the sync takes as loaded (a version's adapter never changes)."""
    syncer = LoRASyncer([engine], TensorDelivery([engine]), CONFIG)
    syncer.sync(adapters[0], "31")
    syncer.sync(adapters[0], "31")
    _assert_serves(engine, "policy-v31", _expected(_merged_model(hf_dir, adapters[0])), "31")


def test_every_request_a_planner_builds_names_the_adapter_of_the_last_sync(served, adapters):
    """New prompts' windows, carried groups' next windows and multi-turn follow-ups all name the adapter the run
    synced last (none before its first sync: the base model, which a fresh adapter with B = 0 equals); the
    engine serves them under that sync's version."""
    client, _ = served
    rollout = RolloutConfig(n_samples_per_prompt=2, max_response_length=8, partial_rollout_tokens=3)
    dataset = PromptDataset([PromptItem(0, PROMPT, "", "tiny")], num_filtered=0)
    adapter = PolicyAdapter()
    planner = SubmissionPlanner(
        dataset, PromptSampler(1, 1), rollout, lambda: client, uid_prefix="g", seed=None, routing_replay=False,
        adapter=adapter,
    )  # fmt: skip
    [fresh] = planner.new([0])
    assert fresh.requests[0].request.lora_path is None
    LoRASyncer([client], TensorDelivery([client]), CONFIG, flush_cache=False).sync(adapters[0], "3")
    adapter.synced(3)
    [first] = planner.new([0])
    progress = first.start()
    carried = planner.continued(first.group)
    follow_up = planner.follow_up(progress, 0)
    assert follow_up is not None
    requests = [first.requests[0].request, *(r.request for r in carried.requests), follow_up.request]
    assert len(requests) == 4 and {r.lora_path for r in requests} == {"policy-v3"}
    results = client.generate(first.requests[0].request)
    assert [r.weight_version for r in results] == ["3", "3"]


def test_engines_start_with_the_lora_flags_of_the_recipe():
    command = build_reference_command("/m", 30000, lora=SETTINGS)
    at = command.index("--enable-lora")
    assert command[at:] == [
        "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", *LORA.target_modules,
        "--max-loras-per-batch", "1",
    ]  # fmt: skip


def test_the_delivery_follows_the_transport_and_no_adapter_goes_by_broadcast(tmp_path):
    engines: list[HttpEngine] = []
    assert isinstance(build_lora_syncer(WeightSyncConfig(), "colocated", engines, CONFIG).delivery, TensorDelivery)
    disaggregated = build_lora_syncer(WeightSyncConfig(), "disaggregated", engines, CONFIG, disk_dir=tmp_path)
    assert isinstance(disaggregated.delivery, DiskDelivery)
    with pytest.raises(ValueError, match="not by broadcast"):
        build_lora_syncer(WeightSyncConfig(transport="distributed"), "disaggregated", engines, CONFIG)


@pytest.fixture
def served(hf_dir: Path) -> Iterator[tuple[HttpEngine, ReferenceBackend]]:
    backend = ReferenceBackend(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), lora=SETTINGS)
    with serving(backend) as client:
        yield client, backend


def _wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _held_request(client: HttpEngine, backend: ReferenceBackend, lora_path: str | None, into: list) -> threading.Thread:
    """A request sent while generation is paused with ``retract``, returned once the engine holds it."""
    backend.pause("retract")
    request = threading.Thread(target=lambda: into.append(_generate(client, lora_path)))
    request.start()
    _wait_for(lambda: backend._in_flight == 1, "the request is held by the pause")
    return request


def test_an_unload_inside_a_retract_pause_waits_for_the_request_holding_its_adapter(served, adapters):
    """SGLang's unload returns only once no request holds the adapter (``lora_registry.wait_for_unload``): inside a
    retract pause with a request holding it, it waits until ``continue`` lets that request end."""
    client, backend = served
    LoRASyncer([client], TensorDelivery([client]), CONFIG, flush_cache=False).sync(adapters[0], "1")
    alone = _generate(client, "policy-v1")
    held: list[tuple[list[int], list[float], str | None]] = []
    request = _held_request(client, backend, "policy-v1", held)
    unloading = threading.Thread(target=lambda: client.unload_lora_adapter("policy-v1"))
    unloading.start()
    unloading.join(timeout=0.5)
    assert unloading.is_alive(), "an unload inside the pause waits for the held request"
    backend.resume_generation()
    unloading.join(timeout=30)
    request.join(timeout=30)
    assert not unloading.is_alive() and held == [alone]


def test_a_request_held_across_a_sync_ends_with_its_adapter_which_is_unloaded_after(served, hf_dir, adapters):
    """The sync loads the next version inside its pause, reports it and continues; the held request ends with the
    adapter it named (reported under the version served now), then the sync's unload of that adapter returns."""
    client, backend = served
    syncer = LoRASyncer([client], TensorDelivery([client]), CONFIG, flush_cache=False)
    syncer.sync(adapters[0], "1")
    alone = _generate(client, "policy-v1")
    held: list[tuple[list[int], list[float], str | None]] = []
    request = _held_request(client, backend, "policy-v1", held)
    syncer.sync(adapters[1], "2")
    request.join(timeout=30)
    assert held == [(alone[0], alone[1], "2")]
    _assert_serves(client, "policy-v2", _expected(_merged_model(hf_dir, adapters[1])), "2")
    with pytest.raises(EngineRequestError, match="Failed to implicitly load LoRA adapter policy-v1"):
        _generate(client, "policy-v1")


def _sync_rank(
    rank: int, world_size: int, ports: list[int], adapter: dict[str, torch.Tensor], tp_sizes: list[int] | None = None
) -> str:
    """One trainer rank of a two-rank sync into ``ports``' engines, engine rank t fed by the trainer rank on its
    device."""
    dist.init_process_group("gloo")
    engines = [HttpEngine(f"engine{i}", "127.0.0.1", port, request_timeout_s=60) for i, port in enumerate(ports)]
    try:
        LoRASyncer(engines, TensorDelivery(engines, tp_sizes), CONFIG, flush_cache=False).sync(adapter, "5")
    except EngineError as error:
        return str(error)
    finally:
        dist.destroy_process_group()
    return "synced"


def test_two_trainer_ranks_each_feed_their_engine_and_a_failure_on_one_raises_on_both(hf_dir, adapters):
    """Rank r feeds engine r; both engines serve the adapter after the collective sync. When one engine refuses it
    (started with a smaller --max-lora-rank), its rank raises the engine's answer, the other rank an error naming
    that rank, and both engines stay paused."""
    small = LoRASettings(2, SETTINGS.target_modules)
    backends = [
        ReferenceBackend(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), lora=settings)
        for settings in (SETTINGS, SETTINGS, small)
    ]
    with serving(backends[0]) as first, serving(backends[1]) as second, serving(backends[2]) as refusing:
        assert run_distributed(_sync_rank, 2, [first.port, second.port], adapters[0]) == ["synced", "synced"]
        assert _generate(first, "policy-v5") == _generate(second, "policy-v5")
        outcomes = run_distributed(_sync_rank, 2, [first.port, refusing.port], adapters[1])
    assert outcomes[0].startswith("the adapter sync failed on trainer rank 1: EngineRequestError")
    assert "is incompatible with the current LoRA memory pool" in outcomes[1]
    assert backends[0]._paused and backends[2]._paused


def test_the_ranks_feeding_one_engine_gather_their_payloads_to_its_tp_rank_0(hf_dir, adapters):
    """An engine of two TP ranks is fed by two trainer ranks: rank 0 posts both payloads in TP-rank order (the
    engine's TP rank 0 here checks their count and loads its own)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    backend = ReferenceBackend(model, tp_rank=0, tp_size=2, lora=SETTINGS)
    with serving(backend) as engine:
        assert run_distributed(_sync_rank, 2, [engine.port], adapters[0], [2]) == ["synced", "synced"]
        _assert_serves(engine, "policy-v5", _expected(_merged_model(hf_dir, adapters[0])), "5")


def test_update_weight_version_answers_as_sglang_and_aborts_only_when_asked(served):
    client, backend = served
    assert client.request("/update_weight_version", {"new_version": "7", "abort_all_requests": False}) == {
        "success": True,
        "message": "Weight version updated to 7",
        "new_version": "7",
    }
    assert _generate(client, None)[2] == "7"
    backend.pause("retract")
    held: list[list[GenerateResult]] = []
    request = threading.Thread(target=lambda: held.append(client.generate(GenerateRequest(PROMPT, GREEDY))))
    request.start()
    _wait_for(lambda: backend._in_flight == 1, "the request is held by the pause")
    client.request("/update_weight_version", {"new_version": "8"})  # SGLang's default: abort every request
    request.join(timeout=30)
    backend.resume_generation()
    assert held[0][0].aborted


def test_a_tensor_payload_is_a_dict_as_sglangs_loader_reads_it(served, adapters):
    """SGLang's loader calls ``tensors.items()`` on an unflattened payload: a dict loads, a list of pairs is
    answered as SGLang answers its AttributeError."""
    client, _ = served
    named = list(adapters[0].items())
    loaded = client.load_lora_adapter_from_tensors(
        LoadLoRAAdapterFromTensorsRequest("as-dict", CONFIG, [serialize_tensor_dict(dict(named))])
    )
    assert loaded.success and loaded.loaded_adapters == {"as-dict": "__tensor__"}
    with pytest.raises(EngineRequestError) as refused:
        client.load_lora_adapter_from_tensors(
            LoadLoRAAdapterFromTensorsRequest("as-list", CONFIG, [serialize_named_tensors(named)])
        )
    assert json.loads(refused.value.body) == {
        "success": False,
        "error_message": "'list' object has no attribute 'items'",
        "loaded_adapters": {"as-dict": "__tensor__"},
    }


def test_a_request_naming_an_unloaded_adapter_gets_it_again_from_its_directory_as_on_sglang(served, adapters, tmp_path):
    """SGLang's implicit reload (``tokenizer_manager.py:3760-3786``): from the directory's contents now, which is why
    the disk delivery writes each version to a directory of its own."""
    client, _ = served
    DiskDelivery([client], tmp_path).deliver(adapters[0], "from-dir", CONFIG)
    loaded = _generate(client, "from-dir")
    client.unload_lora_adapter("from-dir")
    assert _generate(client, "from-dir") == loaded


def test_the_adapter_goes_in_the_engines_dtype(served, hf_dir, adapters):
    """Cast on the trainer as the engine would cast it into its LoRA pool (round to nearest): half an fp32 adapter's
    bytes, and the engine serves exactly the bf16-rounded adapter."""
    client, _ = served
    stats = LoRASyncer([client], TensorDelivery([client], dtype=torch.bfloat16), CONFIG).sync(adapters[0], "4")
    assert stats.num_bytes == sum(t.numel() * 2 for t in adapters[0].values())
    rounded = {name: t.bfloat16().float() for name, t in adapters[0].items()}
    _assert_serves(client, "policy-v4", _expected(_merged_model(hf_dir, rounded)), "4")


def test_a_failed_sync_raises_and_leaves_generation_paused(served, adapters):
    client, backend = served
    syncer = LoRASyncer([client], TensorDelivery([client]), {**CONFIG, "r": 16})  # above --max-lora-rank
    with pytest.raises(EngineError, match="is incompatible with the current LoRA memory pool"):
        syncer.sync(adapters[0], "1")
    assert backend._paused and backend.weight_version == "default"
