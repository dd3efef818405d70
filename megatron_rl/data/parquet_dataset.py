"""Prompt datasets read from parquet files in the column layout verl users have.

Per row: ``prompt`` (a string or a list of ``{"role", "content"}`` messages), ``reward_model``
(a struct whose ``ground_truth`` is the answer), ``data_source`` (str) and optionally
``extra_info`` (a struct). Keys are configurable; a dotted key such as
``"reward_model.ground_truth"`` walks into struct columns (an exact column name wins). Prompts are
tokenised at load time (see ``prompts``) and those longer than ``max_prompt_length`` tokens are
dropped, with the count kept on the dataset and logged to the ``megatron_rl.data`` logger.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from megatron_rl.data.prompts import encode_prompts, validate_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("megatron_rl.data")

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class PromptItem:
    """One tokenised prompt. ``index`` is its position in the dataset (what samplers yield)."""

    index: int
    prompt_ids: list[int]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)


class PromptDataset:
    """Tokenised prompts, indexable by position; ``num_filtered`` counts the over-long prompts dropped."""

    def __init__(self, items: Sequence[PromptItem], num_filtered: int) -> None:
        self._items = list(items)
        self.num_filtered = num_filtered

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> PromptItem:
        return self._items[index]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self._items)


def _decodes(value: pa.Scalar) -> bool:
    try:
        value.as_py()
    except UnicodeDecodeError:
        return False
    return True


def _python_values(values: pa.ChunkedArray, key: str, path: Path) -> list[Any]:
    """``values`` as Python objects; ValueError naming the file, row and key of text that is not valid UTF-8."""
    try:
        rows: list[Any] = values.to_pylist()
        return rows
    except UnicodeDecodeError as exc:
        row = next(row for row in range(len(values)) if not _decodes(values[row]))
        raise ValueError(
            f"{path} row {row} key {key!r}: the text is not valid UTF-8 ({exc.reason} at byte {exc.start}); "
            "re-encode the file's text columns as UTF-8"
        ) from None


def _column_values(table: pa.Table, key: str, path: Path) -> list[Any]:
    """Values of ``key`` (a column name, or a dotted path into a present struct column) as Python objects."""
    if key in table.column_names:
        return _python_values(table.column(key), key, path)
    head, *fields = key.split(".")
    values: pa.ChunkedArray = table.column(head)
    walked = head
    for name in fields:
        if not pa.types.is_struct(values.type) or values.type.get_field_index(name) < 0:
            raise ValueError(f"{path}: key {key!r}: column {walked!r} (type {values.type}) has no field {name!r}")
        values = pc.struct_field(values, name)
        walked = f"{walked}.{name}"
    return _python_values(values, key, path)


@contextmanager
def _readable(path: Path) -> Iterator[None]:
    """Turn pyarrow's error on a file that is not readable parquet into a ValueError naming the file and the fix."""
    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(
            f"{path}: not a readable parquet file ({exc}); the file is corrupt or truncated, or not parquet: "
            "write it again (e.g. pandas.DataFrame.to_parquet) or remove it from the list"
        ) from exc


def _top_level_column(key: str, names: Sequence[str]) -> str:
    return key if key in names else key.split(".", 1)[0]


def _ground_truth(value: Any, where: str) -> str:
    if value is None:
        raise ValueError(f"{where}: the ground truth is missing (null); fill it in or remove the row")
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(
        f"{where}: the ground truth must be a string or a number, got {type(value).__name__}: {str(value)[:200]}"
    )


def _extra_info(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, list) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
        return dict(value)
    raise ValueError(f"{where}: extra_info must be a struct or a map, got {type(value).__name__}")


def _read_rows(
    path: Path,
    *,
    prompt_key: str,
    answer_key: str,
    data_source_key: str,
    extra_info_key: str,
) -> tuple[list[Any], list[str], list[str], list[dict[str, Any]]]:
    """Prompts, ground truths, data sources and extra infos of every row of one file."""
    with _readable(path):
        names = pq.read_schema(path).names
    columns = {key: _top_level_column(key, names) for key in (prompt_key, answer_key, data_source_key, extra_info_key)}
    for key in (prompt_key, answer_key):
        if columns[key] not in names:
            raise ValueError(f"{path}: no column {columns[key]!r} for key {key!r}; the file has columns {names}")
    present = [key for key, column in columns.items() if column in names]
    with _readable(path):
        table = pq.read_table(path, columns=list(dict.fromkeys(columns[key] for key in present)))
    if table.num_rows == 0:
        raise ValueError(f"{path}: the file has no rows; write prompts into it or remove it from the list")

    def values(key: str) -> list[Any]:
        return _column_values(table, key, path)

    prompts = [validate_prompt(v, f"{path} row {row} key {prompt_key!r}") for row, v in enumerate(values(prompt_key))]
    answers = [_ground_truth(v, f"{path} row {row} key {answer_key!r}") for row, v in enumerate(values(answer_key))]
    sources = [path.stem] * table.num_rows
    if data_source_key in present:
        sources = [path.stem if v is None else str(v) for v in values(data_source_key)]
    infos: list[dict[str, Any]] = [{} for _ in range(table.num_rows)]
    if extra_info_key in present:
        infos = [
            _extra_info(v, f"{path} row {row} key {extra_info_key!r}") for row, v in enumerate(values(extra_info_key))
        ]
    return prompts, answers, sources, infos


def load_prompt_dataset(
    files: PathLike | Sequence[PathLike],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int | None,
    prompt_key: str = "prompt",
    answer_key: str = "reward_model.ground_truth",
    data_source_key: str = "data_source",
    extra_info_key: str = "extra_info",
    wrap_text_in_chat: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> PromptDataset:
    """Read, tokenise and length-filter the prompts of ``files`` (in order) into one dataset.

    ``max_prompt_length`` is in tokens (None: keep all). A missing ``data_source`` column
    gives each row its file's stem; a missing ``extra_info`` column gives ``{}``. Raises
    ValueError naming the file (and the row and key where there is one) when a file is not
    readable parquet or has no rows, a prompt or answer column is absent, a value has the wrong
    type, a prompt is empty or its text not UTF-8, and when no prompt is short enough.
    """
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}")
    paths = [Path(files)] if isinstance(files, (str, os.PathLike)) else [Path(f) for f in files]
    if not paths:
        raise ValueError("load_prompt_dataset needs at least one parquet file")
    items: list[PromptItem] = []
    num_rows = 0
    shortest_per_file: list[int] = []
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"prompt dataset file {path} does not exist")
        prompts, answers, sources, infos = _read_rows(
            path,
            prompt_key=prompt_key,
            answer_key=answer_key,
            data_source_key=data_source_key,
            extra_info_key=extra_info_key,
        )
        token_ids = encode_prompts(
            tokenizer, prompts, wrap_text_in_chat=wrap_text_in_chat, chat_template_kwargs=chat_template_kwargs
        )
        num_rows += len(prompts)
        shortest_per_file.append(min(map(len, token_ids)))
        for ids, answer, source, info in zip(token_ids, answers, sources, infos, strict=True):
            if max_prompt_length is None or len(ids) <= max_prompt_length:
                item = PromptItem(len(items), prompt_ids=ids, ground_truth=answer, data_source=source, extra_info=info)
                items.append(item)
    num_filtered = num_rows - len(items)
    names = ", ".join(str(path) for path in paths)
    logger.info(
        "loaded %d of %d prompts from %s; filtered %d longer than max_prompt_length=%s tokens",
        len(items),
        num_rows,
        names,
        num_filtered,
        max_prompt_length,
    )
    if not items:
        shortest = min(shortest_per_file)
        raise ValueError(
            f"no prompts left from {names}: {num_rows} rows, {num_filtered} longer than "
            f"max_prompt_length={max_prompt_length} tokens (the shortest has {shortest}); raise max_prompt_length "
            f"(rollout.max_prompt_length in a recipe) to at least {shortest}, or shorten the prompts"
        )
    return PromptDataset(items, num_filtered)
