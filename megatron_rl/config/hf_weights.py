"""A Hugging Face model directory's weights checked against its config.json, from the safetensors headers alone.

A safetensors file is an 8-byte little-endian header length, a JSON header (``{name: {"dtype",
"shape", "data_offsets"}}``) and the tensor bytes. Reading the headers and the file sizes (never
the tensors) tells, in milliseconds and before any rank or engine starts, which tensors the
directory holds and their shapes, whether a file is shorter than its header says (an interrupted
download or copy), whether it is safetensors at all, and whether the index names absent files.
:func:`weight_problems` compares that with the tensors a Qwen3 / Qwen3-MoE model of the config
needs, under the Hub's on-disk names (what the importer and SGLang read). Extra tensors are
allowed (they are not read). Torch-free, like the rest of ``config``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from megatron_rl.config.hf_config import INDEX_FILE, SINGLE_FILE, QwenArchitecture

_LISTED = 5
"""Tensors named per kind of problem; the rest are counted."""
_REFETCH = "download or export the checkpoint again"


class HfWeightsError(ValueError):
    """A weight file or index cannot be read; the message names the file and the fix."""


def expected_hf_tensors(arch: QwenArchitecture) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``arch`` must hold, by on-disk name, with its shape."""
    hidden, head_dim, vocab = arch.hidden_size, arch.head_dim, arch.vocab_size
    q_rows, kv_rows = arch.num_attention_heads * head_dim, arch.num_query_groups * head_dim
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not arch.tie_word_embeddings:
        tensors["lm_head.weight"] = (vocab, hidden)
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}"
        tensors |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (q_rows, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_rows, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_rows, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_rows),
            f"{prefix}.self_attn.q_norm.weight": (head_dim,),
            f"{prefix}.self_attn.k_norm.weight": (head_dim,),
        }
        if arch.moe_layer_pattern and arch.moe_layer_pattern[layer]:
            tensors[f"{prefix}.mlp.gate.weight"] = (arch.num_experts, hidden)
            for expert in range(arch.num_experts):
                tensors |= _mlp(f"{prefix}.mlp.experts.{expert}", arch.moe_ffn_hidden_size, hidden)
        else:
            tensors |= _mlp(f"{prefix}.mlp", arch.ffn_hidden_size, hidden)
    return tensors


def _mlp(prefix: str, ffn: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (ffn, hidden),
        f"{prefix}.up_proj.weight": (ffn, hidden),
        f"{prefix}.down_proj.weight": (hidden, ffn),
    }


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the safetensors file ``path``, from its header.

    Raises HfWeightsError naming the file when it is absent, not safetensors, or shorter than
    its header says.
    """
    if not path.is_file():
        raise HfWeightsError(f"{path}: no such file; {_REFETCH}")
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < header_len <= size - 8:
            raise HfWeightsError(f"{path}: not a safetensors file, or cut short before its header ends; {_REFETCH}")
        try:
            header = json.loads(handle.read(header_len))
            entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
            data_end = max((int(entry["data_offsets"][1]) for entry in entries.values()), default=0)
            shapes = {name: tuple(int(d) for d in entry["shape"]) for name, entry in entries.items()}
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise HfWeightsError(f"{path}: the safetensors header is not readable ({exc}); {_REFETCH}") from exc
    if size < 8 + header_len + data_end:
        raise HfWeightsError(
            f"{path}: truncated: its header declares {8 + header_len + data_end} bytes but the file has {size} "
            f"(an interrupted download or copy?); {_REFETCH}"
        )
    return shapes


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Name -> (shape, file) of every tensor of the directory's ``model.safetensors`` or sharded index.

    Raises HfWeightsError naming the file when the index is unreadable or names an absent file,
    a weight file is unreadable (see :func:`safetensors_shapes`), or there are no weights.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise HfWeightsError(
                f"{index_path}: not a safetensors index with a 'weight_map' ({exc}); {_REFETCH}"
            ) from exc
    elif (model_dir / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise HfWeightsError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}; {_REFETCH}")
    located: dict[str, tuple[tuple[int, ...], Path]] = {}
    for file in files:
        path = model_dir / file
        if not path.is_file():
            raise HfWeightsError(f"{index_path} names {file}, which is not in {model_dir}; {_REFETCH}")
        located |= {name: (shape, path) for name, shape in safetensors_shapes(path).items()}
    return located


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return ", ".join(items[:_LISTED]) + more


def weight_problems(model_dir: str | Path, arch: QwenArchitecture) -> list[str]:
    """What is wrong with the weights in ``model_dir`` for a model of ``arch`` (its config.json); [] when nothing.

    One message per kind: an unreadable file or index, tensors missing, tensors of another
    shape than config.json implies; each names the directory or file, the tensors and the fix.
    """
    try:
        found = checkpoint_shapes(model_dir)
    except HfWeightsError as exc:
        return [str(exc)]
    expected = expected_hf_tensors(arch)
    missing = [name for name in expected if name not in found]
    wrong = [
        f"{name} {list(found[name][0])} in {found[name][1].name} (config.json implies {list(shape)})"
        for name, shape in expected.items()
        if name in found and found[name][0] != shape
    ]
    problems = []
    if missing:
        problems.append(
            f"{model_dir}: {len(missing)} of the {len(expected)} tensors a {arch.architecture} of this config.json "
            f"needs are missing: {_listed(missing)}; {_REFETCH}, or fix config.json if it describes another model"
        )
    if wrong:
        problems.append(
            f"{model_dir}: {len(wrong)} tensor(s) of another shape than config.json implies: {_listed(wrong)}; "
            "config.json and the weights describe different models: use the config.json that came with them"
        )
    return problems
