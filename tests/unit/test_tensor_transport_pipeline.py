"""The tensor transport keeps one bucket in flight while it packs the next, without changing what arrives.

- buckets reach the engine in order, one request at a time, each with the bytes it had when sent
  (packing bucket k+1 never writes the buffer the engine reads bucket k from);
- ``send_bucket`` returns while its bucket is still loading; ``finish`` returns once it is loaded;
- a bucket that fails in flight fails the next ``send_bucket`` or ``finish``; ``settle`` only waits;
- the reference engine keeps the sender's buffers mapped across syncs (at most the buffers of the
  last sync), and every sync still lands exactly, also when the sender's buffers grow;
- CPU tensors already in shared memory are sent in place (the engine reads the sender's memory, the
  one copy is the engine's), private ones are packed and stay private;
- tensors written into the bucket memory the transport hands out are sent in place, bucket k+1 is
  written into the other buffer while bucket k is in flight, a repeated sync reuses the same two
  buffers, and a bucket that lacks a tensor allocated for it is refused.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.engines.protocol import UpdateWeightsFromTensorRequest
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.shared_buffers import SharedBufferMappings
from megatron_rl.weight_sync.buckets import BucketFiller
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import TensorTransport
from megatron_rl.wire.tensor_serialization import FLATTENED_BUCKET, deserialize_payload, serialize_named_tensors
from tests.fake_engines import PartialEngine
from tests.tiny_checkpoints import save_tiny_moe


class RecordingEngine(PartialEngine):
    """Receives tensor updates as an engine does (opens the IPC payload, copies it out) and records them.

    Each update waits for ``gate`` before it reads, so a test can hold a bucket in flight.
    """

    name = "recording"

    def __init__(self, fail_on: int | None = None) -> None:
        self.gate = threading.Event()
        self.received: list[list[tuple[str, torch.Tensor]]] = []
        self.read_from: list[list[int]] = []
        self.formats: list[str | None] = []
        self.concurrent = self.max_concurrent = 0
        self.fail_on = fail_on
        self._lock = threading.Lock()

    def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> None:
        with self._lock:
            self.concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            assert self.gate.wait(30), "the test never opened the gate"
            if self.fail_on == len(self.received):
                self.received.append([])
                raise RuntimeError(f"bucket {self.fail_on} refused")
            (payload,) = request.serialized_named_tensors
            opened = deserialize_payload(payload, request.load_format)
            self.formats.append(request.load_format)
            self.read_from.append([t.data_ptr() for _, t in opened])
            self.received.append([(name, t.clone()) for name, t in opened])
        finally:
            with self._lock:
                self.concurrent -= 1


def _bucket(index: int, numel: int = 1000) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{index}.{j}", torch.full((numel,), float(10 * index + j))) for j in range(3)]


def test_buckets_arrive_in_order_with_the_bytes_they_were_sent_with():
    engine = RecordingEngine()
    transport = TensorTransport([engine])
    buckets = [_bucket(i, numel=1000 * (i + 1)) for i in range(5)]
    transport.send_bucket(buckets[0], "v")
    assert not engine.received, "send_bucket waited for the engine"
    for bucket in buckets[1:]:
        engine.gate.set()
        transport.send_bucket(bucket, "v")
    transport.finish("v")
    assert engine.max_concurrent == 1
    assert len(engine.received) == len(buckets)
    for sent, got in zip(buckets, engine.received, strict=True):
        assert [name for name, _ in got] == [name for name, _ in sent]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sent, got, strict=True))
    transport.close()


def test_a_bucket_in_one_buffer_goes_as_one_flattened_tensor():
    """The first sync sizes the buffer (its bucket straddles two, so it goes tensor by tensor); every later
    sync's bucket lies in one buffer and goes as SGLang's flattened_bucket, with the same bytes arriving."""
    engine = RecordingEngine()
    engine.gate.set()
    transport = TensorTransport([engine])
    for sync in range(3):
        transport.begin(f"v{sync}")
        bucket = [(name, t + sync) for name, t in _bucket(0)]
        transport.send_bucket(bucket, f"v{sync}")
        transport.finish(f"v{sync}")
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bucket, engine.received[-1], strict=True))
    assert engine.formats == [None, FLATTENED_BUCKET, FLATTENED_BUCKET]
    transport.close()


def test_a_bucket_that_fails_in_flight_fails_the_next_call():
    engine = RecordingEngine(fail_on=1)
    engine.gate.set()
    transport = TensorTransport([engine])
    transport.send_bucket(_bucket(0), "v")
    transport.send_bucket(_bucket(1), "v")
    with pytest.raises(RuntimeError, match="bucket 1 refused"):
        transport.finish("v")
    transport.send_bucket(_bucket(2), "v")
    transport.settle()
    assert len(engine.received) == 3 and engine.received[2][0][0] == "w2.0"
    engine.fail_on = 3
    transport.send_bucket(_bucket(3), "v")
    transport.settle()  # logs the failure, raises nothing
    transport.close()


def test_shared_memory_tensors_are_sent_in_place_and_private_ones_packed():
    engine = RecordingEngine()
    engine.gate.set()
    transport = TensorTransport([engine])
    weights = torch.arange(12.0).share_memory_()
    private = torch.full((5,), 7.0)
    bucket = [("row", weights.view(3, 4)[1]), ("private", private), ("all", weights)]
    transport.send_bucket(bucket, "v")
    transport.finish("v")
    (read_from,) = engine.read_from
    assert read_from[0] == weights.view(3, 4)[1].data_ptr() and read_from[2] == weights.data_ptr()
    assert read_from[1] != private.data_ptr() and not private.is_shared()
    (received,) = engine.received
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bucket, received, strict=True))
    transport.close()


def _fill_allocated(transport: TensorTransport, engine: RecordingEngine, count: int) -> list[int]:
    """One sync of ``count`` tensors of 1000 floats (value i), two per bucket, written into the transport's
    memory; the gate opens only when bucket 1 is written, so bucket 0 is in flight meanwhile."""
    transport.begin("v")
    filler = BucketFiller(8000, lambda bucket: transport.send_bucket(bucket, "v"), transport.allocate)
    allocate = filler.allocate
    assert allocate is not None, "the tensor transport hands out bucket memory"
    pointers = []
    for i in range(count):
        if i == 4:
            engine.gate.set()
        (tensor,) = allocate([(1000,)], torch.float32)
        filler.add(f"w{i}", tensor.fill_(float(i)))
        pointers.append(tensor.data_ptr())
    filler.flush()
    transport.finish("v")
    engine.gate.clear()
    return pointers


def test_tensors_written_into_bucket_memory_go_in_place_and_never_over_a_bucket_in_flight():
    engine = RecordingEngine()
    transport = TensorTransport([engine])
    # the first sync grows the buffers (and torch moves each new one to a named shared-memory file
    # on its first send); the second sync writes into the same two buffers
    for _ in range(2):
        engine.received.clear()
        engine.read_from.clear()
        pointers = _fill_allocated(transport, engine, 6)
        assert [[name for name, _ in got] for got in engine.received] == [["w0", "w1"], ["w2", "w3"], ["w4", "w5"]]
        for got in engine.received:
            assert all(torch.equal(t, torch.full((1000,), float(name[1:]))) for name, t in got)
    assert [p for read in engine.read_from for p in read] == pointers  # in place: no pack
    assert engine.read_from[0] == engine.read_from[2]  # bucket 2 reuses bucket 0's buffer
    assert not set(engine.read_from[0]) & set(engine.read_from[1])
    transport.close()


def test_a_bucket_without_a_tensor_allocated_for_it_is_refused():
    engine = RecordingEngine()
    engine.gate.set()
    transport = TensorTransport([engine])
    assert transport.allocate is not None, "the tensor transport hands out bucket memory"
    kept, dropped = transport.allocate([(4,), (4,)], torch.float32)
    with pytest.raises(RuntimeError, match=r"1 tensor\(s\) allocated .* not in the bucket"):
        transport.send_bucket([("kept", kept.zero_())], "v")
    del dropped
    transport.close()


def test_shared_buffer_mappings_keep_only_the_last_syncs_buffers():
    first, second = torch.zeros(8).share_memory_(), torch.zeros(8).share_memory_()
    mappings = SharedBufferMappings()
    mappings.hold([("a", first), ("b", second[2:])])
    mappings.end_sync()
    assert len(mappings) == 2
    mappings.hold([("a", second)])
    assert len(mappings) == 2
    mappings.end_sync()
    assert len(mappings) == 1
    mappings.end_sync()
    assert len(mappings) == 0


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    hf_dir = save_tiny_moe(tmp_path_factory.mktemp("hf") / "moe")
    return ReferenceBackend(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32))


class InProcessEngine(PartialEngine):
    """The reference backend called directly (no HTTP): what the server does with each request."""

    name = "in-process"

    def __init__(self, backend: ReferenceBackend) -> None:
        self.backend = backend

    def update_weights_from_tensor(self, request: UpdateWeightsFromTensorRequest) -> None:
        self.backend.update_from_tensor(
            request.serialized_named_tensors, request.weight_version, load_format=request.load_format
        )

    def pause_generation(self, mode: str = "retract") -> None:
        self.backend.pause(mode)

    def continue_generation(self) -> None:
        self.backend.resume_generation()

    def flush_cache(self) -> None:
        assert self.backend.flush_cache()

    def begin_weight_update(self) -> None:
        self.backend.begin_weight_update()

    def end_weight_update(self) -> None:
        self.backend.end_weight_update()


@pytest.mark.parametrize("bucket_bytes", [1 << 10, 1 << 14])
def test_repeated_syncs_through_kept_mappings_land_exactly(backend, bucket_bytes):
    engine = InProcessEngine(backend)
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=bucket_bytes)
    names = sorted(backend.params)
    largest_first = sorted(names, key=lambda n: -backend.params[n].numel())
    # the third sync sends the largest tensors first, so both buffers grow and the old ones are let go
    orders = [names, names, largest_first, largest_first]
    for step, order in enumerate(orders, start=1):
        generator = torch.Generator().manual_seed(step)
        named = [(name, torch.randn(backend.params[name].shape, generator=generator)) for name in order]
        stats = syncer.sync(named, f"step-{step}")
        assert stats.num_buckets > 2
        assert all(torch.equal(backend.params[name], t) for name, t in named), step
        if order is orders[step - 2]:  # no buffer grew in this sync: only its two buffers stay mapped
            assert len(backend._shared_buffers) == TensorTransport.NUM_BUFFERS
    syncer.close()


def test_syncs_from_shared_memory_weights_land_exactly_without_packing(backend):
    engine = InProcessEngine(backend)
    syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=1 << 14)
    names = sorted(backend.params)
    weights = {name: torch.empty(backend.params[name].shape).share_memory_() for name in names}
    for step in (1, 2):
        generator = torch.Generator().manual_seed(10 + step)
        for tensor in weights.values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
        stats = syncer.sync(list(weights.items()), f"shared-{step}")
        assert stats.num_buckets > 2
        assert all(torch.equal(backend.params[name], weights[name]) for name in names), step
        assert len(backend._shared_buffers) == len(weights)  # the engine holds the sender's own storages
    syncer.close()


def test_the_reference_engine_refuses_a_load_format_sglang_does_not_know(backend):
    payload = serialize_named_tensors([("model.norm.weight", torch.ones(4))])
    with pytest.raises(ValueError, match="^Unknown load_format=safetensors$"):
        backend.update_from_tensor([payload], "v", load_format="safetensors")


def test_the_reference_engine_refuses_a_session_fed_by_two_processes(backend, tmp_path):
    """Within a weight-update session all of an engine rank's tensors come from one process (the trainer
    rank on its device); the next session may come from another, and the engine logs who feeds it."""
    import multiprocessing
    import os

    from megatron_rl.engines.reference.backend import WeightUpdateRefused
    from megatron_rl.wire.tensor_serialization import shared_memory_owners

    name, tensor = next(iter(backend.params.items()))
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        foreign, foreign_pid = pool.apply(_shared_payloads_elsewhere, (name, tuple(tensor.shape), 3))
        assert shared_memory_owners(deserialize_payload(foreign[0], None)) == {foreign_pid}
        own = tensor.detach().clone().share_memory_()
        own_payload = serialize_named_tensors([(name, own)])
        assert shared_memory_owners(deserialize_payload(own_payload, None)) == {os.getpid()}
        backend.begin_weight_update()
        backend.update_from_tensor([serialize_named_tensors([(name, own)])], "v1")
        with pytest.raises(WeightUpdateRefused, match="fed by the one trainer rank placed on its device"):
            backend.update_from_tensor([foreign[1]], "v1")
        backend.end_weight_update()
        backend.begin_weight_update()
        backend.update_from_tensor([foreign[2]], "v2")
        backend.end_weight_update()
    assert backend.weight_version == "v2"


_KEEP_ALIVE: list[torch.Tensor] = []


def _shared_payloads_elsewhere(name: str, shape: tuple[int, ...], count: int) -> tuple[list[str], int]:
    """``count`` payloads (each opens once) of one shared-memory tensor of this spawned process, and its pid."""
    import os

    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")  # a named file from the start, kept by _KEEP_ALIVE
    tensor = torch.zeros(shape).share_memory_()
    _KEEP_ALIVE.append(tensor)
    return [serialize_named_tensors([(name, tensor)]) for _ in range(count)], os.getpid()
