"""The on-disk protocol of run checkpoints: stage, commit by rename, point ``latest`` at it, prune.

Layout under the checkpoint root::

    step_000020/          a committed checkpoint (whatever the writers put in it)
    .staging_step_000040/ being written; never read, removed by the next save
    latest                the name of the newest committed checkpoint, written last

A checkpoint becomes visible only by the rename of its staging directory, and ``latest``
moves only after that rename, each step atomic (``os.replace``) and fsynced. A crash at any
moment therefore leaves ``latest`` naming a complete checkpoint (or absent before the first).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from megatron_rl.checkpoint.layout import LATEST_FILE

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint root or pointer that cannot be used; the message names the path."""


def step_dir_name(step: int) -> str:
    """``step_000020`` for step 20 (zero-padded, so names sort by step)."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:06d}"


def staging_dir(root: str | Path, step: int) -> Path:
    """A fresh, empty staging directory for ``step`` (a leftover from a crashed save is removed)."""
    path = Path(root) / f".staging_{step_dir_name(step)}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    with staging.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)
    _fsync_dir(path.parent)


def commit_checkpoint(root: str | Path, step: int) -> Path:
    """Publish the staging directory of ``step``: rename it into place, then move ``latest`` to it.

    Call once, on one process, after every writer has finished (a barrier). A committed
    checkpoint of the same step is replaced. Returns the committed directory.
    """
    root = Path(root)
    staged = root / f".staging_{step_dir_name(step)}"
    if not staged.is_dir():
        raise CheckpointError(f"{staged}: nothing staged for step {step}")
    final = root / step_dir_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    _fsync_dir(root)
    _write_atomically(root / LATEST_FILE, final.name + "\n")
    return final


def committed_steps(root: str | Path) -> list[int]:
    """Steps of the committed checkpoints under ``root``, ascending (staging directories excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    matches = (_STEP_DIR.match(entry.name) for entry in root.iterdir() if entry.is_dir())
    return sorted(int(match.group(1)) for match in matches if match)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when the root has none yet.

    Raises :class:`CheckpointError` when ``latest`` names a directory that is missing.
    """
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    target = Path(root) / name
    if not _STEP_DIR.match(name) or not target.is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint directory under {root}")
    return target


def prune_checkpoints(root: str | Path, keep_last: int) -> list[int]:
    """Remove all but the newest ``keep_last`` committed checkpoints and any stale staging directories.

    The checkpoint ``latest`` names is always kept. Returns the removed steps.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    latest = latest_checkpoint(root)
    steps = committed_steps(root)
    removed = [step for step in steps[:-keep_last] if latest is None or step_dir_name(step) != latest.name]
    for step in removed:
        shutil.rmtree(root / step_dir_name(step))
    for entry in root.glob(".staging_step_*"):
        shutil.rmtree(entry, ignore_errors=True)
    return removed


def step_of(checkpoint: str | Path) -> int:
    """The step a checkpoint directory holds, from its name."""
    match = _STEP_DIR.match(Path(checkpoint).name)
    if match is None:
        raise CheckpointError(f"{checkpoint}: not a checkpoint directory (expected a name like step_000020)")
    return int(match.group(1))
