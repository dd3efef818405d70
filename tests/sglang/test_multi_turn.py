"""A multi-turn episode on the real SGLang 0.5.23 (CPU, fp32), driven by our rollout manager.

What the episode adds on the wire: ``sampling_params.stop_token_ids`` (the turn ends at a stop id, which
SGLang keeps in ``output_ids`` because we always send ``no_stop_trim``) and n=1 follow-up requests whose
``input_ids`` are the prompt, every response id so far and the environment's reply. The trained response
must be exactly what SGLang sampled turn by turn with the replies between, and the log-probs SGLang reports
in a later turn must be the ones the trainer recomputes over the whole sequence (transformers here).
"""

from __future__ import annotations

import pytest
import torch

from tests.multi_turn_cases import (
    MAX_TURNS,
    STOPS,
    TWO_CALL_TURN,
    RecordingEngine,
    response_pieces,
    run_episodes,
)
from tests.sglang.transformers_decode import load_model

LOGPROB_TOLERANCE = 1e-4
"""fp32 engine against an fp64 softmax of fp32 logits, as in test_generate."""


@torch.no_grad()
def _whole_sequence_log_probs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from one forward over the whole sequence (what the trainer does)."""
    logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


def _calls_answered(pieces: list[tuple[str, list[int], list[float]]]) -> int:
    """The tool calls ReplyingEpisode answered in a response of ``pieces`` (one engine piece per turn): a turn ended
    at a stop id before the last turn gets a reply, of two calls after turn TWO_CALL_TURN. Counted from the turns,
    not the replies: a reply that leaves no room for the next turn is left out of the response, its calls ran."""
    turns = [ids for kind, ids, _ in pieces if kind == "engine"]
    answered = [turn for turn, ids in enumerate(turns, start=1) if ids[-1] in STOPS and turn < MAX_TURNS]
    return sum(2 if turn == TWO_CALL_TURN else 1 for turn in answered)


def test_a_multi_turn_episode_trains_on_what_sglang_sampled_turn_by_turn(sglang, moe_dir):
    engine = RecordingEngine(sglang)
    groups, recoveries, _ = run_episodes(engine, routing_replay=False)
    assert recoveries == []
    model = load_model(moe_dir)
    later_turn_tokens = 0
    for group in groups:
        for sample in group.samples:
            pieces = response_pieces(sample, engine.calls, sample.prompt_ids)
            assert [t for _, ids, _ in pieces for t in ids] == sample.response_ids
            assert [lp for _, _, lps in pieces for lp in lps] == sample.rollout_logprobs
            assert sample.loss_mask == [int(kind == "engine") for kind, ids, _ in pieces for _ in ids]
            assert sample.tools.calls == _calls_answered(pieces)
            for (kind, ids, _), following in zip(pieces, pieces[1:], strict=False):
                if kind == "engine" and following[0] == "reply":
                    assert ids[-1] in STOPS, "a turn the environment answered must end at its stop token"
            recomputed = _whole_sequence_log_probs(model, sample.prompt_ids + sample.response_ids)
            trained = recomputed[len(sample.prompt_ids) - 1 :]
            for position, (engine_logprob, in_loss) in enumerate(
                zip(sample.rollout_logprobs, sample.loss_mask, strict=True)
            ):
                if in_loss:
                    assert engine_logprob == pytest.approx(trained[position], abs=LOGPROB_TOLERANCE), position
            first_reply = next((i for i, (kind, _, _) in enumerate(pieces) if kind == "reply"), len(pieces))
            later_turn_tokens += sum(len(ids) for kind, ids, _ in pieces[first_reply:] if kind == "engine")
    assert later_turn_tokens >= 10, "too few tokens sampled after a reply to test later turns"
    stopped = [
        result
        for _, results in engine.calls
        for result in results
        if result.output_ids and result.output_ids[-1] in STOPS
    ]
    assert stopped, "no turn ended at a stop token"
    for result in stopped:
        assert result.finish_reason.type == "stop" and result.finish_reason.matched == result.output_ids[-1]
    follow_ups = [
        request for request, _ in engine.calls if isinstance(request.rid, str) and request.rid.count(".") == 3
    ]
    assert follow_ups and all(request.sampling_params.n == 1 for request in follow_ups)
