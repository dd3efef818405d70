"""A fault injected into weight syncs for preflight's tests: set in the trainer processes' environment, never by a
recipe.

``MEGATRON_RL_FAULT_SYNC_DROP="<Hugging Face tensor name>"``: every sync leaves that tensor out, as a transport
that lost a bucket entry would; the engines keep what they held. ``tests/e2e/test_preflight.py`` uses it to check
that preflight's read-back names the tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from megatron_rl.weight_sync.buckets import NamedTensor

SYNC_DROP_ENV = "MEGATRON_RL_FAULT_SYNC_DROP"


def dropped_tensor() -> str | None:
    """The tensor name the environment asks syncs to leave out, or None."""
    return os.environ.get(SYNC_DROP_ENV) or None


def without(stream: Iterable[NamedTensor], name: str) -> Iterator[NamedTensor]:
    """``stream`` less the tensor called ``name``."""
    return (named for named in stream if named[0] != name)
