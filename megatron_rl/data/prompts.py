"""Turn dataset prompt values into token ids with a Hugging Face tokenizer.

A prompt is either a plain string or a list of chat messages (``{"role", "content"}`` dicts).
Message lists, and plain strings when ``wrap_text_in_chat`` is set (as one user message), go
through ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``; the rendered text is
tokenised without adding special tokens (the template writes them). Other plain strings are
tokenised as they are, with the tokenizer's usual special tokens (e.g. a BOS for Llama-style
tokenizers, nothing for Qwen).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[dict[str, Any]]


def validate_prompt(value: Any, where: str) -> Prompt:
    """Return ``value`` as a string or a list of message dicts with some text.

    Raises ValueError naming ``where`` for any other value, for binary (not text) values, and for
    an empty prompt (a blank string, or messages whose contents are all blank).
    """
    if isinstance(value, (bytes, bytearray)):
        raise ValueError(
            f"{where}: the prompt is binary data, not text ({bytes(value[:40])!r}...); write the column as UTF-8 "
            "strings"
        )
    if isinstance(value, str):
        _require_text(value, where)
        return value
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
            for message in value
        )
    ):
        _require_text("".join(message["content"] for message in value), where)
        return [dict(message) for message in value]
    raise ValueError(
        f"{where}: a prompt must be a string or a non-empty list of messages with string 'role' and "
        f"'content', got {type(value).__name__}: {str(value)[:200]}"
    )


def _require_text(text: str, where: str) -> None:
    if not text.strip():
        raise ValueError(
            f"{where}: the prompt is empty{' (whitespace only)' if text else ''}; the model would be asked "
            "nothing: fill it in or remove the row"
        )


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    *,
    wrap_text_in_chat: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, bool]:
    """The text to tokenise for ``prompt`` and whether the tokenizer should add its special tokens."""
    if isinstance(prompt, str) and not wrap_text_in_chat:
        return prompt, True
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
    )
    assert isinstance(text, str), "apply_chat_template(tokenize=False) returns the text"
    return text, False


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    wrap_text_in_chat: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt, in order (see the module docstring for the rules).

    Raises ValueError when a prompt needs a chat template and the tokenizer has none.
    """
    needs_template = wrap_text_in_chat or any(not isinstance(prompt, str) for prompt in prompts)
    if needs_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the prompts need a chat template (chat messages, or wrap_text_in_chat=True) but tokenizer "
            f"{getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat_template"
        )
    rendered = [
        render_prompt(tokenizer, prompt, wrap_text_in_chat=wrap_text_in_chat, chat_template_kwargs=chat_template_kwargs)
        for prompt in prompts
    ]
    token_ids: list[list[int]] = [[] for _ in prompts]
    for add_special_tokens in (False, True):
        positions = [i for i, (_, flag) in enumerate(rendered) if flag is add_special_tokens]
        if not positions:
            continue
        encoded = tokenizer(
            [rendered[i][0] for i in positions], add_special_tokens=add_special_tokens, return_attention_mask=False
        )["input_ids"]
        for position, ids in zip(positions, encoded, strict=True):
            token_ids[position] = list(ids)
    return token_ids
