"""Start N gloo ranks on this machine and run a function in each (CPU tools and tests).

:func:`run_ranks` is the entry for commands that also run under torchrun:
it runs the rank body directly when the process is already one rank of a
launched job.

:func:`run_local_ranks` is what ``check-parity`` and the converters use when
they are not already running under a launcher (no ``RANK`` in the
environment): it forks ``world_size`` processes with the torchrun environment
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free
port) and one intra-op thread each, calls ``fn(rank, world_size, *args)``,
and returns the per-rank return values (which must be picklable). A failure
on any rank raises :class:`RankFailedError` in the caller: its message is the
rank and the rank's exception line, its ``traceback`` the rank's full traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_rl.parallel.errors import RankFailedError


def free_port() -> int:
    """An unused TCP port on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    result = fn(rank, world_size, *args)
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, start_method: str = "fork") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return their results.

    ``fork`` (the default) lets the ranks inherit the parent's imports
    (Megatron-core takes about 7 s to import per process on 2 cores); the
    parent must not have initialised torch.distributed or CUDA. Use
    ``"spawn"`` for fully fresh processes (``fn`` must then be importable).
    """
    with tempfile.TemporaryDirectory() as out_dir, warnings.catch_warnings():
        # torch re-initialises its intra-op thread pool in forked children.
        warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks.*")
        try:
            mp.start_processes(
                _worker,
                args=(world_size, free_port(), out_dir, fn, args),
                nprocs=world_size,
                join=True,
                start_method=start_method,
            )
        except mp.ProcessRaisedException as error:
            raise RankFailedError(error.error_index, str(error)) from error
        return [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def launched_externally() -> bool:
    """Whether a launcher (torchrun, srun wrapper) started this process as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn`` as this process's rank when launched externally, else on ``world_size`` local ranks.

    Under an external launcher the world size is the launcher's and the list
    holds this rank's result only.
    """
    if launched_externally():
        return [fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)]
    return run_local_ranks(fn, world_size, *args)
