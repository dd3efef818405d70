"""A multi-turn episode written as a user would, and the rollout manager driving it on any engine.

:class:`ReplyingEpisode` (:class:`megatron_rl.rollout.episodes.Episode`): a turn ends at any of a third of
the vocabulary, and the environment replies with three ids of its own; its reply to the first turn answers
two calls (as Qwen3's format does for a turn of two ``<tool_call>`` blocks). :class:`RecordingEngine` keeps every
request an engine got and every answer it gave, so tests can hold the trained data to what the engine
sampled, turn by turn (:func:`response_pieces`). Used against the reference engine (tests/unit) and the real
SGLang (tests/sglang).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.engines.engine import EngineUnavailableError, RolloutEngine
from megatron_rl.engines.protocol import GenerateRequest, GenerateResult
from megatron_rl.rollout.episodes import EnvironmentReply, Episode, ReplyFailure
from tests.fake_engines import DelegatingEngine
from tests.rollout_managers import build_manager

REWARD = "tests.rollout_rewards:first_token_parity"
STOPS = tuple(range(10, 40))
MAX_TURNS = 4
TWO_CALL_TURN = 1
"""The model turn whose reply answers two tool calls (the others answer one)."""


def reply_ids(turns: int) -> list[int]:
    """The environment's reply after the model's turn ``turns`` (1-based)."""
    return [97, 98, 90 + turns]


def tool_calls(replies: int) -> int:
    """The tool calls a response counts after ``replies`` replies of ReplyingEpisode."""
    return replies + (replies >= TWO_CALL_TURN)


class ReplyingEpisode(Episode):
    """A turn ends at any id in STOPS; the environment appends three ids; at most MAX_TURNS model turns."""

    stop_token_ids = STOPS

    def __init__(self) -> None:
        self.asked: list[tuple[int, list[int], int]] = []
        self._lock = threading.Lock()

    def reply(self, item: PromptItem, turn_ids: list[int], turns: int) -> Future[EnvironmentReply] | None:
        with self._lock:
            self.asked.append((item.index, list(turn_ids), turns))
        if turns >= MAX_TURNS or turn_ids[-1] not in STOPS:
            return None
        future: Future[EnvironmentReply] = Future()
        failures: dict[int, ReplyFailure] = {2: "limit", 3: "error"}
        failure = failures.get(turns)
        more_calls = (("echo", None),) if turns == TWO_CALL_TURN else ()
        future.set_result(EnvironmentReply(reply_ids(turns), tool="echo", failure=failure, more_calls=more_calls))
        return future


class RecordingEngine(DelegatingEngine):
    """Delegates to an engine and records each ``/generate`` request with its answers; with ``crash_at_follow_up``,
    the first request of a later turn fails as if the engine process were gone."""

    def __init__(self, engine: RolloutEngine, *, crash_at_follow_up: bool = False) -> None:
        super().__init__(engine)
        self.calls: list[tuple[GenerateRequest, list[GenerateResult]]] = []
        self._lock = threading.Lock()
        self.crash_pending = crash_at_follow_up

    def generate(self, request: GenerateRequest, *, timeout_s: float | None = None) -> list[GenerateResult]:
        with self._lock:
            crash = self.crash_pending and isinstance(request.rid, str) and request.rid.count(".") == 3
            self.crash_pending = self.crash_pending and not crash
        if crash:
            raise EngineUnavailableError("engine ref: /generate failed: the process is gone (test)")
        results = self._engine.generate(request, timeout_s=timeout_s)
        with self._lock:
            self.calls.append((request, results))
        return results


def run_episodes(engine, *, routing_replay: bool, partial_tokens: int | None = None, steps: int = 1, seed: int = 7):
    """``steps`` rollout steps of 3 prompts x 4 samples in ReplyingEpisode on ``engine`` (a RecordingEngine).

    Returns ``(groups, recoveries, episode)``: the step's groups, the failure count of each recovery (the
    engine itself is handed back), the episode with what it was asked.
    """
    rollout = RolloutConfig(
        engine="reference",
        n_samples_per_prompt=4,
        max_response_length=40,
        max_concurrent_requests=4,
        partial_rollout_tokens=partial_tokens,
        partial_rollout_max_windows=8,
    )
    dataset = PromptDataset([PromptItem(i, [i + 1, 3, 5], "mixed", "test") for i in range(3)], 0)
    episode = ReplyingEpisode()
    recoveries: list[int] = []

    def recover(failures):
        recoveries.append(len(failures))
        return [engine]

    manager = build_manager(
        [engine],
        dataset,
        PromptSampler(3, 3, seed=0, shuffle=False),
        rollout,
        OverlongConfig(enable=False),
        DynamicSamplingConfig(enable=False),
        prompts_per_step=3,
        reward=REWARD,
        reward_num_workers=1,
        reward_timeout_s=30.0,
        decode=lambda ids: " ".join(map(str, ids)),
        routing_replay=routing_replay,
        seed=seed,
        episode=episode,
        recover=recover,
    )
    try:
        groups = [group for step in range(steps) for group in manager.generate_step(step + 1).groups]
    finally:
        manager.close()
    return groups, recoveries, episode


def response_pieces(sample, calls, prompt: list[int]) -> list[tuple[str, list[int], list[float]]]:
    """The sample's response rebuilt from the engine's calls: each request whose input is the prompt plus the
    response so far contributes its answer; between answers the environment's reply. Fails when no call fits."""
    response: list[int] = []
    pieces: list[tuple[str, list[int], list[float]]] = []
    while len(response) < len(sample.response_ids):
        answers = [
            result
            for request, results in calls
            for result in results
            if request.input_ids == prompt + response
            and result.output_ids
            and sample.response_ids[len(response) : len(response) + len(result.output_ids)] == result.output_ids
        ]
        if answers:
            result = answers[0]
            pieces.append(("engine", result.output_ids, result.output_logprobs))
            response += result.output_ids
            continue
        reply = reply_ids(sum(kind == "reply" for kind, *_ in pieces) + 1)
        assert sample.response_ids[len(response) : len(response) + 3] == reply, "neither a sampled turn nor a reply"
        pieces.append(("reply", reply, [0.0] * 3))
        response += reply
    return pieces
