"""Rank calls are type-checked against the worker method they name: mypy rejects a wrong argument in a
``RankWorkerGroup.call`` and in one rank's ``RankArgs`` of ``call_per_rank``, and accepts the right ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CALLS = """
from megatron_rl.orchestration.worker_group import RankArgs, RankWorkerGroup


class Worker:
    def echo(self, x: int, tag: str = "") -> int:
        return x


def calls(group: RankWorkerGroup[Worker]) -> list[int]:
    group.call(Worker.echo, 1, tag="a")
    return group.call_per_rank(Worker.echo, [RankArgs(1), RankArgs(2, tag="b")])


def wrong_calls(group: RankWorkerGroup[Worker]) -> None:
    group.call(Worker.echo, "one")  # line 16
    group.call_per_rank(Worker.echo, [RankArgs(1), RankArgs("two")])  # line 17
    group.call_per_rank(Worker.echo, [RankArgs(1, tag=2)])  # line 18
"""


def test_mypy_holds_rank_calls_to_the_method_they_name(tmp_path: Path) -> None:
    source = tmp_path / "rank_calls.py"
    source.write_text(CALLS)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--follow-imports=silent", str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert [int(line.split(":")[1]) for line in errors] == [16, 17, 18], result.stdout
    assert 'incompatible type "str"; expected "int"' in errors[0] and 'incompatible type "str"' in errors[1]
    assert 'incompatible type "int"; expected "str"' in errors[2]
