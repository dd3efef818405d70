"""Hugging Face tensors <-> this rank's Megatron shards: import and streaming export.

- :func:`load_hf_weights` fills this rank's chunks from a safetensors
  checkpoint, reading only the slices the rank owns; every shape is checked
  against config.json and the layout before anything is read.
- :func:`export_hf_weights` yields ``(hf_name, full_tensor)`` pairs: each
  tensor-parallel parameter is all-gathered over its TP (or expert-TP) group
  (with ``designated_only``: gathered to the group's designated rank only, and
  not at all by groups that hold no designated rank), experts come from the EP
  rank that holds them, and each pipeline stage yields only its own layers.
  The order is model order (embedding, layers in ascending order, final norm,
  output layer) within each stage. All ranks of a TP group must iterate the
  generator together (it issues collectives). Given an :data:`Allocate`, the
  full tensors are written into tensors it hands out (a transport's
  shared-memory bucket) instead of new ones.
- :func:`export_full_model` yields the whole model on every rank, the same
  sequence everywhere (experts all-gathered over EP, stages broadcast over the
  pipeline group), or only the experts one engine rank loads: what a colocated
  rank feeds the engine rank on its device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.models.safetensors_reader import SafetensorsCheckpoint
from megatron_rl.models.weight_layouts import Shape
from megatron_rl.models.weight_map import (
    ParamMapping,
    group_holds_designated_source,
    hf_expert_index,
    is_designated_source,
    iter_param_mappings,
    peer_expert_names,
    tensor_parallel_group,
    tensor_parallel_rank_size,
)

Allocate = Callable[[Sequence[Shape], torch.dtype], list[torch.Tensor]]
"""Hands out empty CPU tensors of the shapes and dtype, for the exporter to write one parameter's full tensors into."""


@torch.no_grad()
def load_hf_weights(
    chunks: Sequence[torch.nn.Module], arch: QwenArchitecture, hf_dir: str | Path | SafetensorsCheckpoint
) -> None:
    """Copy this rank's shards of the checkpoint in ``hf_dir`` into ``chunks``.

    ``hf_dir`` may also be an open :class:`SafetensorsCheckpoint`. Raises
    CheckpointTensorError naming the tensor when one is missing or has a
    shape that does not match config.json at this parallel layout.
    """
    checkpoint = hf_dir if isinstance(hf_dir, SafetensorsCheckpoint) else SafetensorsCheckpoint(hf_dir)
    for mapping, param in iter_param_mappings(chunks, arch):
        rank, size = tensor_parallel_rank_size(mapping)
        local_shape = tuple(param.shape)
        for name, shape in zip(mapping.hf_names, mapping.layout.hf_shapes(local_shape, size), strict=True):
            checkpoint.check_shape(name, shape)
        shard = mapping.layout.read_shard(checkpoint.read, mapping.hf_names, rank, local_shape)
        param.copy_(shard.to(dtype=param.dtype))


def _all_gather(
    tensor: torch.Tensor, group: dist.ProcessGroup, size: int, targets: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """The group's shards in rank order, received into ``targets`` when given."""
    shards = targets or [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def _gather_to_first(
    tensor: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int, targets: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """The group's shards in rank order on group rank 0 (received into ``targets`` when given); [] on the others."""
    shards = (targets or [torch.empty_like(tensor) for _ in range(size)]) if rank == 0 else None
    dist.gather(tensor.contiguous(), shards, dst=dist.get_global_rank(group, 0), group=group)
    return shards or []


@torch.no_grad()
def export_hf_weights(
    chunks: Sequence[torch.nn.Module],
    arch: QwenArchitecture,
    *,
    designated_only: bool = False,
    allocate: Allocate | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, full weight) for the tensors of this rank's chunks (see :func:`export_hf_tensors`)."""
    yield from export_hf_tensors(
        chunks, arch, lambda param: param.detach(), designated_only=designated_only, allocate=allocate
    )


@torch.no_grad()
def export_hf_tensors(
    chunks: Sequence[torch.nn.Module],
    arch: QwenArchitecture,
    select: Callable[[torch.nn.Parameter], torch.Tensor],
    *,
    designated_only: bool = False,
    allocate: Allocate | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, full tensor) of ``select(param)`` for every parameter of the chunks.

    ``select`` picks what to export per parameter: the weight, or e.g. its
    ``main_grad`` (same shape and sharding). Tensors keep their dtype and
    device. By default replicas (other DP ranks, other TP ranks of the same
    group) yield identical tensors; with ``designated_only`` a rank yields
    only the tensors it is the designated source of
    (:func:`~megatron_rl.models.weight_map.is_designated_source`), so that
    over all ranks every tensor is yielded exactly once. All ranks still take
    part in every all-gather; with ``designated_only`` a TP group gathers only
    to its rank 0 (the designated source is TP rank 0), and a group holding no
    designated source (another data-parallel replica) skips the gather. A tied
    output layer is not yielded (Hugging Face stores only the embedding).

    Without ``allocate``, a tensor that is a slice of this rank's own shard (no
    gather: a norm, the router, an expert at expert TP 1, an unsplit vocabulary)
    is yielded as a view of the parameter, not a copy: clone it to keep it
    across a parameter update. With ``allocate``, every yielded tensor of a CPU
    parameter is one ``allocate`` handed out, written with the full tensor
    (the one copy out of the parameter; an unpadded vocabulary table is
    gathered straight into it); CUDA parameters ignore it. The
    exporter allocates a parameter's tensors in one call right before it
    yields them and yields all of them before it allocates again, so a
    consumer that takes each tensor as it comes holds every allocated tensor
    before the next allocation.
    """
    for mapping, param in iter_param_mappings(chunks, arch):
        if not mapping.exported or (designated_only and not group_holds_designated_source(mapping)):
            continue
        full = _full_tensors(mapping, select(param), designated_only=designated_only, allocate=allocate)
        if full is not None:
            yield from zip(mapping.hf_names, full, strict=True)


def _full_tensors(
    mapping: ParamMapping, local: torch.Tensor, *, designated_only: bool, allocate: Allocate | None
) -> list[torch.Tensor] | None:
    """The parameter's full Hugging Face tensors on this rank (after its TP gather), or None where
    ``designated_only`` makes this rank no source; ``allocate`` as in :func:`export_hf_tensors`."""
    rank, size = tensor_parallel_rank_size(mapping)
    gathered = mapping.layout.tensor_parallel and size > 1
    layout = mapping.layout
    yields = not designated_only or is_designated_source(mapping)
    out = targets = None
    if yields and allocate is not None and local.device.type == "cpu":
        out = allocate(layout.hf_shapes(tuple(local.shape), size if gathered else 1), local.dtype)
        targets = layout.gather_targets(out, tuple(local.shape), size) if gathered else None
    if not gathered:
        shards = [local]
    elif designated_only:
        shards = _gather_to_first(local, tensor_parallel_group(mapping), size, rank, targets)
    else:
        shards = _all_gather(local, tensor_parallel_group(mapping), size, targets)
    if not yields:
        return None
    # targets (views into out) exist only with out, which the gather has filled then.
    return list(out if out is not None and targets is not None else layout.unshard(shards, out))


@torch.no_grad()
def export_full_model(
    chunks: Sequence[torch.nn.Module],
    arch: QwenArchitecture,
    *,
    allocate: Allocate | None = None,
    experts: range | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every (Hugging Face name, full weight) of the model on every rank: the same sequence everywhere.

    Pipeline stages take turns in stage order. The stage's ranks assemble each parameter's full
    tensors (all-gathered over TP or expert TP) and, for an expert, every EP rank's copy of it
    (all-gathered over EP: each rank ends up with every expert); with pipeline stages they then
    broadcast each tensor (after its name, shape and dtype) over the pipeline group, and the
    other stages receive it. So every rank holds the whole model, one parameter at a time, on
    its own device. All ranks of the job iterate together (collectives over the TP, EP and
    pipeline groups). ``experts``: yield only these global experts (and every other tensor), in
    the same order; a rank still takes part in every collective, so ranks may ask for different
    experts. ``allocate`` as in :func:`export_hf_tensors`, for the yielded tensors only; a
    received tensor is written into one ``allocate`` hands out (CPU) or a new tensor on this
    rank's device. A tied output layer is not yielded.
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    stages, this_stage = dist.get_world_size(group), parallel_state.get_pipeline_model_parallel_rank()
    device = next(iter(chunks[0].parameters())).device
    for stage in range(stages):
        source = dist.get_global_rank(group, stage)
        if stage == this_stage:
            for name, tensor, kept in _stage_tensors(chunks, arch, allocate, experts):
                if stages > 1:
                    dist.broadcast_object_list([(name, tuple(tensor.shape), tensor.dtype)], src=source, group=group)
                    dist.broadcast(tensor.contiguous(), src=source, group=group)
                if kept:
                    yield name, tensor
            if stages > 1:
                dist.broadcast_object_list([None], src=source, group=group)
            continue
        while True:
            header: list[tuple[str, Shape, torch.dtype] | None] = [None]
            dist.broadcast_object_list(header, src=source, group=group)
            if header[0] is None:
                break
            name, shape, dtype = header[0]
            kept = _kept(name, experts)
            if kept and allocate is not None and device.type == "cpu":
                tensor = allocate([shape], dtype)[0]
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=source, group=group)
            if kept:
                yield name, tensor


def _kept(hf_name: str, experts: range | None) -> bool:
    """Whether :func:`export_full_model` yields ``hf_name`` when asked for ``experts`` (None: all)."""
    index = hf_expert_index(hf_name)
    return experts is None or index is None or index in experts


def _stage_tensors(
    chunks: Sequence[torch.nn.Module], arch: QwenArchitecture, allocate: Allocate | None, experts: range | None
) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """This pipeline stage's full tensors with every EP rank's experts, each with whether it is kept (see
    :func:`export_full_model`); only kept tensors come from ``allocate``."""
    ep_group = parallel_state.get_expert_model_parallel_group()
    ep_size = dist.get_world_size(ep_group)
    for mapping, param in iter_param_mappings(chunks, arch):
        if not mapping.exported:
            continue
        if not mapping.expert or ep_size == 1:
            kept = _kept(mapping.hf_names[0], experts)
            full = _full_tensors(mapping, param.detach(), designated_only=False, allocate=allocate if kept else None)
            yield from ((name, tensor, kept) for name, tensor in zip(mapping.hf_names, full or [], strict=True))
            continue
        own = _full_tensors(mapping, param.detach(), designated_only=False, allocate=None) or []
        names = [peer_expert_names(mapping, arch.num_experts, ep_rank, ep_size) for ep_rank in range(ep_size)]
        kept_ranks = [_kept(peer[0], experts) for peer in names]
        shapes = [tuple(tensor.shape) for tensor in own]
        allocated = None
        if allocate is not None and param.device.type == "cpu":
            allocated = iter(allocate(shapes * sum(kept_ranks), param.dtype))
        peers = [
            next(allocated)
            if kept and allocated is not None
            else torch.empty(shape, dtype=param.dtype, device=param.device)
            for kept in kept_ranks
            for shape in shapes
        ]
        for index, tensor in enumerate(own):
            dist.all_gather(peers[index :: len(own)], tensor.contiguous(), group=ep_group)
        for ep_rank, peer in enumerate(names):
            tensors = peers[ep_rank * len(own) : (ep_rank + 1) * len(own)]
            yield from ((name, tensor, kept_ranks[ep_rank]) for name, tensor in zip(peer, tensors, strict=True))
