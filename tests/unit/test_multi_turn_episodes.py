"""Multi-turn episodes through the rollout manager and a real reference engine: token-in/token-out.

The episode here is written as a user would (:class:`megatron_rl.rollout.episodes.Episode`): a turn ends at
any of a third of the vocabulary, and the environment replies with three ids of its own. A recording
wrapper keeps every request the engine got and every answer it gave, so the tests can hold the trained
data to what the engine sampled, turn by turn.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.engines.reference.backend import ReferenceBackend
from tests.multi_turn_cases import MAX_TURNS, STOPS, RecordingEngine, response_pieces, run_episodes, tool_calls
from tests.reference_servers import serving
from tests.tiny_checkpoints import save_tiny_moe


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny_moe(tmp_path_factory.mktemp("episodes") / "moe", max_position_embeddings=128)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _run(model, *, partial_tokens: int | None = None, steps: int = 1, seed: int = 7, crash: bool = False):
    """``steps`` rollout steps of 3 prompts x 4 samples in ReplyingEpisode; the groups, the engine's calls, the episode."""
    with serving(ReferenceBackend(model), routed_experts_shape=(4, 2)) as http:
        engine = RecordingEngine(http, crash_at_follow_up=crash)
        groups, recoveries, episode = run_episodes(
            engine, routing_replay=True, partial_tokens=partial_tokens, steps=steps, seed=seed
        )
    assert recoveries == ([1] if crash else [])
    return groups, engine.calls, episode


def test_trained_ids_are_the_engines_ids_turn_by_turn_and_replies_are_masked(model):
    groups, calls, episode = _run(model)
    multi = 0
    for group in groups:
        for sample in group.samples:
            pieces = response_pieces(sample, calls, sample.prompt_ids)
            assert [t for _, ids, _ in pieces for t in ids] == sample.response_ids
            assert [lp for _, _, lps in pieces for lp in lps] == sample.rollout_logprobs
            assert sample.loss_mask == [int(kind == "engine") for kind, ids, _ in pieces for _ in ids]
            replies = sum(kind == "reply" for kind, *_ in pieces)
            assert sample.turns == replies + 1 and sample.tools.calls == tool_calls(replies)
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
            pieces = response_pieces(sample, calls, sample.prompt_ids)
            assert [t for _, ids, _ in pieces for t in ids] == sample.response_ids
            assert sample.loss_mask == [int(kind == "engine") for kind, ids, _ in pieces for _ in ids]


def test_a_crash_in_a_later_turn_sends_the_window_again_and_keeps_the_groups_of_a_run_without_it(model):
    expected, _, _ = _run(model)
    groups, calls, _ = _run(model, crash=True)
    assert [(g.uid, [(s.response_ids, s.loss_mask) for s in g.samples]) for g in groups] == [
        (g.uid, [(s.response_ids, s.loss_mask) for s in g.samples]) for g in expected
    ]
