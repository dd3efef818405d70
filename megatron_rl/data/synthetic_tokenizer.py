"""The synthetic tasks' fixed vocabulary, chat template and tokenizer (built locally, no download).

Token ids are positions in ``SYNTHETIC_VOCAB`` and never change: checkpoints of the tiny model
depend on them. A model trained on the synthetic tasks needs ``vocab_size >=
SYNTHETIC_VOCAB_SIZE`` (18; 21 for the ``lookup`` task's, :data:`TOOL_TASK_TOKENS` appended); padding the embedding beyond it is fine, the tokenizer never
produces those ids.

The tokenizer is a word-level model in the Hugging Face format: text is split on whitespace
and between digits (``"max 37"`` -> ``max 3 7``), unknown words map to ``<unk>``, plain
encoding adds no special tokens, and decoding joins tokens with single spaces
(``decode([id("4"), EOS_TOKEN_ID]) == "4 <eos>"``). Chat rendering, with
``add_generation_prompt=True``::

    [{"role": "user", "content": "succ 3"}]  ->  "<bos> <user> succ 3 <assistant>"

An assistant turn renders as ``" <assistant> {content} <eos>"``, or without ``<eos>`` when it ends in a
tool call (``<call>``, the multi-turn ``lookup`` task's one-token call); a tool message renders as
``" <tool> {content}"``; other roles are refused. So a whole lookup conversation renders as the ids a
multi-turn episode sends the engine::

    <bos> <user> ask 3 <assistant> <call> <tool> 7 <assistant> 7 <eos>
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, models, pre_tokenizers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"
UNK_TOKEN = "<unk>"
USER_TOKEN = "<user>"
ASSISTANT_TOKEN = "<assistant>"
CALL_TOKEN = "<call>"
TOOL_TOKEN = "<tool>"

SYNTHETIC_VOCAB: tuple[str, ...] = (
    PAD_TOKEN,
    EOS_TOKEN,
    BOS_TOKEN,
    UNK_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    *(str(digit) for digit in range(10)),
    "succ",
    "max",
)
SYNTHETIC_VOCAB_SIZE: int = len(SYNTHETIC_VOCAB)
TOOL_TASK_TOKENS: tuple[str, ...] = ("ask", CALL_TOKEN, TOOL_TOKEN)
"""The tool task's tokens, ids 18-20 of its tokenizer only: in the other tasks' tokenizer those ids stay unknown
and decode to nothing, as they always have (a model samples them: adding them would change its rewards)."""
PAD_TOKEN_ID: int = SYNTHETIC_VOCAB.index(PAD_TOKEN)
EOS_TOKEN_ID: int = SYNTHETIC_VOCAB.index(EOS_TOKEN)
BOS_TOKEN_ID: int = SYNTHETIC_VOCAB.index(BOS_TOKEN)

SYNTHETIC_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %} <user> {{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %} <assistant> {{ message['content'] }}"
    "{% if not message['content'].endswith('<call>') %} {{ eos_token }}{% endif %}"
    "{% elif message['role'] == 'tool' %} <tool> {{ message['content'] }}"
    "{% else %}{{ raise_exception('synthetic chat template: unsupported role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %} <assistant>{% endif %}"
)


def build_synthetic_tokenizer(*, tools: bool = False) -> PreTrainedTokenizerFast:
    """A fresh tokenizer with ``len(tokenizer) == SYNTHETIC_VOCAB_SIZE``, pad/eos/bos set and the chat template;
    ``tools``: the ``lookup`` task's, with :data:`TOOL_TASK_TOKENS` after them."""
    vocab = SYNTHETIC_VOCAB + TOOL_TASK_TOKENS if tools else SYNTHETIC_VOCAB
    model = models.WordLevel({token: index for index, token in enumerate(vocab)}, unk_token=UNK_TOKEN)
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    from transformers import PreTrainedTokenizerFast  # here: reward workers import this module for the vocabulary

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, *([CALL_TOKEN, TOOL_TOKEN] if tools else [])],
        chat_template=SYNTHETIC_CHAT_TEMPLATE,
    )


def save_synthetic_tokenizer(directory: str | Path, *, tools: bool = False) -> Path:
    """Write the tokenizer (``tools``: the ``lookup`` task's) to ``directory`` (created if needed) for
    ``AutoTokenizer.from_pretrained``; return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_synthetic_tokenizer(tools=tools).save_pretrained(directory)
    return directory
