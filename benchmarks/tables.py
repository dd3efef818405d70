"""The Markdown table every benchmark prints."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A Markdown table, columns right-aligned to their widest cell."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)) + " |")
    print("| " + " | ".join("-" * (w - 1) + ":" for w in widths) + " |")
    for row in rows:
        print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)) + " |")
