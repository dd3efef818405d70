"""The architecture of a recipe's model, read before any rank starts.

From ``<model.path>/config.json`` (or, while that file is not there yet, the recipe's
``model.config_fallback``, e.g. the Qwen3-30B-A3B config.json shipped under
``recipes/models/``) or the inline ``model.random_init`` dict, through the
same parser the model builder uses (:func:`megatron_rl.config.hf_config.parse_hf_config`,
which imports neither torch nor Megatron), so a field Megatron cannot honour is an error
at validation time, not after the job has started.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_rl.config.hf_config import (
    INDEX_FILE,
    SINGLE_FILE,
    QwenArchitecture,
    UnsupportedConfigError,
    load_hf_config,
    parse_hf_config,
)


class ModelSourceError(ValueError):
    """The recipe's model config is missing, unreadable or unsupported; the message names the field."""


def has_hf_config(path: str | None) -> bool:
    """Whether ``<path>/config.json`` exists."""
    return path is not None and (Path(path) / "config.json").is_file()


def has_hf_weights(path: str | None) -> bool:
    """Whether ``path`` holds safetensors weights the importer reads (a single file or a sharded index)."""
    return path is not None and any((Path(path) / name).is_file() for name in (SINGLE_FILE, INDEX_FILE))


def read_architecture(
    path: str | None, random_init: Mapping[str, Any] | None, fallback: str | None = None
) -> QwenArchitecture:
    """Architecture of ``random_init`` when given, else of ``<path>/config.json``.

    ``fallback``: a config.json file read instead when ``path`` has none yet (validation and
    planning before the weights are downloaded; training never passes it). Raises
    ModelSourceError naming the field and the file when the config is absent, not JSON, or
    describes a model Megatron cannot reproduce.
    """
    field, source = "model.random_init", "model.random_init"
    try:
        if random_init is not None:
            config = random_init
        elif fallback is not None and not has_hf_config(path):
            field, source = "model.config_fallback", fallback
            config = json.loads(Path(fallback).read_text())
        else:
            field, source = "model.path", str(Path(str(path)) / "config.json")
            config = load_hf_config(str(path))
        return parse_hf_config(config)
    except FileNotFoundError as exc:
        raise ModelSourceError(f"{field}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ModelSourceError(f"{field}: {source} is not valid JSON ({exc}); download or write it again") from exc
    except UnsupportedConfigError as exc:
        where = "" if source == field else f"{source}: "
        raise ModelSourceError(f"{field}: {where}{exc}") from exc
