"""Errors that end a run for a reason found while it runs (the CLI prints them without a traceback)."""

from __future__ import annotations


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps had an update skipped for NaN/Inf loss or gradients."""
