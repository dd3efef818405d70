"""Multi-turn episodes through the rollout manager and a real reference engine: token-in/token-out.

The episode here is written as a user would (:class:`megatron_rl.rollout.episodes.Episode`): a turn ends at
any of a third of the vocabulary, and the environment replies with three ids of its own. A recording
wrapper keeps every request the engine got and every answer it gave, so the tests can hold the trained
data to what the engine sampled, turn by turn.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.rollout.engine import EngineUnavailableError
from megatron_rl.rollout.episodes import EnvironmentReply, Episode
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.protocol import GenerateRequest, GenerateResult
from megatron_rl.rollout.reference.backend import ReferenceBackend
from tests.reference_servers import serving
from tests.tiny_checkpoints import save_tiny_moe

REWARD = "tests.rollout_rewards:first_token_parity"
STOPS = tuple(range(10, 40))
MAX_TURNS = 4


def _reply_ids(turns: int) -> list[int]:
    return [97, 98, 90 + turns]


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
        failure = {2: "limit", 3: "error"}.get(turns)
        future.set_result(EnvironmentReply(_reply_ids(turns), tool="echo", failure=failure))
        return future


class RecordingEngine:
    """Delegates to an engine and records each ``/generate`` request with its answers; with ``crash_at_follow_up``,
    the first request of a later turn fails as if the engine process were gone."""

    def __init__(self, engine, *, crash_at_follow_up: bool = False) -> None:
        self._engine = engine
        self.calls: list[tuple[GenerateRequest, list[GenerateResult]]] = []
        self._lock = threading.Lock()
        self.crash_pending = crash_at_follow_up

    def generate(self, request: GenerateRequest, **kwargs) -> list[GenerateResult]:
        with self._lock:
            crash = self.crash_pending and request.rid.count(".") == 3
            self.crash_pending = self.crash_pending and not crash
        if crash:
            raise EngineUnavailableError("engine ref: /generate failed: the process is gone (test)")
        results = self._engine.generate(request, **kwargs)
        with self._lock:
            self.calls.append((request, results))
        return results

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny_moe(tmp_path_factory.mktemp("episodes") / "moe", max_position_embeddings=128)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _run(model, *, partial_tokens: int | None = None, steps: int = 1, seed: int = 7, crash: bool = False):
    """``steps`` rollout steps of 3 prompts x 4 samples in ReplyingEpisode; the groups, the engine's calls, the episode."""
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
    with serving(ReferenceBackend(model), routed_experts_shape=(4, 2)) as http:
        engine = RecordingEngine(http, crash_at_follow_up=crash)
        recoveries: list[int] = []

        def recover(failures):
            recoveries.append(len(failures))
            return [engine]

        manager = RolloutManager(
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
            routing_replay=True,
            seed=seed,
            episode=episode,
            recover=recover,
        )
        try:
            groups = [group for step in range(steps) for group in manager.generate_step(step + 1).groups]
        finally:
            manager.close()
    assert recoveries == ([1] if crash else [])
    return groups, engine.calls, episode


def _pieces(sample, calls, prompt: list[int]) -> list[tuple[str, list[int], list[float]]]:
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
        reply = _reply_ids(sum(kind == "reply" for kind, *_ in pieces) + 1)
        assert sample.response_ids[len(response) : len(response) + 3] == reply, "neither a sampled turn nor a reply"
        pieces.append(("reply", reply, [0.0] * 3))
        response += reply
    return pieces


def test_trained_ids_are_the_engines_ids_turn_by_turn_and_replies_are_masked(model):
    groups, calls, episode = _run(model)
    multi = 0
    for group in groups:
        for sample in group.samples:
            pieces = _pieces(sample, calls, sample.prompt_ids)
            assert [t for _, ids, _ in pieces for t in ids] == sample.response_ids
            assert [lp for _, _, lps in pieces for lp in lps] == sample.rollout_logprobs
            assert sample.loss_mask == [int(kind == "engine") for kind, ids, _ in pieces for _ in ids]
            replies = sum(kind == "reply" for kind, *_ in pieces)
            assert sample.turns == replies + 1 and sample.tools.calls == replies
            assert sample.tools.limit_stops == (replies >= 2) and sample.tools.errors == (replies >= 3)
            assert sample.policy_tokens == (None if not replies else sum(sample.loss_mask))
            assert sample.turns <= MAX_TURNS
            # Routing covers every token fed to the engine: the last request's prompt plus its answer.
            assert sample.routed_experts.shape[0] == len(sample.prompt_ids) + len(sample.response_ids) - 1
            multi += replies > 0
    assert multi >= 4, "too few multi-turn samples to test anything"
    # Every turn the episode was asked about is exactly what the engine sampled in that turn.
    sampled_turns = {tuple(results[0].output_ids) for _, results in calls if len(results) == 1}
    for _, turn_ids, _ in episode.asked:
        assert tuple(turn_ids) in sampled_turns or any(
            tuple(turn_ids) == tuple(result.output_ids) for _, results in calls for result in results
        )


def test_a_later_turn_continues_from_the_ids_not_from_text(model):
    _, calls, _ = _run(model)
    follow_ups = [request for request, _ in calls if request.rid.count(".") == 3]
    assert follow_ups, "no later turn was sent"
    for request in follow_ups:
        assert request.input_ids[-3:-1] == [97, 98]  # the reply's ids end the input the engine continues from
        assert request.sampling_params.stop_token_ids == list(STOPS) and request.sampling_params.n == 1


def test_episodes_are_repeatable_and_span_partial_rollout_windows(model):
    first, _, _ = _run(model, partial_tokens=6, steps=3)
    again, calls, _ = _run(model, partial_tokens=6, steps=3)
    assert [(g.uid, [s.response_ids for s in g.samples]) for g in first] == [
        (g.uid, [s.response_ids for s in g.samples]) for g in again
    ]
    windows = {request.rid.split(".")[1] for request, _ in calls if request.rid.count(".") >= 2}
    assert len(windows) >= 2, "no response went on in a later window"
    for group in again:
        for sample in group.samples:
            pieces = _pieces(sample, calls, sample.prompt_ids)
            assert [t for _, ids, _ in pieces for t in ids] == sample.response_ids
            assert sample.loss_mask == [int(kind == "engine") for kind, ids, _ in pieces for _ in ids]


def test_a_crash_in_a_later_turn_sends_the_window_again_and_keeps_the_groups_of_a_run_without_it(model):
    expected, _, _ = _run(model)
    groups, calls, _ = _run(model, crash=True)
    assert [(g.uid, [(s.response_ids, s.loss_mask) for s in g.samples]) for g in groups] == [
        (g.uid, [(s.response_ids, s.loss_mask) for s in g.samples]) for g in expected
    ]
