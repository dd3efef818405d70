"""Calls that cross a process are type-checked against the method they name, in one mypy run over two snippets:
mypy rejects a wrong argument in a ``RankWorkerGroup.call``, in one rank's ``RankArgs`` of ``call_per_rank`` and in
the ranks' ``WorkerSpec`` (the worker's constructor), and a wrong argument, result or method in an engine host's ``ActorHandle.call``; it accepts the right ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RANK_CALLS = """
from megatron_rl.orchestration.worker_group import RankArgs, RankWorkerGroup, WorkerSpec


class Worker:
    def __init__(self, size: int, *, name: str = "") -> None:
        self.size = size

    def echo(self, x: int, tag: str = "") -> int:
        return x


def calls(group: RankWorkerGroup[Worker]) -> list[int]:
    group.call(Worker.echo, 1, tag="a")
    return group.call_per_rank(Worker.echo, [RankArgs(1), RankArgs(2, tag="b")])


def wrong_calls(group: RankWorkerGroup[Worker]) -> None:
    group.call(Worker.echo, "one")  # line 19
    group.call_per_rank(Worker.echo, [RankArgs(1), RankArgs("two")])  # line 20
    group.call_per_rank(Worker.echo, [RankArgs(1, tag=2)])  # line 21


def specs() -> list[WorkerSpec[Worker]]:
    return [WorkerSpec(Worker, 2, name="a"), WorkerSpec(Worker, "2"), WorkerSpec(Worker, 2, size=3)]  # line 25
"""

HOST_CALLS = """
import ray

from megatron_rl.orchestration.actor_handle import ActorHandle
from megatron_rl.orchestration.engine_host import EngineAddress, EngineHost, EngineSpec, RemoteEngineHost


class Other:
    def pid(self) -> int:
        return 0


def calls(spec: EngineSpec) -> list[int | None]:
    host: ActorHandle[EngineHost] = ActorHandle.start(RemoteEngineHost, num_cpus=0.1)
    address: ray.ObjectRef[EngineAddress] = host.call(EngineHost.start, spec)
    report: str = ray.get(host.call(EngineHost.process_report, settle_s=1.0), timeout=5.0)
    host.kill()
    return ray.get([host.call(EngineHost.pid)])


def wrong_calls(host: ActorHandle[EngineHost], spec: EngineSpec) -> None:
    other: ActorHandle[Other] = ActorHandle.start(RemoteEngineHost)  # line 22
    host.call(EngineHost.start, "spec")  # line 23
    host.call(EngineHost.process_report, settle_s="1")  # line 24
    host.call(EngineHost.pid, 1)  # line 25
    name: str = ray.get(host.call(EngineHost.pid))  # line 26
    host.call(Other.pid)  # line 27
"""


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """mypy's error lines per snippet file name, from one run over both (a run costs ~25 s)."""
    folder = tmp_path_factory.mktemp("call_types")
    sources = {"rank_calls.py": RANK_CALLS, "host_calls.py": HOST_CALLS}
    for name, text in sources.items():
        (folder / name).write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(folder / "cache"), "--follow-imports=silent"]
        + [str(folder / name) for name in sources],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    return {name: [line for line in errors if Path(line.split(":")[0]).name == name] for name in sources}


def _lines(errors: list[str]) -> list[int]:
    return [int(line.split(":")[1]) for line in errors]


def test_mypy_holds_rank_calls_to_the_method_they_name(mypy_errors: dict[str, list[str]]) -> None:
    errors = mypy_errors["rank_calls.py"]
    assert _lines(errors) == [19, 20, 21, 25, 25], errors
    assert 'incompatible type "str"; expected "int"' in errors[0] and 'incompatible type "str"' in errors[1]
    assert 'incompatible type "int"; expected "str"' in errors[2]
    assert 'Argument 2 to "WorkerSpec" has incompatible type "str"; expected "int"' in errors[3]
    assert '"WorkerSpec" gets multiple values for keyword argument "size"' in errors[4]


def test_mypy_holds_engine_host_calls_to_the_method_they_name(mypy_errors: dict[str, list[str]]) -> None:
    errors = mypy_errors["host_calls.py"]
    assert _lines(errors) == [22, 23, 24, 25, 26, 27], errors
    assert 'incompatible type "ActorClass[EngineHost]"; expected "ActorClass[Other]"' in errors[0]
    assert 'incompatible type "str"; expected "EngineSpec"' in errors[1]
    assert 'incompatible type "str"; expected "float"' in errors[2]
    assert "Too many arguments" in errors[3]
    assert '"int | None", variable has type "str"' in errors[4]
    assert '"Callable[[Other], int]"' in errors[5]
