"""The reference engine answers as SGLang 0.5.23 does, and our client and syncer speak that protocol.

An in-process reference server (a tiny Qwen3-MoE, random weights) driven by
the same ``HttpEngine`` client that drives SGLang. Each rule names its SGLang
source in docs/architecture.md ("The reference engine as SGLang's twin"):

- tensor / distributed weight updates only inside ``/begin_weight_update`` ...
  ``/end_weight_update`` (400 ``success: false`` otherwise, a second begin is a 400);
- ``/flush_cache`` answers plain text without a Content-Type, 400 while a request
  is held by an ``in_place`` pause, 200 once it is held by ``retract`` (the held
  request then re-prefills: greedy outputs equal an uninterrupted run's);
- with ``dp_size > 1`` weight updates fail SGLang's assertion (500, plain text);
- the syncer wraps a tensor sync in a session and leaves none open.
"""

from __future__ import annotations

import http.client
import multiprocessing
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.engines.engine import EngineRequestError
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.engines.protocol import (
    FLUSH_CACHE_FAILED,
    FLUSH_CACHE_OK,
    FORWARD_SECONDS_METRIC,
    IDLE_SECONDS_METRIC,
    GenerateRequest,
    SamplingParams,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    metric_samples,
)
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import TensorTransport
from megatron_rl.wire.tensor_serialization import serialize_named_tensors
from tests.reference_servers import serving
from tests.tiny_checkpoints import save_tiny_moe

NORM = "model.norm.weight"
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp("hf") / "moe")


def _serve(hf_dir, dp_size: int = 1) -> Iterator[tuple[HttpEngine, ReferenceBackend]]:
    backend = ReferenceBackend(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), dp_size=dp_size)
    with serving(backend) as engine:
        yield engine, backend


@pytest.fixture
def served(hf_dir):
    yield from _serve(hf_dir)


def _tensor_update(value: float) -> UpdateWeightsFromTensorRequest:
    payload = serialize_named_tensors([(NORM, torch.full((32,), value))])
    return UpdateWeightsFromTensorRequest([payload], flush_cache=False, weight_version=str(value))


def test_tensor_update_outside_a_session_is_refused_as_sglang_does(served):
    engine, backend = served
    before = backend.params[NORM].clone()
    with pytest.raises(EngineRequestError) as refused:
        engine.update_weights_from_tensor(_tensor_update(2.0))
    assert refused.value.status == 400
    assert "must run between begin_weight_update() and end_weight_update()" in refused.value.body
    assert torch.equal(backend.params[NORM], before)
    engine.begin_weight_update()
    engine.update_weights_from_tensor(_tensor_update(2.0))
    engine.end_weight_update()
    assert torch.equal(backend.params[NORM], torch.full((32,), 2.0))


def test_distributed_update_outside_a_session_is_refused(served):
    engine, _ = served
    request = UpdateWeightsFromDistributedRequest([NORM], ["float32"], [[32]], "g", flush_cache=False)
    with pytest.raises(EngineRequestError) as refused:
        engine.update_weights_from_distributed(request)
    assert refused.value.status == 400 and "begin_weight_update()" in refused.value.body


def test_one_session_at_a_time(served):
    engine, _ = served
    with pytest.raises(EngineRequestError, match="no weight-update session is open"):
        engine.end_weight_update()
    engine.begin_weight_update()
    with pytest.raises(EngineRequestError, match="a weight-update session is already open") as second:
        engine.begin_weight_update()
    assert second.value.status == 400
    engine.end_weight_update()


def test_flush_cache_answers_plain_text_without_a_content_type(served):
    engine, _ = served
    assert engine.request("/flush_cache", {}) == FLUSH_CACHE_OK
    engine.flush_cache()
    with urllib.request.urlopen(engine.base_url + "/flush_cache?timeout=1", data=b"") as response:
        assert response.status == 200 and response.headers.get("Content-Type") is None
        assert response.read().decode() == FLUSH_CACHE_OK


def _generate_in_thread(engine: HttpEngine, results: list, request: GenerateRequest | None = None) -> threading.Thread:
    request = request or GenerateRequest([5, 17, 42], GREEDY)
    thread = threading.Thread(target=lambda: results.extend(engine.generate(request)))
    thread.start()
    return thread


def _wait_decoding(backend: ReferenceBackend, timeout_s: float = 30.0) -> None:
    """Until one request is decoding (held at its first token by the pause)."""
    deadline = time.monotonic() + timeout_s
    while backend._decoding != 1:
        assert time.monotonic() < deadline, "no request started decoding"
        time.sleep(0.01)


def test_flush_is_refused_while_a_request_is_held_in_place_and_accepted_under_retract(served):
    engine, backend = served
    uninterrupted = engine.generate(GenerateRequest([5, 17, 42], GREEDY))[0].output_ids
    engine.pause_generation("in_place")
    results: list = []
    thread = _generate_in_thread(engine, results)
    _wait_decoding(backend)
    with pytest.raises(EngineRequestError) as refused:
        engine.flush_cache()
    assert refused.value.status == 400 and refused.value.body == FLUSH_CACHE_FAILED
    engine.pause_generation("retract")
    engine.flush_cache()  # the held request dropped its cache: it re-prefills when generation continues
    engine.continue_generation()
    thread.join(60)
    assert results[0].output_ids == uninterrupted and results[0].finish_reason.type == "length"


def test_weight_updates_with_dp_above_1_fail_the_dp_assertion(hf_dir):
    for engine, _ in _serve(hf_dir, dp_size=2):
        engine.begin_weight_update()
        with pytest.raises(EngineRequestError) as failed:
            engine.update_weights_from_tensor(_tensor_update(3.0))
        assert failed.value.status == 500 and failed.value.body == "Internal Server Error"


def test_syncer_wraps_a_tensor_sync_in_one_session(served):
    engine, backend = served
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=1 << 20)
    for step in (1, 2):
        named = [(name, torch.full_like(p, float(step))) for name, p in backend.params.items() if p.dim() == 1]
        syncer.sync(named, f"step-{step}")
        assert all(torch.equal(backend.params[name], t) for name, t in named)
    assert not backend._session and backend.weight_version == "step-2"
    syncer.close()


def test_a_sync_of_many_buckets_reuses_its_connections(served, monkeypatch):
    """The transport calls the engine from threads it keeps, so a sync opens no connection per bucket."""
    engine, backend = served
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=1)  # one tensor per bucket
    named = [(name, torch.full_like(p, 2.0)) for name, p in backend.params.items() if p.dim() == 1]
    syncer.sync(named, "first")
    connects: list[int] = []
    opened = http.client.HTTPConnection.connect

    def counted_connect(self: http.client.HTTPConnection) -> None:
        connects.append(1)
        opened(self)

    monkeypatch.setattr(http.client.HTTPConnection, "connect", counted_connect)
    stats = syncer.sync(named, "second")
    syncer.close()
    assert stats.num_buckets == len(named) > 10 and backend.weight_version == "second"
    assert connects == []


def test_abort_follows_sglangs_rid_registry(served):
    """Unknown rids are ignored (also when the request arrives later); each of n samples is aborted by its own
    id (``{rid}_{i}``, the group's rid reaches none), and ``HttpEngine.abort(rid)`` aborts them all."""
    engine, backend = served
    engine.request("/abort_request", {"rid": "later", "abort_all": False})
    (early,) = engine.generate(GenerateRequest([5, 17, 42], GREEDY, rid="later"))
    assert early.finish_reason.type == "length"

    three = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, n=3)
    cases = (
        (lambda: engine.request("/abort_request", {"rid": "g", "abort_all": False}), ["length"] * 3),
        (lambda: engine.request("/abort_request", {"rid": "g_1", "abort_all": False}), ["length", "abort", "length"]),
        (lambda: engine.abort("g"), ["abort"] * 3),
    )
    for abort, expected in cases:
        engine.pause_generation("in_place")
        results: list = []
        thread = _generate_in_thread(engine, results, GenerateRequest([5], three, rid="g"))
        _wait_decoding(backend)
        abort()
        engine.continue_generation()
        thread.join(60)
        assert [r.finish_reason.type for r in results] == expected
        assert [r.rid for r in results] == ["g_0", "g_1", "g_2"]


def test_parallel_sampling_names_its_samples_itself_as_sglang_does(served):
    """A prompt sent with n > 1 in its sampling params (SGLang's parallel sampling, not what our client sends)
    gets fresh sample ids: neither the rid nor ``{rid}_{i}`` reaches them."""
    engine, backend = served
    body = {"input_ids": [5], "rid": "p", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "n": 2}}
    engine.pause_generation("in_place")
    answer: list = []
    thread = threading.Thread(target=lambda: answer.extend(engine.request("/generate", body)))
    thread.start()
    _wait_decoding(backend)
    for rid in ("p", "p_0", "p_1"):
        engine.request("/abort_request", {"rid": rid, "abort_all": False})
    engine.continue_generation()
    thread.join(60)
    assert [a["meta_info"]["finish_reason"]["type"] for a in answer] == ["length", "length"]
    assert not any(a["meta_info"]["id"].startswith("p") for a in answer)


def test_a_batch_must_repeat_one_prompt(served):
    engine, _ = served
    body = {"input_ids": [[5], [6]], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(EngineRequestError, match="must repeat one prompt"):
        engine.request("/generate", body)


def test_per_sample_seeds_are_refused_the_reference_engine_seeds_a_request(served):
    """SGLang's form of one seed per sample (a batch of sampling_params) is refused, not silently ignored."""
    engine, _ = served
    request = GenerateRequest([5, 17], SamplingParams(max_new_tokens=2, n=2), sample_seeds=[1, 2])
    with pytest.raises(EngineRequestError, match="seeds a request, not each sample"):
        engine.generate(request)


def test_a_failed_sync_closes_the_session_and_keeps_generation_paused(served):
    """A bucket the engine refuses (an unknown tensor name) fails the sync; a retried sync can begin again."""
    engine, backend = served
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=1 << 20)
    with pytest.raises(EngineRequestError, match="not a weight of this model"):
        syncer.sync([("model.no_such.weight", torch.zeros(3))], "broken")
    assert not backend._session and backend._paused
    syncer.sync([(NORM, torch.full((32,), 7.0))], "retried")
    assert not backend._session and not backend._paused and backend.weight_version == "retried"
    syncer.close()


def test_metrics_count_forward_seconds_under_sglangs_counter(served):
    """``GET /metrics``: SGLang's forward seconds by forward mode and scheduler idle seconds, Prometheus text."""
    engine, _ = served
    with urllib.request.urlopen(engine.base_url + "/metrics", timeout=10) as response:
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        before = response.read().decode()
    time.sleep(0.05)
    engine.generate(GenerateRequest([5, 17, 42], GREEDY))
    after = engine.request("/metrics")

    def by_mode(text: str) -> dict[str, float]:
        return {labels["category"]: value for labels, value in metric_samples(text, FORWARD_SECONDS_METRIC)}

    assert set(by_mode(after)) == {"extend", "decode"}
    assert all(by_mode(after)[mode] > by_mode(before)[mode] for mode in ("extend", "decode"))
    (idle_before,), (idle_after,) = (
        metric_samples(before, IDLE_SECONDS_METRIC),
        metric_samples(after, IDLE_SECONDS_METRIC),
    )
    assert idle_after[1] >= idle_before[1] + 0.05


def _ask_many(engine: HttpEngine, rounds: int) -> None:
    for _ in range(rounds):
        assert engine.request("/model_info", timeout_s=20)["weight_version"] == "default"


def test_forked_processes_open_their_own_connections(served):
    """A rank forked from a process that used the engine does not reuse that process's kept-alive socket:
    parent and two children asking at once all get their answers (sharing it, a child read another's)."""
    engine, _ = served
    _ask_many(engine, 1)
    context = multiprocessing.get_context("fork")
    children = [context.Process(target=_ask_many, args=(engine, 200)) for _ in range(2)]
    for child in children:
        child.start()
    _ask_many(engine, 200)
    for child in children:
        child.join(60)
    assert [child.exitcode for child in children] == [0, 0]
