"""The tool-calling episodes: a turn's call parsed, the tool run in its worker process, the reply's ids appended.

A small byte-level BPE tokenizer with Qwen3's chat and tool tokens stands in for Qwen3's (no download).
The turn a model samples need not be the tokenizer's own segmentation of its text: the tests give the
episode such a turn and show that re-tokenising the conversation would change the ids (what a
text-in/text-out rollout would then train on), while the episode appends the reply's ids to the ids
sampled, leaving them as they are.
"""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.data import PromptItem
from megatron_rl.data.synthetic_tokenizer import build_synthetic_tokenizer
from megatron_rl.rollout.episodes import build_episode
from megatron_rl.tools.calls import render_tool_response

CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [CALL, '{"name": "calculator", "arguments": {"expression": "1 + 2"}}', "the answer is 84"] * 50
    backend.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in CHAT_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token=None)


def _episode(tokenizer, **fields):
    rollout = RolloutConfig(episode="tool_calls", tools=["calculator"], tool_num_workers=1, **fields)
    return build_episode(rollout, tokenizer)


def _characters(tokenizer, text: str) -> list[int]:
    """``text`` as the model may sample it: a token per character (chat tokens whole), not the BPE segmentation."""
    ids: list[int] = []
    for piece in text.replace("<tool_call>", "\0<tool_call>\0").replace("</tool_call>", "\0</tool_call>\0").split("\0"):
        if piece in CHAT_TOKENS:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        else:
            ids += [i for char in piece for i in tokenizer.encode(char, add_special_tokens=False)]
    return ids


def test_a_call_is_answered_with_the_tool_message_ids_and_sampled_ids_stay_as_sampled(tokenizer):
    episode = _episode(tokenizer)
    try:
        assert episode.stop_token_ids == (tokenizer.convert_tokens_to_ids("</tool_call>"),)
        item = PromptItem(0, tokenizer.encode("<|im_start|>user\nwhat is 12 * 7?<|im_end|>\n"), "84", "test")
        turn = _characters(tokenizer, "I will compute it.\n" + CALL)
        assert tokenizer.decode(turn) == "I will compute it.\n" + CALL
        future = episode.reply(item, turn, turns=1)
        assert future is not None
        reply = future.result(timeout=60)
        assert reply.tool == "calculator" and reply.failure is None
        assert reply.ids == tokenizer.encode(render_tool_response("84"), add_special_tokens=False)
        # What the next turn continues from: the ids sampled, then the reply's, never the text re-tokenised.
        sent = [*item.prompt_ids, *turn, *reply.ids]
        retokenised = tokenizer.encode(tokenizer.decode(sent), add_special_tokens=False)
        assert tokenizer.decode(retokenised) == tokenizer.decode(sent) and retokenised != sent
    finally:
        episode.close()


def test_turns_without_a_call_or_past_max_turns_end_the_episode_and_bad_calls_get_an_error(tokenizer):
    episode = _episode(tokenizer, max_turns=2)
    close = tokenizer.convert_tokens_to_ids("</tool_call>")
    try:
        item = PromptItem(0, [1, 2], "84", "test")
        answer = tokenizer.encode("the answer is 84", add_special_tokens=False) + [tokenizer.eos_token_id]
        assert episode.reply(item, answer, turns=1) is None
        assert episode.reply(item, _characters(tokenizer, CALL), turns=2) is None  # the last turn: not run
        bad = tokenizer.encode('<tool_call>\n{"name": "calculator", "arguments": 3}\n', add_special_tokens=False)
        reply = episode.reply(item, [*bad, close], turns=1).result(timeout=60)
        assert reply.failure == "error" and reply.tool is None
        assert '"arguments" of a tool call must be a JSON object' in tokenizer.decode(reply.ids)
        unknown = CALL.replace("calculator", "browser")
        reply = episode.reply(item, _characters(tokenizer, unknown), turns=1).result(timeout=60)
        assert reply.failure == "error" and "unknown tool 'browser'" in tokenizer.decode(reply.ids)
    finally:
        episode.close()


def test_the_synthetic_episode_reply_is_the_chat_template_rendering_of_the_tool_message():
    tokenizer = build_synthetic_tokenizer(tools=True)
    rollout = RolloutConfig(episode="synthetic_tool_calls", tools=["synthetic_lookup"], max_turns=2, tool_num_workers=1)
    episode = build_episode(rollout, tokenizer)
    try:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "ask 3"}], add_generation_prompt=True, return_dict=False
        )
        context = {"tools_kwargs": {"synthetic_lookup": {"table": "0123456789", "key": 3}}}
        item = PromptItem(0, list(prompt), "3", "test", context)
        call = tokenizer.convert_tokens_to_ids("<call>")
        reply = episode.reply(item, [call], turns=1).result(timeout=60)
        answer = tokenizer.encode("3", add_special_tokens=False) + [tokenizer.eos_token_id]
        conversation = [
            {"role": "user", "content": "ask 3"},
            {"role": "assistant", "content": "<call>"},
            {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "3"},
        ]
        assert [*item.prompt_ids, call, *reply.ids, *answer] == list(
            tokenizer.apply_chat_template(conversation, return_dict=False)
        )
    finally:
        episode.close()


def test_an_episode_of_the_wrong_chat_format_is_refused_naming_the_field():
    rollout = RolloutConfig(episode="tool_calls", tools=["calculator"])
    with pytest.raises(ValueError, match=r"rollout.episode: 'tool_calls' ends a turn at '</tool_call>'"):
        build_episode(rollout, build_synthetic_tokenizer())
