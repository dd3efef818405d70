"""A Qwen3 tool-call episode whose first turn makes two calls, for any engine: the case and its checks.

The model is the tiny Qwen3-MoE with its attention and expert outputs zeroed, so each next token depends
on the last one only, and its embeddings and output head set so that after the generation prompt it
samples (at temperature 1, by a margin of e^100) a text token, two ``<tool_call>`` blocks and
``<|im_end|>``. Each of those is one token of the tokenizer (added tokens), so that chain of tokens holds
no repeat. The calculator runs both calls; the manager appends the reply, the model samples its second
turn (the same chain: the reply ends with the generation prompt's last token), and ``rollout.max_turns=2``
ends the episode there. With partial rollouts, a turn's tokens come over several windows, and the
episode reads the whole turn. Used by tests/unit/test_tool_calls_on_reference_engine.py and
tests/sglang/test_tool_calls.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig, RolloutConfig
from megatron_rl.data import PromptDataset, PromptItem, PromptSampler
from megatron_rl.engines.http_engine import HttpEngine
from megatron_rl.rollout.episodes import build_episode
from tests.multi_turn_cases import RecordingEngine
from tests.qwen3_chat import build_qwen3_like_tokenizer
from tests.rollout_managers import build_manager
from tests.tiny_checkpoints import chain_model, save_tiny_moe

EXPRESSIONS = ("1 + 2", "3 * 4")
TEXT = "Two calls.\n"


def _call(expression: str) -> str:
    arguments = json.dumps({"expression": expression})
    return '<tool_call>\n{"name": "calculator", "arguments": ' + arguments + "}\n</tool_call>"


@dataclass
class TwoCallCase:
    """The tokenizer, the question and its prompt ids, the turn the model samples, and the model."""

    tokenizer: PreTrainedTokenizerFast
    question: list[dict[str, str]]
    prompt: list[int]
    turn: list[int]
    model: PreTrainedModel


def two_call_case(tmp_path: Path) -> TwoCallCase:
    """The case, its model a tiny MoE made to sample the two-call turn after the generation prompt."""
    tokenizer = build_qwen3_like_tokenizer()
    blocks = [TEXT, _call(EXPRESSIONS[0]), "\n" + _call(EXPRESSIONS[1])]
    tokenizer.add_tokens([AddedToken(block, special=False, normalized=False) for block in blocks])
    question = [{"role": "user", "content": "1 + 2 and 3 * 4?"}]
    prompt = list(tokenizer.apply_chat_template(question, add_generation_prompt=True, return_dict=False))
    block_ids = tokenizer.convert_tokens_to_ids(blocks)
    assert isinstance(block_ids, list)  # a list of tokens gives a list of ids
    turn = [*block_ids, tokenizer.eos_token_id]
    path = save_tiny_moe(tmp_path / "moe", vocab_size=512, max_position_embeddings=256)
    return TwoCallCase(tokenizer, question, prompt, turn, chain_model(path, [prompt[-1], *turn], len(tokenizer)))


def run_two_call_episodes(
    case: TwoCallCase, http: HttpEngine, rollout: RolloutConfig, steps: int
) -> tuple[list, RecordingEngine]:
    """``steps`` steps of one prompt's group through the rollout manager on ``http``; the groups and the engine's
    recorded requests."""
    tokenizer = case.tokenizer
    episode = build_episode(rollout, tokenizer)
    engine = RecordingEngine(http)
    try:
        manager = build_manager(
            [engine],
            PromptDataset([PromptItem(0, case.prompt, "constant", "test")], 0),
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
            groups = [group for step in range(1, steps + 1) for group in manager.generate_step(step).groups]
        finally:
            manager.close()
    finally:
        episode.close()
    return groups, engine


def two_call_rollout(
    engine: Literal["sglang", "reference"], partial_tokens: int | None = None, **fields: Any
) -> RolloutConfig:
    """The episode's rollout section: two turns of the tool-call episode with the calculator."""
    return RolloutConfig(
        engine=engine,
        n_samples_per_prompt=2,
        max_response_length=128,
        max_concurrent_requests=2,
        episode="tool_calls",
        tools=["calculator"],
        tool_num_workers=2,
        max_turns=2,
        partial_rollout_tokens=partial_tokens,
        **fields,
    )


def check_two_call_samples(case: TwoCallCase, groups: list) -> None:
    """Both calls ran, the response is the sampled turn, the template's two tool messages (masked), the next turn."""
    tokenizer, turn = case.tokenizer, case.turn
    calls = [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}} for e in EXPRESSIONS
    ]
    conversation: list[dict[str, Any]] = [
        *case.question,
        {"role": "assistant", "content": TEXT.strip(), "tool_calls": calls},
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "12"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str)  # tokenize=False returns the text
    reply = tokenizer.encode(rendered.partition("</tool_call><|im_end|>")[2], add_special_tokens=False)
    assert groups
    for sample in (sample for group in groups for sample in group.samples):
        assert sample.response_ids == [*turn, *reply, *turn]  # the second turn's calls: the last turn, not run
        assert tokenizer.decode([*case.prompt, *turn, *reply]) == rendered
        assert sample.loss_mask == [1] * len(turn) + [0] * len(reply) + [1] * len(turn)
        assert sample.rollout_logprobs[len(turn) : -len(turn)] == [0.0] * len(reply)
        assert all(-1e-3 < logprob <= 0.0 for logprob in sample.rollout_logprobs)
        assert sample.turns == 2 and sample.tools.calls == 2 and sample.tools.errors == 0
