"""The GPU set (launch/requirements-gpu.lock, installed by ./launch/setup.sh --gpu) resolves, and stays apart
from the CPU set.

The network test runs pip's own resolver over the GPU set's requirements with the lock as constraints, on
package metadata only (pip's fast-deps: HTTP range requests read each wheel's METADATA, not the wheel; TE's
PyTorch extension is an sdist of 0.5 MB whose metadata is prepared without build isolation against this
venv's torch, as setup.sh builds it), through a local proxy that counts the bytes it fetches: the set must
resolve to exactly the lock's pins without downloading the gigabytes the set weighs.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import socketserver
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
CPU_LOCK = ROOT / "launch" / "requirements.lock"
GPU_LOCK = ROOT / "launch" / "requirements-gpu.lock"
GPU_ONLY = {
    "sglang",
    "transformer-engine",
    "transformer-engine-torch",
    "transformer-engine-cu12",
    "transformer-engine-cu13",
}
# Where the GPU set must leave the CPU lock, and why (the lock's header says the same).
FORCED = {
    "transformers": "5.19.0",  # sglang 0.5.23 pins transformers==5.19.0
    "tokenizers": "0.23.2",  # sglang 0.5.23 pins tokenizers==0.23.2
    "huggingface-hub": "1.33.0",  # tokenizers 0.23.2 requires huggingface-hub<2
    "numpy": "2.3.5",  # numba 0.65.1 (pinned by sglang) requires numpy<2.5
    "python-dateutil": "2.9.0.post0",  # sglang requires python-dateutil<3
    "cuda-bindings": "13.4.4",  # cuda-python 13.4.4 requires cuda-bindings~=13.4.4
}
RESOLVE_BYTES_LIMIT = (
    300_000_000  # measured 111 MB (2026-12-06: index pages and METADATA reads); the wheels are over 5 GB
)


def _pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def _project() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"": project["dependencies"], **project["optional-dependencies"]}


def _gpu_set_requirements() -> list[str]:
    """What setup.sh --gpu asks for: megatron-rl's dependencies with its test, plots and gpu extras."""
    project = _project()
    return project[""] + project["test"] + project["plots"] + project["gpu"]


def test_the_gpu_lock_is_the_cpu_lock_but_for_what_sglang_forces() -> None:
    cpu, gpu = _pins(CPU_LOCK), _pins(GPU_LOCK)
    assert gpu["torch"] == cpu["torch"] and gpu["megatron-core"] == cpu["megatron-core"]
    moved = {name: gpu[name] for name in cpu.keys() & gpu.keys() if cpu[name] != gpu[name]}
    assert moved == FORCED
    header = "\n".join(line for line in GPU_LOCK.read_text().splitlines() if line.startswith("#"))
    for name, version in FORCED.items():
        assert re.search(rf"{name.replace('-', '[-_]')} {re.escape(version)} \(", header), name


def test_the_gpu_lock_satisfies_the_gpu_set_and_pins_te_with_its_cuda_13_core() -> None:
    gpu = _pins(GPU_LOCK)
    for text in _gpu_set_requirements():
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in gpu, f"{text} is not in {GPU_LOCK.name}"
        assert requirement.specifier.contains(gpu[name], prereleases=True), f"{text} against {gpu[name]}"
    te = gpu["transformer-engine"]
    assert (
        gpu["transformer-engine-torch"] == gpu["transformer-engine-cu13"] == te and "transformer-engine-cu12" not in gpu
    )
    assert gpu["sglang"] == "0.5.23" and gpu["transformers"] == "5.19.0"


def test_the_cpu_install_asks_for_nothing_of_the_gpu_set() -> None:
    project = _project()
    cpu_set = project[""] + project["test"] + project["plots"]
    assert not {canonicalize_name(Requirement(text).name) for text in cpu_set} & GPU_ONLY
    assert not _pins(CPU_LOCK).keys() & GPU_ONLY


# Stands in for .venv/bin/python: logs each call's TE build switches and arguments, and succeeds.
RECORDING_PYTHON = """#!/usr/bin/env bash
echo "NVTE_PYTORCH_FORCE_BUILD=${NVTE_PYTORCH_FORCE_BUILD-unset} $*" >> "$(dirname "$0")/calls.log"
"""


def test_the_gpu_setup_builds_transformer_engine_from_source_without_asking_github_for_a_wheel(
    tmp_path: Path,
) -> None:
    """TE's setup.py downloads a prebuilt wheel (no timeout) unless NVTE_PYTORCH_FORCE_BUILD=TRUE: on a cluster that
    drops outside traffic `setup.sh --gpu` would hang in the TE build. Runs setup.sh in a copy of the checkout whose
    .venv python records what it is asked."""
    (tmp_path / "launch").mkdir()
    for name in ("launch/setup.sh", "launch/requirements.lock", "launch/requirements-gpu.lock", "pyproject.toml"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(RECORDING_PYTHON)
    python.chmod(0o755)
    subprocess.run(["bash", str(tmp_path / "launch" / "setup.sh"), "--gpu"], check=True, capture_output=True)
    calls = (python.parent / "calls.log").read_text().splitlines()
    (te_build,) = [call for call in calls if "--no-build-isolation" in call]
    assert te_build.startswith("NVTE_PYTORCH_FORCE_BUILD=TRUE -m pip install") and te_build.endswith("[test,plots,gpu]")
    assert all(call.startswith("NVTE_PYTORCH_FORCE_BUILD=unset") for call in calls if call != te_build)


class _CountingProxy(socketserver.ThreadingTCPServer):
    """An HTTPS (CONNECT) proxy on 127.0.0.1 that counts the bytes it relays from the servers."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Tunnel)
        self.received = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Tunnel(socketserver.StreamRequestHandler):
    server: _CountingProxy

    def handle(self) -> None:
        request = self.rfile.readline().decode("latin-1").split()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        if len(request) < 2 or request[0] != "CONNECT":
            self.wfile.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            return
        host, port = request[1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=60) as upstream:
            self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            self.wfile.flush()
            client = self.connection
            while True:
                ready, _, _ = select.select([client, upstream], [], [], 60)
                if not ready:
                    return
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    (upstream if sock is client else client).sendall(data)
                    if sock is upstream:
                        with self.server.lock:
                            self.server.received += len(data)


@pytest.fixture
def counting_proxy() -> Iterator[_CountingProxy | None]:
    """The proxy, or None where the environment already names a proxy (pip then goes through that one)."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        yield None
        return
    proxy = _CountingProxy()
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield proxy
    proxy.shutdown()
    proxy.server_close()


# Full tier (37 s, PyPI): run it when a lock or pyproject.toml changes.
@pytest.mark.full
@pytest.mark.network
@pytest.mark.timeout(600)
def test_pips_resolver_turns_the_gpu_set_into_exactly_the_gpu_lock(
    counting_proxy: _CountingProxy | None, tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    command = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
        "--use-feature=fast-deps", "--no-build-isolation", "--disable-pip-version-check",
        "--report", str(report), "-c", str(GPU_LOCK), *_gpu_set_requirements(),
    ]  # fmt: skip
    if counting_proxy is not None:
        command[4:4] = ["--proxy", counting_proxy.url]
    start = time.monotonic()
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    seconds = time.monotonic() - start
    assert result.returncode == 0, f"pip could not resolve the GPU set:\n{result.stderr[-4000:]}"

    resolved = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    locked = _pins(GPU_LOCK)
    assert {name: resolved[name] for name in resolved.keys() - locked.keys()} == {}, "resolved but not in the lock"
    assert {name: locked[name] for name in locked.keys() - resolved.keys()} == {}, "in the lock but not needed"
    assert resolved == locked
    received = None if counting_proxy is None else counting_proxy.received
    print(f"[gpu set] {len(resolved)} packages resolved in {seconds:.0f} s, {received} bytes from the index")
    if received is not None:
        assert 0 < received < RESOLVE_BYTES_LIMIT, f"the resolver fetched {received:,} bytes"
