"""Run-checkpoint protocol: staging, commit by rename, `latest` written last, pruning, crash safety."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.checkpoint import (
    CheckpointError,
    TrainerState,
    capture_rng_state,
    commit_checkpoint,
    committed_steps,
    latest_checkpoint,
    load_rng_state,
    load_trainer_state,
    prune_checkpoints,
    restore_rng_state,
    save_rng_state,
    save_trainer_state,
    staging_dir,
    step_of,
)


def _save(root: Path, step: int, payload: str = "weights") -> Path:
    staged = staging_dir(root, step)
    (staged / "model.bin").write_text(f"{payload}-{step}")
    return commit_checkpoint(root, step)


def test_commit_publishes_the_directory_and_moves_latest(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    _save(tmp_path, 10)
    final = _save(tmp_path, 20)
    assert latest_checkpoint(tmp_path) == final == tmp_path / "step_000020"
    assert (final / "model.bin").read_text() == "weights-20"
    assert committed_steps(tmp_path) == [10, 20] and step_of(final) == 20


def test_staged_but_uncommitted_checkpoint_is_invisible(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    (staging_dir(tmp_path, 20) / "model.bin").write_text("half")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000010"
    assert committed_steps(tmp_path) == [10]


def test_prune_keeps_the_newest_and_removes_stale_staging(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        _save(tmp_path, step)
    staging_dir(tmp_path, 40)
    assert prune_checkpoints(tmp_path, keep_last=2) == [10]
    assert committed_steps(tmp_path) == [20, 30]
    assert not list(tmp_path.glob(".staging_*"))


def test_latest_naming_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("step_000099\n")
    with pytest.raises(CheckpointError, match="step_000099"):
        latest_checkpoint(tmp_path)


def test_commit_without_staging_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nothing staged for step 5"):
        commit_checkpoint(tmp_path, 5)


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_latest(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    writer = textwrap.dedent(
        f"""
        import sys, time
        from megatron_rl.checkpoint import staging_dir
        staged = staging_dir({str(tmp_path)!r}, 20)
        with open(staged / "model.bin", "w") as handle:
            handle.write("partial")
            handle.flush()
            print("writing", flush=True)
            time.sleep(60)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "writing"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    latest = latest_checkpoint(tmp_path)
    assert latest == tmp_path / "step_000010" and (latest / "model.bin").read_text() == "weights-10"
    final = _save(tmp_path, 20)
    assert latest_checkpoint(tmp_path) == final and (final / "model.bin").read_text() == "weights-20"


def test_rng_state_round_trip_replays_every_generator(tmp_path: Path) -> None:
    save_rng_state(tmp_path, rank=3)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    load_rng_state(tmp_path, rank=3)
    replayed = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == replayed[:2] and torch.equal(expected[2], replayed[2])


def test_rng_state_in_memory_round_trip() -> None:
    state = capture_rng_state()
    first = torch.randn(4)
    restore_rng_state(state)
    assert torch.equal(first, torch.randn(4))


def test_missing_rank_rng_file_names_the_rank(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no generator state for rank 7"):
        load_rng_state(tmp_path, rank=7)


def test_trainer_state_round_trip(tmp_path: Path) -> None:
    state = TrainerState(step=4, sampler={"epoch": 1, "position": 32, "seed": 1234}, weight_version=4)
    save_trainer_state(tmp_path, state)
    assert load_trainer_state(tmp_path) == state


def test_trainer_state_of_another_format_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "trainer_state.json").write_text('{"format_version": 99, "step": 1}')
    with pytest.raises(ValueError, match="format_version 99"):
        load_trainer_state(tmp_path)
