"""Preflight step ``storage``: the checkpoint directory takes a file, and how fast it writes and reads one.

A temporary file of ``nbytes`` random bytes is written into the checkpoint directory, fsynced, dropped from the
page cache, read back and compared by hash, then deleted; the rates are ``fs_write_gbps`` and ``fs_read_gbps``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from pathlib import Path

from megatron_rl.config.schema import RunConfig
from megatron_rl.plan.rates import Rate
from megatron_rl.preflight.report import StepFailure, StepOutcome

_CHUNK = 64 << 20
"""Bytes per write and read call: large enough that the calls' overhead does not count."""


def _remove_empty(directories: list[Path]) -> None:
    """Remove those of ``directories`` (deepest first) that exist and are empty."""
    for path in directories:
        # One that is gone or no longer empty (another process wrote into it meanwhile) is left as it is.
        with contextlib.suppress(OSError):
            path.rmdir()


def _write(path: Path, data: bytes) -> float:
    """Seconds to write ``data`` to the new file ``path`` and fsync it; the file is then dropped from the page
    cache, so that the read back comes from the file system."""
    with path.open("wb", buffering=0) as handle:
        view, written = memoryview(data), 0
        start = time.perf_counter()
        while written < len(data):
            written += handle.write(view[written : written + _CHUNK])
        os.fsync(handle.fileno())
        seconds = time.perf_counter() - start
        # A file system that ignores the advice (some network and FUSE ones) serves the read from memory, and
        # fs_read_gbps then measures the page cache, not the file system.
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return seconds


def _read(path: Path, size: int) -> tuple[bytearray, float]:
    """The first ``size`` bytes of ``path`` and the seconds the reads took."""
    buffer, read = bytearray(size), 0
    with path.open("rb", buffering=0) as handle, memoryview(buffer) as view:
        start = time.perf_counter()
        while read < size:
            got = handle.readinto(view[read : read + _CHUNK])
            if not got:
                break
            read += got
        seconds = time.perf_counter() - start
    del buffer[read:]  # a file cut short by the file system
    return buffer, seconds


def _measure(directory: Path, nbytes: int) -> tuple[float, float]:
    """Write, read back and compare a temporary file of ``nbytes`` in ``directory``, which is left as it was;
    (write, read) seconds. OSError when the file system refuses; StepFailure when the bytes read differ."""
    data = os.urandom(nbytes)  # random: a compressing or deduplicating file system cannot shrink it
    handle, name = tempfile.mkstemp(prefix=".preflight-storage-", dir=directory)
    os.close(handle)
    path = Path(name)
    try:
        write_seconds = _write(path, data)
        read_back, read_seconds = _read(path, nbytes)
    finally:
        path.unlink(missing_ok=True)
    if hashlib.sha256(read_back).digest() != hashlib.sha256(data).digest():
        raise StepFailure(
            f"{path} read back {len(read_back)} bytes that differ from the {nbytes} written (sha256)",
            "checkpoint.dir: a file system that returns other bytes than it was given would corrupt checkpoints; "
            "point checkpoint.dir at another one",
        )
    return write_seconds, read_seconds


def check_storage(cfg: RunConfig, nbytes: int = 256 << 20) -> StepOutcome:
    """The step: ``nbytes`` written, fsynced, read back uncached and verified in the checkpoint directory.

    The directory (``checkpoint.dir``, default ``runs/<name>/checkpoints``) is created if absent, as the run
    would, and removed again with the parents this created: nothing is left behind. Rates ``fs_write_gbps`` and
    ``fs_read_gbps`` in GB/s (1e9 bytes). Raises StepFailure naming the directory and the OSError when it cannot
    be created or written, with the fix ``checkpoint.dir``.
    """
    directory = Path(cfg.checkpoint_dir)
    missing = [path for path in (directory, *directory.parents) if not path.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_seconds, read_seconds = _measure(directory, nbytes)
    except OSError as error:
        raise StepFailure(
            f"the checkpoint directory {directory} cannot be written: {type(error).__name__}: {error}",
            "checkpoint.dir: point it at a writable directory (on a multi-node run, one every node shares)",
        ) from error
    finally:
        _remove_empty(missing)
    source = f"storage: {nbytes / 2**20:.0f} MiB written, fsynced and read back in {directory}"
    rates = {
        "fs_write_gbps": Rate(nbytes / write_seconds / 1e9, "GB/s", source),
        "fs_read_gbps": Rate(nbytes / read_seconds / 1e9, "GB/s", source),
    }
    lines = [
        f"{directory}: {nbytes / 2**20:.0f} MiB written and fsynced in {write_seconds:.2f} s, read back uncached "
        f"in {read_seconds:.2f} s, same sha256; the file is deleted",
    ]
    figures = {"bytes": nbytes, "write_seconds": write_seconds, "read_seconds": read_seconds}
    return StepOutcome(lines=lines, figures=figures, rates=rates)
