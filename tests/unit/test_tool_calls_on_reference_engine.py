"""Qwen3's tool-call episode through the rollout manager and a real reference engine: a turn of two calls
(the case: tests/two_call_turn.py)."""

from __future__ import annotations

import pytest

from megatron_rl.engines.reference.backend import ReferenceBackend
from tests.reference_servers import serving
from tests.two_call_turn import check_two_call_samples, run_two_call_episodes, two_call_case, two_call_rollout


@pytest.mark.parametrize("partial_tokens", [None, 2])
def test_a_turn_of_two_calls_runs_both_and_appends_the_templates_two_tool_messages(tmp_path, partial_tokens):
    """``partial_tokens=2``: partial rollouts, each turn of 4 tokens sampled over two windows (steps)."""
    case = two_call_case(tmp_path)
    with serving(ReferenceBackend(case.model)) as http:
        groups, engine = run_two_call_episodes(case, http, two_call_rollout("reference", partial_tokens), steps=3)
    rids = [request.rid for request, _ in engine.calls if isinstance(request.rid, str)]
    windows = {rid.split(".")[1] for rid in rids if rid.count(".") >= 2}
    assert partial_tokens is None or len(windows) >= 2, "no response went on in a later window"
    check_two_call_samples(case, groups)
