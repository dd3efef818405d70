"""The few facts of a Hugging Face config that the recipe checks need.

Read from ``config.json`` of a checkpoint or from ``model.random_init``, so that
layout errors (heads vs TP, experts vs EP, ...) surface before any rank starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class ModelShapeError(ValueError):
    """A Hugging Face config that is missing, unreadable or unsupported."""


@dataclass(frozen=True)
class ModelShape:
    """Architecture sizes that constrain parallel layouts and sequence lengths."""

    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    num_experts: int

    @property
    def is_moe(self) -> bool:
        """True when the model has routed experts."""
        return self.num_experts > 0


def _required_int(config: Mapping[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelShapeError(f"{source}: '{key}' must be a positive integer, got {value!r}")
    return value


def model_shape_from_hf_config(config: Mapping[str, Any], source: str) -> ModelShape:
    """Extract a :class:`ModelShape` from a Hugging Face config dict.

    ``source`` names where the dict came from, for error messages. Raises
    :class:`ModelShapeError` when the architecture is not one we build or a
    size is missing.
    """
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise ModelShapeError(f"{source}: 'architectures' must be a one-element list, got {architectures!r}")
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelShapeError(
            f"{source}: architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    is_moe = architecture == "Qwen3MoeForCausalLM"
    num_heads = _required_int(config, "num_attention_heads", source)
    return ModelShape(
        architecture=architecture,
        num_layers=_required_int(config, "num_hidden_layers", source),
        num_attention_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        hidden_size=_required_int(config, "hidden_size", source),
        vocab_size=_required_int(config, "vocab_size", source),
        max_position_embeddings=_required_int(config, "max_position_embeddings", source),
        num_experts=_required_int(config, "num_experts", source) if is_moe else 0,
    )


def read_model_shape(path: str | None, random_init: Mapping[str, Any] | None) -> ModelShape:
    """Shape of the recipe's model: ``<path>/config.json`` or the inline ``random_init`` dict."""
    if random_init is not None:
        return model_shape_from_hf_config(random_init, "model.random_init")
    assert path is not None
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ModelShapeError(
            f"model.path: no config.json in {path!r}; point it at a Hugging Face checkpoint directory"
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelShapeError(f"model.path: {config_file} is not valid JSON ({exc})") from exc
    return model_shape_from_hf_config(config, str(config_file))
