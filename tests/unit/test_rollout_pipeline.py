"""The staleness schedule: which weights each step's rollout is generated with, and what a checkpoint carries over.

A stand-in trainer/engine pair: ``generate`` records the weight version the engines hold when it
runs (and sleeps, so the background generation really overlaps), ``train`` bumps the version as the
driver's sync does. The schedule must give step j > s the weights after step j-s-1, never let a
generation see two versions, and resume from carried-over rollouts to the same sequence.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from megatron_rl.orchestration.driver import staleness_metrics
from megatron_rl.orchestration.rollout_pipeline import (
    CarriedOver,
    RolloutPipeline,
    load_carried_over,
    save_carried_over,
)
from megatron_rl.rollout.groups import RolloutGroup, RolloutSample, RolloutStep, weight_version_number


class Engines:
    """Weight versions and the generations run under them (thread-safe)."""

    def __init__(self, version: int = 0, generated: int = 0) -> None:
        self.version, self.generated = version, generated
        self.running = 0
        self.lock = threading.Lock()
        self.log: list[tuple[int, int]] = []

    def generate(self, step: int) -> RolloutStep:
        with self.lock:
            self.running += 1
            self.generated += 1
            index, version = self.generated, self.version
        assert step == index, f"generation {index} was asked for step {step}"
        time.sleep(0.01)
        with self.lock:
            assert self.version == version, "the weights changed during a generation"
            self.running -= 1
            self.log.append((index, version))
        sample = RolloutSample([1], [2], [0.0], "stop", 1.0, True, 0.0, [1], str(version) if version else "default")
        return RolloutStep([RolloutGroup(f"g{index}", index, [sample])])

    def sync(self, version: int) -> None:
        with self.lock:
            assert self.running == 0, "a sync while a generation runs"
            self.version = version


def _train(pipeline: RolloutPipeline, engines: Engines, steps: range) -> list[tuple[int, int]]:
    """The driver's loop without a model: take, (train), wait for the generation ahead, sync."""
    trained = []
    for step in steps:
        taken = pipeline.take(step)
        trained.append((taken.step, weight_version_number(taken.rollout.groups[0].samples[0].weight_version)))
        pipeline.wait_ahead()
        engines.sync(step)
    return trained


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_step_j_trains_on_the_weights_after_step_j_minus_s_minus_1(staleness: int) -> None:
    engines = Engines()
    pipeline = RolloutPipeline(engines.generate, max_staleness=staleness, last_step=6)
    try:
        trained = _train(pipeline, engines, range(1, 7))
    finally:
        pipeline.close()
    assert trained == [(j, max(0, j - staleness - 1)) for j in range(1, 7)]
    assert engines.generated == 6  # nothing generated past the last step
    assert pipeline.carried_over() == []


def test_a_resume_from_the_carried_over_rollouts_continues_the_same_schedule(tmp_path: Path) -> None:
    straight_engines = Engines()
    straight = RolloutPipeline(straight_engines.generate, max_staleness=2, last_step=7)
    try:
        expected = _train(straight, straight_engines, range(1, 8))
    finally:
        straight.close()

    engines = Engines()
    first = RolloutPipeline(engines.generate, max_staleness=2, last_step=7)
    try:
        done = _train(first, engines, range(1, 4))
        save_carried_over(tmp_path, CarriedOver(first.carried_over(), []))
    finally:
        first.close()
    assert [item.step for item in first.carried_over()] == [4, 5]
    carried = load_carried_over(tmp_path, "carried_over.pt").rollouts
    assert [item.rollout.groups[0].uid for item in carried] == ["g4", "g5"]
    resumed_engines = Engines(version=3, generated=5)  # the restored weights; the sampler past step 5
    resumed = RolloutPipeline(resumed_engines.generate, max_staleness=2, last_step=7, carried=carried)
    try:
        done += _train(resumed, resumed_engines, range(4, 8))
    finally:
        resumed.close()
    assert done == expected
    assert not load_carried_over(tmp_path, None)


def test_lowering_the_staleness_at_a_resume_trains_the_carried_steps_first() -> None:
    engines = Engines()
    first = RolloutPipeline(engines.generate, max_staleness=2, last_step=6)
    try:
        _train(first, engines, range(1, 3))
    finally:
        first.close()
    synchronous = RolloutPipeline(engines.generate, max_staleness=0, last_step=6, carried=first.carried_over())
    try:
        trained = _train(synchronous, engines, range(3, 7))
    finally:
        synchronous.close()
    assert trained == [(3, 0), (4, 1), (5, 4), (6, 5)]


def test_staleness_metrics_count_each_samples_lag_and_refuse_one_past_the_bound() -> None:
    def group(*versions: str) -> RolloutGroup:
        samples = [RolloutSample([1], [2], [0.0], "stop", 0.0, False, 0.0, [1], v) for v in versions]
        return RolloutGroup("g", 0, samples)

    metrics = staleness_metrics([group("3", "default"), group("2")], trained_version=3, max_lag=3)
    assert metrics == {
        "async/samples_at_staleness_0": 1.0,
        "async/samples_at_staleness_1": 1.0,
        "async/samples_at_staleness_2": 0.0,
        "async/samples_at_staleness_3": 1.0,
        "async/staleness_mean": 4 / 3,
        "async/staleness_max": 3.0,
        "async/token_staleness_mean": 4 / 3,
        "async/token_staleness_max": 3.0,
        "async/partial_samples": 0.0,
    }
    with pytest.raises(RuntimeError, match="2 weight versions old, beyond the bound of 1"):
        staleness_metrics([group("1")], trained_version=3, max_lag=1)


def test_staleness_metrics_weigh_a_partial_rollouts_tokens_by_their_own_versions() -> None:
    continued = RolloutSample([1], [2] * 6, [0.0] * 6, "stop", 0.0, False, 0.0, [1] * 6, "3")
    continued.version_segments = [("1", 4), ("3", 2)]  # 4 tokens under step 1's weights, 2 under step 3's
    whole = RolloutSample([1], [2] * 2, [0.0] * 2, "stop", 0.0, False, 0.0, [1] * 2, "2")
    metrics = staleness_metrics([RolloutGroup("g", 0, [continued, whole])], trained_version=3, max_lag=2)
    assert metrics["async/staleness_max"] == 1.0  # by their last tokens
    assert metrics["async/token_staleness_max"] == 2.0
    assert metrics["async/token_staleness_mean"] == (4 * 2 + 2 * 0 + 2 * 1) / 8
    assert metrics["async/partial_samples"] == 1.0
    with pytest.raises(RuntimeError, match="a token of step 4 is 2 weight versions old"):
        staleness_metrics([RolloutGroup("g", 0, [continued])], trained_version=3, max_lag=1)
