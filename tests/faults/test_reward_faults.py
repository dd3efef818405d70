"""A reward function that raises, hangs or kills its worker on one response: that response scores as failed,
is counted and logged once, and scoring (and the run) goes on with the same scores in the same order.

The rewards are real functions reached by import path in spawned worker processes
(``tests/faults/rewards.py``); the rollout-manager tests drive the real HTTP client against a
canned engine server, so only the engine's sampling is stood in for.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from megatron_rl.config.schema import DataConfig, DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.engines.protocol import GenerateRequest
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.scoring import RewardPool, ScoredResponse
from tests.e2e.tiny_runs import RUN, read_metrics, run_train
from tests.faults.canned_engine import canned_engine, json_answer, sample
from tests.faults.rewards import EXIT, HANG, RAISE
from tests.rollout_managers import build_manager

FAULTY = "tests.faults.rewards:faulty_exact"
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def pool() -> Any:
    rewards = RewardPool(FAULTY, 2, timeout_s=TIMEOUT_S)
    yield rewards
    rewards.close()


def _score(pool: RewardPool, responses: list[str], truth: str = "4") -> list[ScoredResponse]:
    return pool.submit(responses, truth, {}, label="g0").result(timeout=120)


def test_the_reward_timeout_is_a_documented_recipe_field_with_a_default() -> None:
    field = DataConfig.model_fields["reward_timeout_s"]
    assert field.default == 30.0 and field.description is not None and "killed and replaced" in field.description


def test_a_raising_reward_scores_the_response_as_failed_and_logs_it_once(
    pool: RewardPool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.scoring"):
        scored = _score(pool, ["4", f"{RAISE} 9", "3"])
    assert scored == [  # the answers come back from the worker with the scores; a failed response has none
        ScoredResponse(1.0, True, answer="4"),
        ScoredResponse(-1.0, False, "error"),
        ScoredResponse(-1.0, False, answer="3"),
    ]
    (record,) = caplog.records
    message = record.getMessage()
    assert "failed on response 1 of group g0" in message and "rollout/reward_errors" in message
    assert "ValueError: verifier crashed on 'boom 9'" in message and "response 'boom 9'" in message


def test_a_hung_reward_times_out_and_a_fresh_worker_scores_the_rest(
    pool: RewardPool, caplog: pytest.LogCaptureFixture
) -> None:
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.scoring"):
        scored = _score(pool, [HANG, HANG, "4", "5"])
    assert time.monotonic() - start < 60
    assert [s.failure for s in scored] == ["timeout", "timeout", None, None]
    assert [s.score for s in scored] == [-1.0, -1.0, 1.0, -1.0]
    assert len(caplog.records) == 2 and "ran past data.reward_timeout_s=1.0 s" in caplog.text
    assert "killed and replaced" in caplog.text
    assert _score(pool, ["4"]) == [ScoredResponse(1.0, True, answer="4")]


def test_a_reward_that_kills_its_worker_process_scores_as_failed_and_the_pool_recovers(pool: RewardPool) -> None:
    scored = _score(pool, [EXIT, "4"])
    assert scored == [ScoredResponse(-1.0, False, "error"), ScoredResponse(1.0, True, answer="4")]
    assert _score(pool, ["5", "4"]) == [ScoredResponse(-1.0, False, answer="5"), ScoredResponse(1.0, True, answer="4")]


def test_the_failed_score_is_the_rewards_own_score_of_a_wrong_answer() -> None:
    pool = RewardPool("tests.faults.rewards:zero_one_faulty", 1, timeout_s=TIMEOUT_S)
    try:
        assert pool.failed_score == 0.0
        assert _score(pool, [RAISE, "4"]) == [ScoredResponse(0.0, False, "error"), ScoredResponse(1.0, True)]
    finally:
        pool.close()


WORDS = ["4", "3", RAISE, HANG, EXIT, "<eos>"]
"""Token id -> word of the canned engine's responses."""
RESPONSES = {
    1: [[0, 5], [2, 5], [1, 5], [3, 5]],  # right, raises, wrong, hangs
    2: [[0, 5], [0, 5], [4, 5], [1, 5]],  # right, right, kills its worker, wrong
    3: [[0, 5], [1, 5], [0, 5], [1, 5]],
    4: [[2, 5], [0, 5], [1, 5], [0, 5]],
}
"""Prompt id -> the ids of its four samples."""


def _generate(path: str, body: Any) -> tuple[int, str, bytes]:
    assert path == "/generate", path
    request = GenerateRequest.from_json(body)  # a batch of n one-sample entries, as our client sends a group
    samples = RESPONSES[request.input_ids[0]]
    return json_answer([sample(ids, rid) for ids, rid in zip(samples, request.sample_rids() or [], strict=True)])


def _manager(engine: Any) -> RolloutManager:
    dataset = PromptDataset([PromptItem(i, [i + 1, 9], "4 <eos>", "faults") for i in range(4)], 0)
    return build_manager(
        [engine],
        dataset,
        PromptSampler(len(dataset), 2, shuffle=False),
        RolloutConfig(engine="reference", n_samples_per_prompt=4, max_response_length=8),
        OverlongConfig(enable=False),
        DynamicSamplingConfig(enable=False),
        prompts_per_step=2,
        reward="tests.faults.rewards:faulty_exact",
        reward_num_workers=2,
        reward_timeout_s=TIMEOUT_S,
        decode=lambda ids: " ".join(WORDS[i] for i in ids),
    )


def _two_steps() -> list[tuple[list[list[float]], list[list[str | None]], dict[str, float]]]:
    with canned_engine(_generate) as engine:
        manager = _manager(engine)
        try:
            steps = [manager.generate_step() for _ in range(2)]
        finally:
            manager.close()
    return [
        (
            [group.scores for group in step.groups],
            [[s.reward_failure for s in group.samples] for group in step.groups],
            {k: v for k, v in step.metrics.items() if k.startswith("rollout/reward_")},
        )
        for step in steps
    ]


def test_the_rollout_goes_on_counts_failures_and_scores_deterministically() -> None:
    first = _two_steps()
    (scores, failures, metrics), (scores_2, failures_2, metrics_2) = first
    assert scores == [[1.0, -1.0, -1.0, -1.0], [1.0, 1.0, -1.0, -1.0]]
    assert failures == [[None, "error", None, "timeout"], [None, None, "error", None]]
    assert metrics == {"rollout/reward_errors": 2.0, "rollout/reward_timeouts": 1.0}
    assert scores_2 == [[1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, -1.0, 1.0]]
    assert failures_2 == [[None] * 4, ["error", None, None, None]]
    assert metrics_2 == {"rollout/reward_errors": 1.0, "rollout/reward_timeouts": 0.0}
    assert _two_steps() == first


@pytest.mark.slow
def test_the_tiny_run_survives_a_reward_that_raises_and_hangs(tmp_path) -> None:
    overrides = [
        "data.reward=tests.faults.rewards:tiny_run_faulty",
        f"data.reward_timeout_s={TIMEOUT_S}",
        "train.steps=2",
        "train.prompts_per_step=4",
        "algorithm.dynamic_sampling.gen_batch_prompts=16",
        "validation.interval=2",
        "data.synthetic.num_val=8",
        "logging.sinks=[jsonl]",
    ]
    run_train(tmp_path, overrides)
    validation, *steps = read_metrics(tmp_path / RUN)
    assert validation["step"] == 0 and [r["step"] for r in steps] == [1, 2]
    assert all(r["train/update_skipped"] == 0.0 and r["actor/update_skipped"] == 0.0 for r in steps)
    assert sum(r["rollout/reward_errors"] for r in steps) > 0
    assert sum(r["rollout/reward_timeouts"] for r in steps) > 0
    assert {"val/greedy/reward_errors", "val/greedy/reward_timeouts"} <= set(validation) & set(steps[-1])
