"""Engines hosted by Ray actors on a local Ray, and the colocated memory hand-over on a live reference engine.

Real processes throughout: the host actor launches our reference server, the driver side
talks to it over HTTP. The hand-over test records the calls as they reach the engine and the
trainer ranks; the trainer stand-in delivers weights with the engine's own disk update.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import PlacementGroup

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.engines import (
    EngineRequestError,
    EngineStartupError,
    EngineUnavailableError,
    GenerateRequest,
    HttpEngine,
    SamplingParams,
)
from megatron_rl.engines.protocol import UpdateWeightsFromDiskRequest
from megatron_rl.orchestration import engine_host
from megatron_rl.orchestration.engine_host import EngineHosts, EngineSpec
from megatron_rl.orchestration.memory_handover import ColocatedHandOver, release_engine_caches
from megatron_rl.orchestration.placement_group import create_rank_slots
from megatron_rl.plan.placement import ActorResources
from tests.tiny_checkpoints import save_tiny_moe

pytestmark = pytest.mark.distributed
HOST = ActorResources(num_gpus=0.0, num_cpus=0.5)
REQUEST = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=11))


@pytest.fixture(scope="module")
def bundles() -> Iterator[PlacementGroup]:
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    placement, _ = create_rank_slots(2, num_gpus=0, num_cpus=0.5)
    yield placement
    ray.util.remove_placement_group(placement)
    ray.shutdown()


API_KEY = "host-test-key"


def _spec(name: str, model: Path, log_dir: Path, startup_timeout_s: float = 120.0) -> EngineSpec:
    rollout = RolloutConfig(engine="reference", startup_timeout_s=startup_timeout_s)
    return EngineSpec(name, "reference", str(model), str(log_dir), rollout, seed=3, api_key=API_KEY)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


class _Recording(HttpEngine):
    """The engine's HTTP client, logging each memory call into ``log`` before sending it."""

    def __init__(self, engine: HttpEngine, log: list[tuple[str, ...]]) -> None:
        super().__init__(engine.name, engine.host, engine.port, api_key=API_KEY)
        self.log = log

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        assert tags is not None, "the run names the memory it releases"
        self.log.append(("engine.release", *tags))
        super().release_memory(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        assert tags is not None, "the run names the memory it resumes"
        self.log.append(("engine.resume", *tags))
        super().resume_memory(tags)


class _Trainers:
    """Stands in for the trainer ranks: records calls; a sync reloads ``weights_dir`` into the engine."""

    def __init__(self, engine: HttpEngine, weights_dir: Path, log: list[tuple[str, ...]]) -> None:
        self.engine, self.weights_dir, self.log = engine, weights_dir, log

    def offload(self, *, keep_params: bool = False) -> None:
        self.log.append(("trainer.offload", "keep_params=True") if keep_params else ("trainer.offload",))

    def reload(self) -> None:
        self.log.append(("trainer.reload",))

    def sync_weights(self, version: int) -> float:
        self.log.append(("trainer.sync_weights", str(version)))
        self.engine.update_weights_from_disk(
            UpdateWeightsFromDiskRequest(str(self.weights_dir), weight_version=str(version))
        )
        return 0.0


def test_hosted_engine_generates_and_dies_with_its_actor(bundles: PlacementGroup, tmp_path: Path) -> None:
    model = save_tiny_moe(tmp_path / "moe")
    hosts = EngineHosts([_spec("ref0", model, tmp_path)], bundles, [0], HOST)
    try:
        with pytest.raises(RuntimeError, match="wait_healthy"):
            hosts.clients  # noqa: B018  (the engine is starting: no client yet)
        hosts.wait_healthy()
        (client,) = hosts.clients
        assert hosts.addresses[0][:2] == ("ref0", "127.0.0.1")  # the spec's network: loopback (one node)
        client.request("/health")
        with pytest.raises(EngineRequestError, match="refused this run's API key"):
            HttpEngine("stranger", client.host, client.port).generate(REQUEST)
        (first,) = client.generate(REQUEST)
        assert len(first.output_ids) > 0 and len(first.output_logprobs) == len(first.output_ids)

        log: list[tuple[str, ...]] = []
        engine = _Recording(client, log)
        release_engine_caches([engine])  # start-up state: weights kept, caches released
        hand_over = ColocatedHandOver([engine], _Trainers(engine, model, log))
        hand_over.to_rollout()
        hand_over.to_training()
        with pytest.raises(EngineRequestError, match="weights are released"):
            engine.generate(REQUEST)
        hand_over.sync_weights(5)
        hand_over.to_rollout()
        hand_over.to_rollout()  # idempotent: nothing moves twice
        (again,) = engine.generate(REQUEST)
        assert again.output_ids == first.output_ids and again.output_logprobs == first.output_logprobs
        assert again.weight_version == "5"
        assert log == [
            ("engine.release", "kv_cache", "cuda_graph"),
            ("trainer.offload",),
            ("engine.resume", "kv_cache", "cuda_graph"),
            ("engine.release", "weights", "kv_cache", "cuda_graph"),
            ("trainer.reload",),
            ("trainer.offload", "keep_params=True"),
            ("engine.resume", "weights"),
            ("trainer.sync_weights", "5"),
            ("trainer.offload",),
            ("engine.resume", "kv_cache", "cuda_graph"),
        ]
        del log[:]
        hand_over.to_training()  # a checkpoint: nothing is synced before the next rollout re-syncs version 5
        hand_over.to_rollout()
        assert log == [
            ("engine.release", "weights", "kv_cache", "cuda_graph"),
            ("trainer.reload",),
            ("trainer.offload", "keep_params=True"),
            ("engine.resume", "weights"),
            ("trainer.sync_weights", "5"),
            ("trainer.offload",),
            ("engine.resume", "kv_cache", "cuda_graph"),
        ]
        assert engine.generate(REQUEST)[0].output_ids == first.output_ids

        (pid,) = hosts.pids()
        assert pid is not None
        assert _alive(pid)
        hosts._hosts[0][0].kill()  # the actor dies without shutting its engine down
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the engine outlived its host actor"
    finally:
        hosts.close()


def test_engine_that_dies_is_reported_to_the_driver_with_its_log_tail(bundles: PlacementGroup, tmp_path: Path) -> None:
    model = save_tiny_moe(tmp_path / "moe")
    hosts = EngineHosts([_spec("ref1", model, tmp_path)], bundles, [0], HOST)
    try:
        hosts.wait_healthy()
        (client,) = hosts.clients
        (pid,) = hosts.pids()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        log_tail = r"exited with code -9; log tail:\n.*reference-engine INFO serving .* on http://"
        with pytest.raises(EngineUnavailableError, match=rf"(?s)engine ref1: /generate failed at .*{log_tail}"):
            client.generate(REQUEST)
    finally:
        hosts.close()


def test_engine_that_cannot_start_is_a_clear_error(bundles: PlacementGroup, tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(EngineStartupError, match="(?s)engine bad0 failed to start.*log tail:.*no config.json"):
        EngineHosts(
            [_spec("bad0", tmp_path / "no-such-model", tmp_path, startup_timeout_s=60)], bundles, [1], HOST
        ).wait_healthy()
    assert time.monotonic() - started < 60


def test_an_engine_whose_port_was_taken_meanwhile_starts_again_on_fresh_ports(
    bundles: PlacementGroup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ports an engine gets are free when picked; another process may bind one before the engine does."""
    model = save_tiny_moe(tmp_path / "moe")
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks: list[list[int]] = []

    def first_pick_taken(count: int, host: str) -> list[int]:
        ports = real_free_ports(count, host)
        picks.append([taken.getsockname()[1], *ports[1:]] if not picks else ports)
        return picks[-1]

    real_free_ports = engine_host.free_ports
    monkeypatch.setattr(engine_host, "free_ports", first_pick_taken)
    host = engine_host.EngineHost()
    try:
        name, _, port = host.start(_spec("retry0", model, tmp_path))
    finally:
        host.shutdown()
        taken.close()
    assert name == "retry0" and len(picks) == 2 and port == picks[1][0] != picks[0][0]
    assert "Address already in use" in (tmp_path / "retry0.log").read_text()
