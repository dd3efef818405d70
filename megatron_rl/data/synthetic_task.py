"""Synthetic tasks for the tiny CPU run: prompts, verl-layout parquet files and the reward.

Each task draws single digits; the answer is one digit:

- ``successor``: ``"succ d"`` -> ``(d + 1) mod 10`` (10 distinct prompts);
- ``max``: ``"max a b"`` -> ``max(a, b)`` (100 distinct prompts; harder: the answer depends on a
  digit that is not the last prompt token, so the model must learn attention);
- ``lookup``: ``"ask k"`` -> entry k of a table of 10 random digits drawn for each row and never shown
  in the prompt: only a tool call finds it (a guess is right one time in ten). The row's
  ``extra_info["tools_kwargs"]["synthetic_lookup"]`` holds the table and the key, which the tool
  ``synthetic_lookup`` (:mod:`megatron_rl.tools.synthetic_lookup`) reads; the ``synthetic_tool_calls`` episode calls it when the model emits
  ``<call>`` (:mod:`megatron_rl.rollout.tool_episode`), so a solved episode reads
  ``<call> <tool> 7 <assistant> 7 <eos>``.

Prompt formats (both read by ``load_prompt_dataset``):

- ``text`` (default): the prompt is a plain string, tokenised as is (``succ 3`` -> 2 tokens);
  the last prompt token is a digit, so ``successor`` is learnable from the last token alone;
- ``chat``: the prompt is ``[{"role": "user", "content": "succ 3"}]``, rendered by the chat
  template as ``<bos> <user> succ 3 <assistant>``.

Measured with the tiny recipes (DAPO, the 2-layer Qwen3-MoE, 8 prompts x 16 samples, Adam 1e-3,
150 steps; ``docs/algorithm-comparison.md``): ``successor``/``chat`` reaches greedy accuracy 1.00 in
3 of 3 seeds. ``successor``/``text`` stalls near 0.44-0.56: its prompt ends with a digit, like a
right answer just before ``<eos>``, and "stop after a digit" learnt from right answers makes the
model stop right after the prompt on some digits. (An earlier plain-PyTorch GRPO probe found
``max``/``text`` at 56-78% after 200 steps, 2 seeds.)

Reward: registered once per task as ``synthetic_<task>`` (the rows' ``data_source``:
``synthetic_successor``, ``synthetic_max``, ``synthetic_lookup``). The response text is split into
tokens (whitespace-separated words, with ``<...>`` markers split off, so ``"4<eos>"`` reads as
``4 <eos>``) and trailing ``<pad>`` tokens are ignored. It is correct iff the tokens are exactly
``[ground_truth, "<eos>"]``: score +1.0, else -1.0. In ``lookup`` the rule reads the final answer, the
tokens after the response's last ``<assistant>``, and accepts it only after a lookup (a ``<call>``
answered by a ``<tool>`` reply): a guess is wrong even when it is the right digit, so accuracy measures
tool use and a guess pays nothing (with guesses paid, one in ten, the policy settled on guessing before
it learnt to read the tool's reply: 0.09 greedy accuracy after 150 steps). A wrong digit, any extra token, or a
missing ``<eos>`` (a response cut at the length limit) is wrong, so long responses are always
wrong. Responses must be decoded with ``skip_special_tokens=False``: without the ``<eos>`` text
nothing scores +1.

Rows follow the verl layout::

    prompt:       "succ 3"  (text)  or  [{"role": "user", "content": "succ 3"}]  (chat)
    data_source:  "synthetic_successor"
    ability:      "synthetic"
    reward_model: {"style": "rule", "ground_truth": "4"}
    extra_info:   {"split": "train", "index": 0, "task": "successor"}
                  (lookup adds "tools_kwargs": {"synthetic_lookup": {"table": "8402751396", "key": 3}})
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_rl.data.rewards import RewardOutput, register_reward
from megatron_rl.data.synthetic_tokenizer import ASSISTANT_TOKEN, CALL_TOKEN, EOS_TOKEN, PAD_TOKEN, TOOL_TOKEN

_RESPONSE_TOKEN = re.compile(r"<[^<>\s]+>|[^\s<]+")


@dataclass(frozen=True)
class SyntheticExample:
    """One drawn row: the prompt text, the answer, and the tools' per-row context (``tools_kwargs``) if any."""

    prompt: str
    answer: str
    tools_kwargs: dict[str, dict[str, Any]] | None = None


def _successor(rng: random.Random) -> SyntheticExample:
    digit = rng.randrange(10)
    return SyntheticExample(f"succ {digit}", str((digit + 1) % 10))


def _max_of_two(rng: random.Random) -> SyntheticExample:
    first, second = rng.randrange(10), rng.randrange(10)
    return SyntheticExample(f"max {first} {second}", str(max(first, second)))


def _lookup(rng: random.Random) -> SyntheticExample:
    table = "".join(str(rng.randrange(10)) for _ in range(10))
    key = rng.randrange(10)
    return SyntheticExample(f"ask {key}", table[key], {"synthetic_lookup": {"table": table, "key": key}})


SYNTHETIC_TASKS: Mapping[str, Callable[[random.Random], SyntheticExample]] = MappingProxyType(
    {"successor": _successor, "max": _max_of_two, "lookup": _lookup}
)
TOOL_TASKS: frozenset[str] = frozenset({"lookup"})
"""Tasks answered by a tool call: their tokenizer has the tool tokens (``build_synthetic_tokenizer(tools=True)``)."""
SYNTHETIC_PROMPT_FORMATS: tuple[str, ...] = ("text", "chat")


@register_reward("synthetic_successor")
@register_reward("synthetic_max")
def synthetic_exact(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """+1.0 iff ``response`` is exactly the answer then ``<eos>`` (see the module docstring), else -1.0; the
    answer is the response's tokens, trailing ``<pad>`` dropped."""
    final = _final_answer(_RESPONSE_TOKEN.findall(response))
    correct = final == [ground_truth.strip(), EOS_TOKEN]
    return RewardOutput(score=1.0 if correct else -1.0, correct=correct, answer=" ".join(final) or None)


@register_reward("synthetic_lookup")
def synthetic_lookup_answer(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """+1.0 iff ``response`` looked the answer up (a ``<call>`` answered by a ``<tool>`` reply) and its final
    answer, the tokens after the last ``<assistant>``, is exactly the answer then ``<eos>``; else -1.0. The
    answer is that final answer; a response that did not look up gave none."""
    tokens = _RESPONSE_TOKEN.findall(response)
    looked_up = CALL_TOKEN in tokens and TOOL_TOKEN in tokens and ASSISTANT_TOKEN in tokens
    final = _final_answer(tokens[len(tokens) - tokens[::-1].index(ASSISTANT_TOKEN) :] if looked_up else [])
    correct = final == [ground_truth.strip(), EOS_TOKEN]
    return RewardOutput(score=1.0 if correct else -1.0, correct=correct, answer=" ".join(final) or None)


def _final_answer(tokens: list[str]) -> list[str]:
    """``tokens`` without trailing ``<pad>`` tokens."""
    while tokens and tokens[-1] == PAD_TOKEN:
        tokens = tokens[:-1]
    return tokens


@dataclass(frozen=True)
class SyntheticDatasetFiles:
    """Paths of the parquet files written by ``write_synthetic_dataset``."""

    train: Path
    val: Path


def synthetic_rows(
    task: str, num_rows: int, *, seed: int, split: str, prompt_format: str = "text"
) -> list[dict[str, Any]]:
    """``num_rows`` verl-layout rows of ``task``; the same arguments always give the same rows."""
    if task not in SYNTHETIC_TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; available: {', '.join(SYNTHETIC_TASKS)}")
    if prompt_format not in SYNTHETIC_PROMPT_FORMATS:
        raise ValueError(
            f"unknown synthetic prompt_format {prompt_format!r}; available: {', '.join(SYNTHETIC_PROMPT_FORMATS)}"
        )
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    rng = random.Random(f"{task}/{split}/{seed}")
    rows = []
    for index in range(num_rows):
        example = SYNTHETIC_TASKS[task](rng)
        extra_info: dict[str, Any] = {"split": split, "index": index, "task": task}
        if example.tools_kwargs is not None:
            extra_info["tools_kwargs"] = example.tools_kwargs
        rows.append(
            {
                "data_source": f"synthetic_{task}",
                "prompt": example.prompt if prompt_format == "text" else [{"role": "user", "content": example.prompt}],
                "ability": "synthetic",
                "reward_model": {"style": "rule", "ground_truth": example.answer},
                "extra_info": extra_info,
            }
        )
    return rows


def write_synthetic_dataset(
    directory: str | Path,
    *,
    task: str = "successor",
    prompt_format: str = "text",
    num_train: int = 512,
    num_val: int = 64,
    seed: int = 0,
) -> SyntheticDatasetFiles:
    """Write ``{task}_train.parquet`` and ``{task}_val.parquet`` under ``directory`` (created if needed).

    Splits are drawn from the same distribution with independent seeds; with 10 or 100
    distinct prompts they overlap, which is intended (validation measures accuracy, not
    generalisation). Existing files are overwritten.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = SyntheticDatasetFiles(train=directory / f"{task}_train.parquet", val=directory / f"{task}_val.parquet")
    for split, num_rows, path in (("train", num_train, files.train), ("val", num_val, files.val)):
        rows = synthetic_rows(task, num_rows, seed=seed, split=split, prompt_format=prompt_format)
        pq.write_table(pa.Table.from_pylist(rows), path)
    return files
