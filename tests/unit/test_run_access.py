"""Where a run listens and who may use its engines: address choice, the API key, redaction, bound stores.

The reference server's key check is compared request by request with SGLang's own app in
``test_sglang_protocol.py`` (needs sglang); here it is checked on its own, with our client.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from collections import namedtuple
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.config.schema import ClusterConfig, RolloutConfig
from megatron_rl.config.sglang_env import SGLANG_PYTHON_ENV
from megatron_rl.engines import (
    EngineRequestError,
    GenerateRequest,
    HttpEngine,
    ReferenceEngine,
    SamplingParams,
    SGLangPlacement,
    build_sglang_command,
)
from megatron_rl.engines.access import API_KEY_ENV, check_listen_host, is_authorized, new_api_key
from megatron_rl.engines.reference.backend import ReferenceBackend
from megatron_rl.engines.reference.engine import build_reference_command
from megatron_rl.engines.reference.server import build_server
from megatron_rl.engines.server_process import ServerProcess
from megatron_rl.orchestration.engine_host import EngineHost, EngineSpec, free_ports
from megatron_rl.orchestration.network import NetworkError, RunNetwork, interface_address
from megatron_rl.parallel.local_launch import free_port
from megatron_rl.parallel.stores import rendezvous_store
from tests.tiny_checkpoints import save_tiny_moe

Address = namedtuple("Address", "family address netmask broadcast ptp")
KEY = "k3y-of-this-run"


def _interfaces(**interfaces: list[tuple[str, str]]) -> dict[str, list[Address]]:
    return {
        name: [Address(socket.AF_INET, address, netmask, None, None) for address, netmask in addresses]
        for name, addresses in interfaces.items()
    }


@pytest.fixture
def fake_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    table = _interfaces(
        lo=[("127.0.0.1", "255.0.0.0")],
        eth0=[("192.0.2.7", "255.255.255.0")],
        ib0=[("10.1.0.5", "255.255.0.0"), ("10.2.0.5", "255.255.0.0")],
        ib1=[],
    )
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: table)  # the module network reads the interfaces from


# ---------------------------------------------------------------- where the run listens


def test_a_one_node_run_listens_on_loopback_whatever_the_node_address(fake_interfaces: None) -> None:
    network = RunNetwork.of(ClusterConfig(nodes=1, network_interface="ib0"))
    assert network.is_loopback and network.address("192.0.2.7") == network.address() == "127.0.0.1"
    assert network.environment() == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_several_nodes_listen_on_the_named_interface(fake_interfaces: None) -> None:
    network = RunNetwork.of(ClusterConfig(nodes=2, gpus_per_node=8, network_interface="ib0"))
    assert network.address("10.2.7.1") == "10.2.7.1"  # Ray's node address lies on the interface: kept
    assert network.address("192.0.2.7") == "10.1.0.5"  # Ray runs on eth0: the interface's first address
    assert network.address() == "10.1.0.5"
    assert network.environment() == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert RunNetwork("lo").address("127.0.0.2") == "127.0.0.2"  # the two-raylet test's second "node"


def test_a_node_without_the_interface_is_named_with_the_interfaces_it_has(fake_interfaces: None) -> None:
    with pytest.raises(NetworkError, match=r"node 192.0.2.7 has no interface 'ib7'; its interfaces are eth0, ib0"):
        interface_address("ib7", "192.0.2.7")
    with pytest.raises(NetworkError, match=r"interface 'ib1' of node 10.1.0.9 has no IPv4 address"):
        interface_address("ib1", "10.1.0.9")
    with pytest.raises(NetworkError, match="required on 3 nodes"):
        RunNetwork.of(ClusterConfig(nodes=3))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "[::]"])
def test_nothing_listens_on_every_interface(host: str) -> None:
    with pytest.raises(ValueError, match=r"refusing to listen on .* \(every interface\)"):
        check_listen_host(host)
    with pytest.raises(ValueError, match="every interface"):
        build_reference_command("/m", 8000, host=host)
    with pytest.raises(ValueError, match="every interface"):
        build_sglang_command(RolloutConfig(), SGLangPlacement(0, 30000, 30001, host=host), "/m")
    with pytest.raises(ValueError, match="every interface"):
        free_ports(1, host)


def test_engine_ports_are_free_on_the_engine_address() -> None:
    (port,) = free_ports(1, "127.0.0.1")
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_a_store_this_run_hosts_listens_on_its_address_only() -> None:
    port = free_port()
    store = rendezvous_store("127.0.0.1", port, 0, 1, timeout=timedelta(seconds=30))
    store.set("k", "v")
    listening = [c.laddr for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert [address.ip for address in listening if address.port == port] == ["127.0.0.1"]
    assert store.get("k") == b"v"


# ---------------------------------------------------------------- the API key


def test_the_key_check_is_sglangs() -> None:
    assert is_authorized("POST", "/generate", f"Bearer {KEY}", KEY)
    assert is_authorized("POST", "/generate", f"bEaReR {KEY}", KEY)  # the scheme is case-insensitive
    for header in (None, "", KEY, f"Basic {KEY}", "Bearer", f"Bearer  {KEY}", f"Bearer {KEY} ", "Bearer other"):
        assert not is_authorized("POST", "/generate", header, KEY), header
    for path in ("/health", "/health_generate", "/healthz", "/ready", "/metrics"):
        assert is_authorized("GET", path, None, KEY)  # probes and metrics are open, matched by prefix
    assert is_authorized("OPTIONS", "/generate", None, KEY)
    assert is_authorized("POST", "/update_weights_from_tensor", None, None)  # no key configured: open
    assert len(new_api_key()) >= 40 and new_api_key() != new_api_key()


def test_a_spec_and_a_command_line_never_show_the_key(tmp_path: Path) -> None:
    spec = EngineSpec("e0", "reference", "/m", "/logs", RolloutConfig(), seed=1, api_key=KEY)
    assert KEY not in repr(spec)
    process = ReferenceEngine("e0", "/m", 8000, log_dir=tmp_path, api_key=KEY).process
    assert process is not None and process.env is not None
    assert KEY not in " ".join(process.command) and KEY not in repr(process)
    assert process.env[API_KEY_ENV] == KEY  # the key travels in the environment
    keyless = ReferenceEngine("e1", "/m", 8000, log_dir=tmp_path).process
    assert keyless is not None and keyless.env is not None
    assert keyless.env[API_KEY_ENV] == ""  # none inherited


def test_engine_output_reaches_its_log_with_the_key_redacted(tmp_path: Path) -> None:
    script = f"import sys; print('server_args api_key={KEY!s}', flush=True); sys.stderr.write('{KEY}!\\n')"
    process = ServerProcess([sys.executable, "-c", script], tmp_path / "e.log", secrets=[KEY])
    process.start()
    assert process.wait_for_exit(30) == 0
    tail = process.log_tail()
    assert KEY not in (tmp_path / "e.log").read_text() and KEY not in tail
    assert "api_key=<redacted>" in tail and "<redacted>!" in tail


# Stands in for `python -m sglang.launch_server` on a node rank >= 1: reads its --config file as SGLang reads its
# arguments, says so, and runs on (it serves no HTTP, as SGLang's other nodes serve none).
NODE_PROCESS = """
import sys, time
config = sys.argv[sys.argv.index("--config") + 1]
with open(config) as file:
    file.read()
print("read " + config, flush=True)
time.sleep(300)
"""


def test_a_node_process_of_an_engine_spanning_nodes_loses_its_key_file_once_the_engine_is_healthy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node rank 1's host starts its process and returns at once (no /health of its own); its key file stays
    while node 0 is not healthy yet, and goes when the host is told node 0 is, the process running on."""
    sglang = tmp_path / "sglang-python"
    sglang.write_text(f"#!{sys.executable}\n{NODE_PROCESS}")
    sglang.chmod(0o755)
    monkeypatch.setenv(SGLANG_PYTHON_ENV, str(sglang))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = EngineSpec(
        "sg0",
        "sglang",
        "/models/qwen3",
        str(tmp_path),
        RolloutConfig(tp=4),
        seed=1,
        gpu_ids=("2", "3"),
        api_key=KEY,
        nnodes=2,
        node_rank=1,
        dist_init_addr="127.0.0.1:29500",
    )
    host = EngineHost()
    try:
        assert host.start(spec)[0] == "sg0"
        log = tmp_path / "sg0-node1.log"
        deadline = time.monotonic() + 60
        while not (read := re.search(r"read (\S+)", log.read_text() if log.exists() else "")):
            assert time.monotonic() < deadline, "the node process never read its --config file"
            time.sleep(0.1)
        key_file = Path(read.group(1))
        assert KEY in key_file.read_text()  # kept until node 0 is healthy
        assert host.engine_healthy()
        assert not key_file.exists() and host.running()
    finally:
        host.shutdown()
    assert not key_file.parent.exists()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Our reference server in this process, requiring ``KEY``; yields its port."""
    hf_dir = save_tiny_moe(tmp_path_factory.mktemp("hf") / "moe")
    backend = ReferenceBackend(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32))
    server = build_server(backend, "127.0.0.1", free_port(), api_key=KEY)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_reference_server_serves_the_runs_client_and_refuses_others(keyed_server: int) -> None:
    ours = HttpEngine("ref", "127.0.0.1", keyed_server, request_timeout_s=60, api_key=KEY)
    ours.wait_healthy(30)
    (result,) = ours.generate(GenerateRequest([5, 17], SamplingParams(max_new_tokens=2, temperature=0.0)))
    assert len(result.output_ids) == 2
    ours.begin_weight_update()
    ours.end_weight_update()
    for key in (None, "another-runs-key"):
        stranger = HttpEngine("ref", "127.0.0.1", keyed_server, request_timeout_s=60, api_key=key)
        stranger.wait_healthy(30)  # /health is open, as on SGLang
        for call in (stranger.begin_weight_update, lambda s=stranger: s.release_memory(["kv_cache"])):
            with pytest.raises(EngineRequestError, match="refused this run's API key") as refused:
                call()
            assert refused.value.status == 401 and refused.value.body == '{"error":"Unauthorized"}'
        with pytest.raises(EngineRequestError, match="401"):
            stranger.generate(GenerateRequest([5], SamplingParams(max_new_tokens=1)))
