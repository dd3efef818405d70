"""Synthetic tasks for the tiny CPU run: prompts, verl-layout parquet files and the reward.

Each task draws single digits; the answer is one digit:

- ``successor``: ``"succ d"`` -> ``(d + 1) mod 10`` (10 distinct prompts);
- ``max``: ``"max a b"`` -> ``max(a, b)`` (100 distinct prompts; harder: the answer depends on a
  digit that is not the last prompt token, so the model must learn attention).

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
``synthetic_successor``, ``synthetic_max``), one rule for all. The response text is split into
tokens (whitespace-separated words, with ``<...>`` markers split off, so ``"4<eos>"`` reads as
``4 <eos>``) and trailing ``<pad>`` tokens are ignored. It is correct iff the tokens are exactly
``[ground_truth, "<eos>"]``: score +1.0, else -1.0. A wrong digit, any extra token, or a
missing ``<eos>`` (a response cut at the length limit) is wrong, so long responses are always
wrong. Responses must be decoded with ``skip_special_tokens=False``: without the ``<eos>`` text
nothing scores +1.

Rows follow the verl layout::

    prompt:       "succ 3"  (text)  or  [{"role": "user", "content": "succ 3"}]  (chat)
    data_source:  "synthetic_successor"
    ability:      "synthetic"
    reward_model: {"style": "rule", "ground_truth": "4"}
    extra_info:   {"split": "train", "index": 0, "task": "successor"}
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
from megatron_rl.data.synthetic_tokenizer import EOS_TOKEN, PAD_TOKEN

_RESPONSE_TOKEN = re.compile(r"<[^<>\s]+>|[^\s<]+")


def _successor(rng: random.Random) -> tuple[str, str]:
    digit = rng.randrange(10)
    return f"succ {digit}", str((digit + 1) % 10)


def _max_of_two(rng: random.Random) -> tuple[str, str]:
    first, second = rng.randrange(10), rng.randrange(10)
    return f"max {first} {second}", str(max(first, second))


SYNTHETIC_TASKS: Mapping[str, Callable[[random.Random], tuple[str, str]]] = MappingProxyType(
    {"successor": _successor, "max": _max_of_two}
)
SYNTHETIC_PROMPT_FORMATS: tuple[str, ...] = ("text", "chat")


@register_reward("synthetic_successor")
@register_reward("synthetic_max")
def synthetic_exact(response: str, ground_truth: str, extra_info: Mapping[str, Any]) -> RewardOutput:
    """+1.0 iff ``response`` is exactly the answer then ``<eos>`` (see the module docstring), else -1.0."""
    tokens = _RESPONSE_TOKEN.findall(response)
    while tokens and tokens[-1] == PAD_TOKEN:
        tokens.pop()
    correct = tokens == [ground_truth.strip(), EOS_TOKEN]
    return RewardOutput(score=1.0 if correct else -1.0, correct=correct)


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
        prompt, answer = SYNTHETIC_TASKS[task](rng)
        rows.append(
            {
                "data_source": f"synthetic_{task}",
                "prompt": prompt if prompt_format == "text" else [{"role": "user", "content": prompt}],
                "ability": "synthetic",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "task": task},
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
