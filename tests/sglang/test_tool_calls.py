"""Qwen3's tool-call episode on the real SGLang 0.5.23 (CPU, fp32): a turn of two calls runs both, and the reply is
Qwen3's chat template rendering of two tool messages (the case: tests/two_call_turn.py)."""

from __future__ import annotations

import pytest

from tests.sglang.conftest import start_sglang
from tests.two_call_turn import check_two_call_samples, run_two_call_episodes, two_call_case, two_call_rollout


@pytest.mark.full  # a server of its own (42 s); CI's tests/sglang/test_multi_turn.py answers two calls on SGLang
def test_a_turn_of_two_calls_runs_both_and_appends_the_templates_two_tool_messages(tmp_path):
    case = two_call_case(tmp_path)
    case.model.save_pretrained(tmp_path / "chain")  # SGLang reads ids only (--skip-tokenizer-init)
    sglang = start_sglang(tmp_path / "chain", tmp_path / "logs", max_total_tokens=2048)
    try:
        groups, _ = run_two_call_episodes(case, sglang, two_call_rollout("sglang"), steps=1)
    finally:
        sglang.shutdown()
    check_two_call_samples(case, groups)
