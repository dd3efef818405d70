"""A pytest plugin for tests/unit/test_test_tiers.py: after collection, prints ``full <node id>`` for every collected
test marked ``full``, so one ``--collect-only --full`` shows both the full tier and which of it CI leaves out."""

from __future__ import annotations

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        if item.get_closest_marker("full") is not None:
            print(f"full {item.nodeid}")
