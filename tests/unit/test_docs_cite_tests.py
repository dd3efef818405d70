"""Every test README.md and docs/ cite as holding a promise exists, in either tier.

A citation is ``path/test_file.py::test_name`` (or the bare file name where the docs' table names its folder once);
the file must define a test of that name. A test renamed or removed without its citation moving fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITATION = re.compile(r"((?:tests/[\w/]+/)?test_\w+\.py)::(test_\w+)")


def _defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_cited_test_is_defined_where_the_docs_say() -> None:
    by_name: dict[str, list[Path]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        by_name.setdefault(path.name, []).append(path)
    cited = [(doc.name, match[1], match[2]) for doc in DOCS for match in CITATION.finditer(doc.read_text())]
    assert len(cited) > 30, "fewer citations than the docs hold: is CITATION stale?"
    missing = []
    for doc, file, test in cited:
        candidates = [ROOT / file] if "/" in file else by_name.get(file, [])
        if not any(path.is_file() and test in _defined_tests(path) for path in candidates):
            missing.append(f"{doc}: {file}::{test}")
    assert missing == []
