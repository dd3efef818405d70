"""The tool of the synthetic ``lookup`` task (:mod:`megatron_rl.data.synthetic_task`): a table lookup.

Each prompt row carries its own table of 10 digits and the key it asks for, in
``extra_info["tools_kwargs"]["synthetic_lookup"]``; the prompt shows only the key, so the model finds the
answer only by calling this tool (the synthetic chat format's one-token call, ``<call>``, has no arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rl.tools.registry import register_tool


@register_tool("synthetic_lookup")
def synthetic_lookup(arguments: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    """Entry ``context["key"]`` of the row's ``context["table"]`` (one digit); KeyError without them."""
    return str(context["table"][int(context["key"])])
