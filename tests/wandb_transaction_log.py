"""Reading an offline W&B run back: the records of its ``.wandb`` transaction log.

wandb (0.31) no longer ships a Python reader of its transaction log, so this follows the
format its writer uses: the header ``:W&B``, magic 0xBEE1 and version 0, then LevelDB log
blocks of 32 KiB, each record a chunk header (CRC-32 of type and data, length, type: FULL,
FIRST, MIDDLE, LAST) and data; a record's data is a serialised ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_FILE_HEADER = struct.Struct("<4sHB")
_CHUNK_HEADER = struct.Struct("<IHB")
_BLOCK_LEN = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> Iterator[Any]:
    """Every ``Record`` of the transaction log ``path``, in order; raises on a bad header or checksum."""
    # protobuf builds the message classes when the module runs (wandb ships no stubs of them): mypy sees no Record
    from wandb.proto.wandb_internal_pb2 import Record  # type: ignore[attr-defined]

    data = path.read_bytes()
    if _FILE_HEADER.unpack_from(data) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path}: not a W&B transaction log")
    pending = b""
    for chunk_type, chunk in _chunks(data, _FILE_HEADER.size):
        pending += chunk
        if chunk_type in (_FULL, _LAST):
            record = Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _chunks(data: bytes, offset: int) -> Iterator[tuple[int, bytes]]:
    """(type, data) of each chunk from ``offset``; block trailers and zero padding are skipped."""
    while offset + _CHUNK_HEADER.size <= len(data):
        if _BLOCK_LEN - offset % _BLOCK_LEN < _CHUNK_HEADER.size:
            offset += _BLOCK_LEN - offset % _BLOCK_LEN
            continue
        checksum, length, chunk_type = _CHUNK_HEADER.unpack_from(data, offset)
        if chunk_type == 0:
            return
        chunk = data[offset + _CHUNK_HEADER.size : offset + _CHUNK_HEADER.size + length]
        if checksum != zlib.crc32(chunk, zlib.crc32(bytes([chunk_type]))):
            raise ValueError(f"bad checksum of the chunk at byte {offset}")
        yield chunk_type, chunk
        offset += _CHUNK_HEADER.size + length


def history(path: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, {name: value}) of each history record of ``path``, without W&B's own ``_`` keys."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {_item_name(item): json.loads(item.value_json) for item in record.history.item}
            rows.append((record.history.step.num, {k: float(v) for k, v in items.items() if not k.startswith("_")}))
    return rows


def run_record(path: Path) -> Any:
    """The ``RunRecord`` of ``path`` (the run's id, resume and branch point)."""
    return next(r.run for r in read_records(path) if r.WhichOneof("record_type") == "run")


def _item_name(item: Any) -> str:
    return item.key or "/".join(item.nested_key)
