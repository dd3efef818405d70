"""Read a Hugging Face ``config.json`` of Qwen3 / Qwen3-MoE into the facts we honour.

:func:`parse_hf_config` turns the JSON dict into a frozen :class:`QwenArchitecture`
holding every field that changes the model's math. A field whose value we
cannot reproduce in Megatron (RoPE scaling, sliding-window attention,
attention biases, shared experts, a non-SiLU activation, ...) raises
:class:`UnsupportedConfigError` naming the field; nothing is silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# The weight files of a Hugging Face directory: one file, or shards listed by an index.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class UnsupportedConfigError(ValueError):
    """A config.json field has a value Megatron cannot reproduce exactly."""


@dataclass(frozen=True)
class QwenArchitecture:
    """The math-changing fields of a Qwen3 / Qwen3-MoE checkpoint.

    ``moe_layer_pattern[i]`` is 1 when decoder layer ``i`` (0-based) is a MoE
    layer, 0 when dense; it is all zeros for dense models (``num_experts == 0``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_dropout: float
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    moe_layer_pattern: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        """Whether any decoder layer is a mixture-of-experts layer."""
        return any(self.moe_layer_pattern)


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """Return ``model_dir/config.json`` as a dict (FileNotFoundError names the path)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: expected a Hugging Face model directory")
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Rows of Megatron's embedding: the smallest multiple of ``divisible_by * tp`` that is >= ``vocab_size``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


_DTYPES = ("float32", "float16", "bfloat16")


def checkpoint_dtype_name(config: Mapping[str, Any]) -> str:
    """The weights' dtype named by config.json (``dtype`` or legacy ``torch_dtype``; default float32)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise UnsupportedConfigError(f"dtype={name!r}: supported are {list(_DTYPES)}")
    return name


def _require(config: Mapping[str, Any], field: str) -> Any:
    if config.get(field) is None:
        raise UnsupportedConfigError(f"config.json lacks required field {field!r}")
    return config[field]


def _reject_unsupported(config: Mapping[str, Any]) -> None:
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(f"hidden_act={config['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if config.get("attention_bias"):
        raise UnsupportedConfigError("attention_bias=true: Qwen3 attention without biases is supported only")
    if config.get("use_sliding_window"):
        raise UnsupportedConfigError("use_sliding_window=true: sliding-window attention is not supported")
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        raise UnsupportedConfigError("layer_types contains non-'full_attention' layers: not supported")
    if config.get("rope_scaling"):
        raise UnsupportedConfigError(f"rope_scaling={config['rope_scaling']!r}: only plain RoPE is supported")
    rope_type = (config.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedConfigError(f"rope_parameters.rope_type={rope_type!r}: only 'default' is supported")
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedConfigError("shared_expert_intermediate_size > 0: shared experts are not supported")


def _rope_theta(config: Mapping[str, Any]) -> float:
    parameters = config.get("rope_parameters") or {}
    theta = parameters.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise UnsupportedConfigError("config.json has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def _moe_fields(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    spellings = {config[key] for key in ("num_experts", "num_local_experts") if config.get(key) is not None}
    if len(spellings) > 1:
        raise UnsupportedConfigError(f"num_experts and num_local_experts disagree: {sorted(spellings)}")
    num_experts = int(spellings.pop()) if spellings else 0
    if num_experts == 0:
        return {"moe_layer_pattern": (0,) * num_layers}
    step = int(config.get("decoder_sparse_step", 1))
    if step < 1:
        raise UnsupportedConfigError(f"decoder_sparse_step={step} must be >= 1")
    dense_layers = set(config.get("mlp_only_layers") or [])
    pattern = tuple(int(i not in dense_layers and (i + 1) % step == 0) for i in range(num_layers))
    return {
        "num_experts": num_experts,
        "moe_router_topk": int(_require(config, "num_experts_per_tok")),
        "moe_ffn_hidden_size": int(_require(config, "moe_intermediate_size")),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "moe_layer_pattern": pattern,
    }


def parse_hf_config(config: Mapping[str, Any]) -> QwenArchitecture:
    """Validate a Qwen3 / Qwen3-MoE config dict and return its math-changing fields.

    Raises:
        UnsupportedConfigError: unsupported architecture or a field we cannot honour.
    """
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedConfigError(f"architectures={architectures!r}: supported are {list(SUPPORTED_ARCHITECTURES)}")
    _reject_unsupported(config)
    hidden_size = int(_require(config, "hidden_size"))
    num_heads = int(_require(config, "num_attention_heads"))
    num_layers = int(_require(config, "num_hidden_layers"))
    moe = _moe_fields(config, num_layers) if architectures[0] == "Qwen3MoeForCausalLM" else {}
    return QwenArchitecture(
        architecture=architectures[0],
        vocab_size=int(_require(config, "vocab_size")),
        hidden_size=hidden_size,
        ffn_hidden_size=int(_require(config, "intermediate_size")),
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_query_groups=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        max_position_embeddings=int(_require(config, "max_position_embeddings")),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        **({"moe_layer_pattern": (0,) * num_layers} | moe),
    )
