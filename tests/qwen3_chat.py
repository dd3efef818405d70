"""Qwen3's chat template (the messages part, without thinking) and a small tokenizer carrying it (no download).

:data:`QWEN3_CHAT_TEMPLATE` is Qwen3's ``tokenizer_config.json`` ``chat_template`` (cited in
:mod:`megatron_rl.tools.calls`) for system, user, assistant (content and ``tool_calls``) and tool messages
and the generation prompt, copied block by block; left out are the tools' system prompt (rendered when the
request passes ``tools``) and the ``<think>`` handling (reasoning content, ``enable_thinking``). The
tokenizer is a byte-level BPE with Qwen3's chat and tool tokens, trained on tool-call text.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

QWEN3_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>'


def build_qwen3_like_tokenizer() -> PreTrainedTokenizerFast:
    """A 400-token byte-level BPE with Qwen3's chat and tool tokens (not special: they survive decoding),
    ``<|im_end|>`` as EOS and :data:`QWEN3_CHAT_TEMPLATE` as its chat template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [CALL, '{"name": "calculator", "arguments": {"expression": "1 + 2"}}', "the answer is 84"] * 50
    backend.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in CHAT_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token=None)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer
