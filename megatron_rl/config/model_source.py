"""The architecture of a recipe's model, read before any rank starts.

From ``<model.path>/config.json`` or the inline ``model.random_init`` dict, through the
same parser the model builder uses (:func:`megatron_rl.config.hf_config.parse_hf_config`,
which imports neither torch nor Megatron), so a field Megatron cannot honour is an error
at validation time, not after the job has started.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from megatron_rl.config.hf_config import QwenArchitecture, UnsupportedConfigError, load_hf_config, parse_hf_config


class ModelSourceError(ValueError):
    """The recipe's model config is missing, unreadable or unsupported; the message names the field."""


def read_architecture(path: str | None, random_init: Mapping[str, Any] | None) -> QwenArchitecture:
    """Architecture of ``random_init`` when given, else of ``<path>/config.json``."""
    field = "model.random_init" if random_init is not None else "model.path"
    try:
        config = random_init if random_init is not None else load_hf_config(str(path))
        return parse_hf_config(config)
    except (FileNotFoundError, json.JSONDecodeError, UnsupportedConfigError) as exc:
        raise ModelSourceError(f"{field}: {exc}") from exc
