"""``data.reward: remote``: slime's ``--rm-url`` request and answers against a real HTTP server started by the test
(``tests/remote_reward_server.py``), retries with backoff, and the reward pool scoring through it, a server killed
mid-use included. Nothing is mocked: the client, the server, the sockets and the worker processes are real.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from typing import Any

import pytest

from megatron_rl.config.schema import DataConfig, RemoteRewardConfig, SyntheticDataConfig
from megatron_rl.data import RewardOutput, get_reward, register_reward
from megatron_rl.data.preparation import resolve_reward
from megatron_rl.data.remote_reward import RemoteReward, RemoteRewardError, parse_reward_answer
from megatron_rl.data.rewards import EMPTY_RESPONSE_PROBE
from megatron_rl.rollout.scoring import RewardPool, ScoredResponse
from tests.remote_reward_server import DROP, RewardServer, json_answer

FAST = {"retries": 2, "backoff_s": 0.02, "max_backoff_s": 0.04, "timeout_s": 2.0}
"""Client settings whose waits keep the tests fast: at most 0.02 + 0.04 s of backoff per response."""


def _reward(url: str, **settings: Any) -> RemoteReward:
    return RemoteReward(RemoteRewardConfig(url=url, **(FAST | settings)))


def _free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_request_is_slimes_json_plus_the_rows_metadata_over_one_kept_alive_connection() -> None:
    with RewardServer() as server:
        reward = _reward(server.url("/score?task=succ"))
        first = reward("5 <eos>", "5", {"index": 3, "split": "train"}, "<user> succ 4 <assistant>")
        second = reward("6 <eos>", "5", {}, "<user> succ 4 <assistant>")
    assert first == RewardOutput(1.0, True, "5 <eos>") and second == RewardOutput(-1.0, False, "6 <eos>")
    request = server.received[0]
    assert (request.method, request.path, request.content_type) == ("POST", "/score?task=succ", "application/json")
    assert request.body == {
        "prompt": "<user> succ 4 <assistant>",
        "response": "5 <eos>",
        "label": "5",
        "metadata": {"index": 3, "split": "train"},
    }
    assert server.connections == 1  # the second request reused the first one's connection


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (1, RewardOutput(1.0, True)),
        (0, RewardOutput(0.0, False)),
        (-1.0, RewardOutput(-1.0, False)),
        (0.5, RewardOutput(0.5, True)),  # correct_threshold 0.5 itself is correct
        (0.49, RewardOutput(0.49, False)),
        ({"score": 0.25}, RewardOutput(0.25, False)),
        ({"score": -1, "correct": True, "answer": "7"}, RewardOutput(-1.0, True, "7")),
        ({"score": 1, "answer": None, "extra": [1, 2]}, RewardOutput(1.0, True)),
    ],
)
def test_number_and_object_answers_parse(answer: Any, expected: RewardOutput) -> None:
    with RewardServer(lambda body, index: json_answer(answer)) as server:
        assert _reward(server.url())("r", "l", {}) == expected


def test_the_score_key_and_the_threshold_are_the_recipes() -> None:
    with RewardServer(lambda body, index: json_answer({"reward": 0.0, "score": 9})) as server:
        assert _reward(server.url(), score_key="reward", correct_threshold=-0.5)("r", "l", {}) == RewardOutput(0, True)


@pytest.mark.parametrize(
    ("status", "body", "tries", "message"),
    [
        (500, b"overloaded", 3, "HTTP 500 'overloaded' (tried 3 times)"),
        (404, b"no such path", 1, "answered HTTP 404 'no such path'"),
        (200, b"<html>ok</html>", 1, "the answer is not JSON: '<html>ok</html>'"),
        (200, b'{"value": 1}', 1, "the answer object has no 'score' (data.remote_reward.score_key)"),
        (200, b"NaN", 1, "the score is not finite (nan)"),
        (200, b'{"score": Infinity}', 1, "the answer's 'score' is not finite (inf)"),
        (200, b'{"score": "1"}', 1, "the answer's 'score' is not a number"),
        (200, b"true", 1, "the answer is neither a JSON number nor an object: it was 'true'"),
        (200, b"[1]", 1, "the answer is neither a JSON number nor an object"),
        (200, b'{"score": 1, "correct": "yes"}', 1, "the answer's 'correct' is not a bool"),
        (200, b'{"score": 1, "answer": 7}', 1, "the answer's 'answer' is neither a string nor null"),
    ],
)
def test_a_bad_answer_raises_naming_the_url_and_what_came_back(
    status: int, body: bytes, tries: int, message: str
) -> None:
    with RewardServer(lambda request, index: (status, body)) as server, pytest.raises(RemoteRewardError) as error:
        _reward(server.url())("r", "l", {})
    assert f"data.remote_reward.url={server.url()}" in str(error.value) and message in str(error.value)
    assert len(server.received) == tries  # only a 5xx (or 429) is worth another try


def test_retries_with_backoff_recover_from_a_server_failing_the_first_requests() -> None:
    def fail_twice(body: dict[str, Any], index: int) -> tuple[int, bytes]:
        return json_answer("busy", 503) if index < 2 else json_answer(1)

    with RewardServer(fail_twice) as server:
        start = time.monotonic()
        assert _reward(server.url(), backoff_s=0.1, max_backoff_s=0.15)("r", "l", {}) == RewardOutput(1.0, True)
        elapsed = time.monotonic() - start
    assert len(server.received) == 3
    assert elapsed >= 0.5 * (0.1 + 0.15)  # two waits, each at least half its ceiling (0.1 s, then 0.2 capped at 0.15)


def test_the_backoff_doubles_up_to_its_cap_and_the_worst_case_adds_every_try_and_wait() -> None:
    config = RemoteRewardConfig(url="http://rm:8000/score", retries=5, timeout_s=3.0, backoff_s=0.5, max_backoff_s=4.0)
    assert [config.backoff_ceiling_s(retry) for retry in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert config.worst_case_s == 6 * 3.0 + 11.5
    defaults = RemoteRewardConfig(url="http://rm:8000/score")
    assert defaults.worst_case_s == 3 * 8.0 + 0.5 + 1.0 <= DataConfig.model_fields["reward_timeout_s"].default


def test_a_server_that_is_down_raises_after_its_retries() -> None:
    url = f"http://127.0.0.1:{_free_port()}/score"
    with pytest.raises(RemoteRewardError) as error:
        _reward(url, retries=3)("r", "l", {})
    assert f"data.remote_reward.url={url}: ConnectionRefusedError" in str(error.value)
    assert "(tried 4 times)" in str(error.value) and "check that the reward server is up" in str(error.value)


def test_a_request_past_timeout_s_is_a_try_that_failed() -> None:
    def slow(body: dict[str, Any], index: int) -> tuple[int, bytes]:
        time.sleep(0.5)
        return json_answer(1)

    with RewardServer(slow) as server:
        with pytest.raises(RemoteRewardError, match=r"TimeoutError: timed out \(tried 2 times\)"):
            _reward(server.url(), retries=1, timeout_s=0.1)("r", "l", {})
        assert len(server.received) == 2


def test_a_kept_alive_connection_the_server_dropped_is_replaced_without_costing_a_retry() -> None:
    def drop_the_second(body: dict[str, Any], index: int) -> tuple[int, bytes]:
        return (DROP, b"") if index == 1 else json_answer(1)

    with RewardServer(drop_the_second) as server:
        reward = _reward(server.url(), retries=0)
        assert reward("r", "l", {}) == RewardOutput(1.0, True)
        assert reward("r", "l", {}) == RewardOutput(1.0, True)  # dropped unanswered, then sent again: no retry
    assert (len(server.received), server.connections) == (3, 2)
    with RewardServer(port=server.port) as again:  # the old server cut its connections: found closed before reuse
        assert reward("r", "l", {}) == RewardOutput(-1.0, False, "r")
    assert (len(again.received), again.connections) == (1, 1)


def test_a_server_down_at_start_fails_the_reward_check_naming_the_url() -> None:
    data = DataConfig(
        synthetic=SyntheticDataConfig(task="successor"),
        reward="remote",
        remote_reward=RemoteRewardConfig(url=f"http://127.0.0.1:{_free_port()}/x", backoff_s=0.01),
    )
    with pytest.raises(ValueError, match=r"^data\.reward: .*data\.remote_reward\.url=http://127\.0\.0\.1:\d+/x"):
        resolve_reward(data)


def test_remote_is_a_reserved_reward_name() -> None:
    with pytest.raises(ValueError, match="reserved"):
        register_reward("remote")(get_reward("synthetic_successor"))
    with pytest.raises(ValueError, match="data.remote_reward"):
        get_reward("remote")


def test_parsing_is_the_same_for_a_decoded_answer() -> None:
    assert parse_reward_answer(-1, "score", 0.5) == RewardOutput(-1.0, False)
    assert math.isclose(parse_reward_answer({"s": 0.75}, "s", 0.5).score, 0.75)


@pytest.fixture(scope="module")
def served_pool() -> Any:
    """A reward pool of 2 workers scoring through a server (synthetic_successor), whose port stays the same."""
    server = RewardServer().__enter__()
    config = RemoteRewardConfig(url=server.url(), retries=1, backoff_s=0.01, max_backoff_s=0.01, timeout_s=2.0)
    pool = RewardPool("remote", 2, timeout_s=10.0, served=RemoteReward(config))
    yield server, pool
    pool.close()
    server.kill()


def test_the_pool_probes_the_server_and_scores_a_group_in_order_with_answers(served_pool: Any) -> None:
    server, pool = served_pool
    probe = server.received[0].body
    assert probe == {"prompt": "", "response": "", "label": "0", "metadata": {}}  # EMPTY_RESPONSE_PROBE
    assert (probe["response"], probe["label"], probe["metadata"]) == EMPTY_RESPONSE_PROBE and pool.failed_score == -1
    responses = ["5 <eos>", "4 <eos>", "5", "5 <eos>", "", "5 <eos> <pad>"]
    scored = pool.submit(responses, "5", {"row": 1}, label="g0", prompt="<user> succ 4").result(timeout=60)
    local = get_reward("synthetic_successor")
    assert scored == [
        ScoredResponse(out.score, out.correct, answer=out.answer) for out in (local(r, "5", {}) for r in responses)
    ]
    assert [s.correct for s in scored] == [True, False, False, True, False, True]
    assert server.connections <= 2  # one kept-alive connection per worker at most
    sent = [r.body for r in server.received if r.body["prompt"]]
    assert sorted(b["response"] for b in sent) == sorted(responses)
    assert all(b["prompt"] == "<user> succ 4" and b["metadata"] == {"row": 1} for b in sent)


def test_a_killed_server_fails_responses_as_counted_errors_and_scoring_resumes_when_it_is_back(
    served_pool: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server, pool = served_pool
    assert pool.submit(["5 <eos>"], "5", {}).result(timeout=60) == [ScoredResponse(1.0, True, answer="5 <eos>")]
    server.kill()  # the workers' kept-alive connections are cut, and nothing listens any more
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.scoring"):
        failed = pool.submit(["5 <eos>", "4 <eos>", "5 <eos>"], "5", {}, label="g1").result(timeout=60)
    assert failed == [ScoredResponse(-1.0, False, "error")] * 3  # the empty response's score
    assert len(caplog.records) == 3 and "ConnectionRefusedError" in caplog.text and "tried 2 times" in caplog.text
    with RewardServer(port=server.port):
        back = pool.submit(["5 <eos>", "4 <eos>"], "5", {}).result(timeout=60)
    assert back == [ScoredResponse(1.0, True, answer="5 <eos>"), ScoredResponse(-1.0, False, answer="4 <eos>")]
