"""Qwen3's tool-call episode through the rollout manager and a real reference engine: a turn of two calls.

The model is the tiny Qwen3-MoE with its attention and expert outputs zeroed, so each next token depends
on the last one only, and its embeddings and output head set so that after the generation prompt it
samples (at temperature 1, by a margin of e^100) a text token, two ``<tool_call>`` blocks and
``<|im_end|>``. Each of those is one token of the tokenizer (added tokens), so that chain of tokens holds
no repeat. The calculator runs both calls; the manager appends the reply, the model samples its second
turn (the same chain: the reply ends with the generation prompt's last token), and ``rollout.max_turns=2``
ends the episode there. With partial rollouts, a turn's tokens come over several windows, and the
episode reads the whole turn.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken

from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.rollout.episodes import build_episode
from megatron_rl.rollout.manager import RolloutManager
from megatron_rl.rollout.reference.backend import ReferenceBackend
from tests.multi_turn_cases import RecordingEngine
from tests.qwen3_chat import build_qwen3_like_tokenizer
from tests.reference_servers import serving
from tests.tiny_checkpoints import chain_model, save_tiny_moe

EXPRESSIONS = ("1 + 2", "3 * 4")
TEXT = "Two calls.\n"


def _call(expression: str) -> str:
    arguments = json.dumps({"expression": expression})
    return '<tool_call>\n{"name": "calculator", "arguments": ' + arguments + "}\n</tool_call>"


@pytest.mark.parametrize("partial_tokens", [None, 2])
def test_a_turn_of_two_calls_runs_both_and_appends_the_templates_two_tool_messages(tmp_path, partial_tokens):
    """``partial_tokens=2``: partial rollouts, each turn of 4 tokens sampled over two windows (steps)."""
    tokenizer = build_qwen3_like_tokenizer()
    blocks = [TEXT, _call(EXPRESSIONS[0]), "\n" + _call(EXPRESSIONS[1])]
    tokenizer.add_tokens([AddedToken(block, special=False, normalized=False) for block in blocks])
    question = [{"role": "user", "content": "1 + 2 and 3 * 4?"}]
    prompt = list(tokenizer.apply_chat_template(question, add_generation_prompt=True, return_dict=False))
    turn = [*tokenizer.convert_tokens_to_ids(blocks), tokenizer.eos_token_id]
    path = save_tiny_moe(tmp_path / "moe", vocab_size=512, max_position_embeddings=256)
    model = chain_model(path, [prompt[-1], *turn], len(tokenizer))
    rollout = RolloutConfig(
        engine="reference",
        n_samples_per_prompt=2,
        max_response_length=128,
        max_concurrent_requests=2,
        episode="tool_calls",
        tools=["calculator"],
        tool_num_workers=2,
        max_turns=2,
        partial_rollout_tokens=partial_tokens,
    )
    episode = build_episode(rollout, tokenizer)
    try:
        with serving(ReferenceBackend(model)) as http:
            engine = RecordingEngine(http)
            manager = RolloutManager(
                [engine],
                PromptDataset([PromptItem(0, prompt, "constant", "test")], 0),
                PromptSampler(1, 1, seed=0, shuffle=False),
                rollout,
                OverlongConfig(enable=False),
                DynamicSamplingConfig(enable=False),
                prompts_per_step=1,
                reward="tests.rollout_rewards:first_token_parity",
                reward_num_workers=1,
                reward_timeout_s=30.0,
                decode=lambda ids: str(tokenizer.decode(ids)),
                routing_replay=False,
                seed=3,
                episode=episode,
                recover=lambda failures: [engine],
            )
            try:
                groups = [group for step in range(1, 4) for group in manager.generate_step(step).groups]
            finally:
                manager.close()
    finally:
        episode.close()
    calls = [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}} for e in EXPRESSIONS
    ]
    conversation = [
        *question,
        {"role": "assistant", "content": TEXT.strip(), "tool_calls": calls},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "12"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    reply = tokenizer.encode(rendered.partition("</tool_call><|im_end|>")[2], add_special_tokens=False)
    windows = {request.rid.split(".")[1] for request, _ in engine.calls if request.rid.count(".") >= 2}
    assert groups and (partial_tokens is None or len(windows) >= 2), "no response went on in a later window"
    for sample in (sample for group in groups for sample in group.samples):
        assert sample.response_ids == [*turn, *reply, *turn]  # the second turn's calls: the last turn, not run
        assert tokenizer.decode([*prompt, *turn, *reply]) == rendered
        assert sample.loss_mask == [1] * len(turn) + [0] * len(reply) + [1] * len(turn)
        assert sample.rollout_logprobs[len(turn) : -len(turn)] == [0.0] * len(reply)
        assert all(-1e-3 < logprob <= 0.0 for logprob in sample.rollout_logprobs)
        assert sample.turns == 2 and sample.tools.calls == 2 and sample.tools.errors == 0
