"""The recipe's model cut to its first few decoder layers, for preflight's trainer and engine steps.

Same hidden size, heads, experts and vocabulary as the recipe's model, so every GEMM, all-to-all and
weight-sync bucket has the shapes of the full run; only the depth is cut. With ``model.path`` the cut
checkpoint holds the real weights of those layers (read tensor by tensor, never the whole model in
memory); a ``model.random_init`` recipe keeps its own inline config with fewer layers.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config.schema import RunConfig
from megatron_rl.models.hf_files import copy_hf_metadata, finalize_safetensors, write_shard_files
from megatron_rl.models.safetensors_reader import SafetensorsCheckpoint

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class CutModel:
    """How the recipe's model was cut: ``layers`` of ``of_layers`` kept, and the overrides that load the cut."""

    layers: int
    of_layers: int
    overrides: tuple[str, ...]


def cut_depth(cfg: RunConfig, num_layers: int) -> int:
    """Decoder layers preflight keeps: one per pipeline stage and virtual chunk (at least 2, so a dense and an
    MoE layer both run where the model interleaves them), never more than the model has."""
    chunks = cfg.parallel.pp * (cfg.parallel.vpp or 1)
    return min(num_layers, max(2, chunks))


def _cut_config(config: dict[str, object], layers: int) -> dict[str, object]:
    """``config`` with ``num_hidden_layers`` = ``layers`` and its per-layer lists cut to match."""
    cut = dict(config) | {"num_hidden_layers": layers}
    dense_layers, layer_types = cut.get("mlp_only_layers"), cut.get("layer_types")
    if isinstance(dense_layers, list):
        cut["mlp_only_layers"] = [i for i in dense_layers if i < layers]
    if isinstance(layer_types, list):
        cut["layer_types"] = layer_types[:layers]
    return cut


def write_cut_checkpoint(source: Path, target: Path, layers: int) -> None:
    """A Hugging Face checkpoint in ``target`` holding ``source``'s tensors of layers ``< layers`` and every tensor
    outside the decoder layers (embeddings, final norm, output layer), with config and tokenizer files.

    Built in ``target.partial`` and renamed, so an interrupted cut leaves no half checkpoint at ``target``;
    an existing ``target`` is replaced.
    """
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    copy_hf_metadata(source, staging)
    config = json.loads((source / "config.json").read_text())
    (staging / "config.json").write_text(json.dumps(_cut_config(config, layers), indent=2))
    checkpoint = SafetensorsCheckpoint(source)
    kept = [name for name in checkpoint.names() if (m := _LAYER.match(name)) is None or int(m.group(1)) < layers]
    shards = write_shard_files(((name, checkpoint.read(name)) for name in kept), staging)
    finalize_safetensors(staging, shards)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def cut_model(cfg: RunConfig, num_layers: int, work_dir: Path) -> CutModel:
    """Cut ``cfg``'s model (of ``num_layers`` decoder layers) to :func:`cut_depth` layers; the overrides point the
    recipe at the cut: ``model.path`` at a checkpoint written under ``work_dir``, or the inline config's layer
    count. An uneven pipeline split (``parallel.first_stage_layers`` / ``last_stage_layers``) becomes even."""
    layers = cut_depth(cfg, num_layers)
    overrides = [f"parallel.{field}=null" for field in ("first_stage_layers", "last_stage_layers")]
    if cfg.model.random_init is not None:
        return CutModel(layers, num_layers, (*overrides, f"model.random_init.num_hidden_layers={layers}"))
    assert cfg.model.path is not None, "the schema asks for model.path or model.random_init"
    target = work_dir / "cut_model"
    if layers < num_layers:
        write_cut_checkpoint(Path(cfg.model.path), target, layers)
        overrides.append(f"model.path={target.resolve()}")
    return CutModel(layers, num_layers, tuple(overrides))
