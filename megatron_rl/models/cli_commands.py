"""Command bodies: ``convert hf-to-mcore``, ``convert mcore-to-hf``, ``check-parity``.

The package CLI (``megatron_rl/cli.py``) wires these in with
:func:`add_subcommands`; ``python -m megatron_rl.models.cli_commands`` runs them
standalone.

Megatron checkpoint directory written by ``hf-to-mcore``::

    OUT/metadata.json, OUT/*.distcp   torch_dist model weights (any layout can load them)
    OUT/hf_metadata/                  config.json, generation config, tokenizer files

Outputs are built in ``.OUT.partial`` and renamed into place on success.
The converters run as local gloo ranks, or, started by torchrun (one process
per GPU), as the ranks of that job; ``check-parity`` always runs locally.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.hf_config import QwenArchitecture, checkpoint_dtype_name, load_hf_config, parse_hf_config
from megatron_rl.models.hf_files import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardFile,
    check_output_dir,
    copy_hf_metadata,
    distributed_output_dir,
    finalize_safetensors,
    partial_dir,
    write_shard_files,
)
from megatron_rl.models.mcore_checkpoint import load_model_weights, save_model_weights
from megatron_rl.models.megatron_config import check_layout
from megatron_rl.models.parity import make_uneven_batch, max_abs_diffs, megatron_rank_outputs, reference_outputs
from megatron_rl.models.weight_transfer import export_hf_weights, load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.parallel.local_launch import RankFailedError, launched_externally, run_local_ranks, run_ranks

HF_METADATA = "hf_metadata"


def _build(config: dict, sizes: ParallelSizes) -> tuple[QwenArchitecture, list[torch.nn.Module]]:
    arch, _, chunks = build_qwen_model(config, sizes, params_dtype=getattr(torch, checkpoint_dtype_name(config)))
    return arch, chunks


def _hf_to_mcore_rank(rank: int, world_size: int, sizes: ParallelSizes, hf_dir: Path, out_dir: Path) -> None:
    initialize_parallel(sizes)
    try:
        with distributed_output_dir(out_dir) as staging:
            arch, chunks = _build(load_hf_config(hf_dir), sizes)
            load_hf_weights(chunks, arch, hf_dir)
            save_model_weights(chunks, staging)
            if rank == 0:
                copy_hf_metadata(hf_dir, staging / HF_METADATA)
    finally:
        destroy_parallel()


def _run_converter(rank_body: Callable[..., None], sizes: ParallelSizes, out_dir: Path, *args: Any) -> None:
    if not launched_externally():
        check_output_dir(out_dir)
    try:
        run_ranks(rank_body, sizes.min_world_size, sizes, *args, out_dir)
    except BaseException:
        if not launched_externally():
            shutil.rmtree(partial_dir(out_dir), ignore_errors=True)
        raise


def convert_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, sizes: ParallelSizes = ParallelSizes()) -> None:
    """Write the Hugging Face checkpoint in ``hf_dir`` as a torch_dist checkpoint at ``out_dir``.

    ``sizes`` is the layout used while converting (any layout can load the
    result). Runs ``sizes.min_world_size`` local gloo ranks, or as one rank
    of a job started by torchrun (then the launcher's world size is used).
    """
    hf_dir = Path(hf_dir)
    check_layout(parse_hf_config(load_hf_config(hf_dir)), sizes)
    _run_converter(_hf_to_mcore_rank, sizes, Path(out_dir), hf_dir)


def _mcore_to_hf_rank(
    rank: int, world_size: int, sizes: ParallelSizes, ckpt_dir: Path, max_shard_bytes: int, out_dir: Path
) -> None:
    initialize_parallel(sizes)
    try:
        with distributed_output_dir(out_dir) as staging:
            arch, chunks = _build(load_hf_config(ckpt_dir / HF_METADATA), sizes)
            load_model_weights(chunks, ckpt_dir)
            tensors = export_hf_weights(chunks, arch, designated_only=True)
            shards = write_shard_files(tensors, staging, max_shard_bytes, prefix=f"rank{rank}")
            per_rank: list[list[ShardFile]] = [[] for _ in range(world_size)]
            dist.all_gather_object(per_rank, shards)
            if rank == 0:
                finalize_safetensors(staging, [shard for rank_shards in per_rank for shard in rank_shards])
                copy_hf_metadata(ckpt_dir / HF_METADATA, staging)
    finally:
        destroy_parallel()


def convert_mcore_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    sizes: ParallelSizes = ParallelSizes(),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write the torch_dist checkpoint at ``ckpt_dir`` as a Hugging Face model directory.

    Each rank writes the tensors it is the designated source of (its pipeline
    stage, its experts), so memory per rank is its shard plus one gathered
    tensor; rank 0 names the files and writes the index.
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / HF_METADATA / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir}/{HF_METADATA}/config.json missing: not written by hf-to-mcore")
    check_layout(parse_hf_config(load_hf_config(ckpt_dir / HF_METADATA)), sizes)
    _run_converter(_mcore_to_hf_rank, sizes, Path(out_dir), ckpt_dir, max_shard_bytes)


def check_parity(
    hf_dir: str | Path,
    sizes: ParallelSizes,
    *,
    tolerance: float = 1e-4,
    num_sequences: int = 4,
    max_length: int = 32,
) -> bool:
    """Compare Megatron at ``sizes`` with transformers in fp32; print a report; True when within tolerance."""
    arch = parse_hf_config(load_hf_config(hf_dir))
    check_layout(arch, sizes)
    max_length += -max_length % sizes.tp
    num_sequences += -num_sequences % sizes.pp
    input_ids, mask = make_uneven_batch(arch.vocab_size, num_sequences, max_length)
    world_size = sizes.min_world_size
    print(f"model:  {arch.architecture}, {arch.num_layers} layers, hidden {arch.hidden_size}, vocab {arch.vocab_size}"
          + (f", {arch.num_experts} experts (top-{arch.moe_router_topk})" if arch.is_moe else ""))
    print(f"layout: TP={sizes.tp} PP={sizes.pp} VPP={sizes.vpp or '-'} EP={sizes.ep} ETP={sizes.expert_tp} "
          f"on {world_size} CPU rank(s), gloo, fp32")
    print(f"batch:  {num_sequences} sequences, lengths {mask.sum(1).tolist()}")
    reference = reference_outputs(hf_dir, input_ids, mask)
    outputs = run_local_ranks(megatron_rank_outputs, world_size, sizes, Path(hf_dir), input_ids)
    ours = next(out for out in outputs if out is not None)
    passed = True
    for key, (diff, (sequence, position)) in max_abs_diffs(ours, reference, mask).items():
        ok = diff <= tolerance
        passed &= ok
        print(f"max |{key} diff| = {diff:.3e}  at sequence {sequence}, position {position}  "
              f"{'ok' if ok else 'ABOVE TOLERANCE'}")
    print(f"tolerance {tolerance:.0e}: {'PASS' if passed else 'FAIL'}")
    return passed


def _add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{name.upper()} size")
    parser.add_argument("--etp", type=int, default=None, help="expert TP size (default: --tp)")
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")


def _layout(args: argparse.Namespace) -> ParallelSizes:
    return ParallelSizes(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp)


def _run_hf_to_mcore(args: argparse.Namespace) -> int:
    convert_hf_to_mcore(args.hf, args.out, _layout(args))
    return 0


def _run_mcore_to_hf(args: argparse.Namespace) -> int:
    convert_mcore_to_hf(args.ckpt, args.out, _layout(args))
    return 0


def _run_check_parity(args: argparse.Namespace) -> int:
    return 0 if check_parity(args.hf, _layout(args), tolerance=args.tolerance) else 1


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``convert`` (hf-to-mcore, mcore-to-hf) and ``check-parity``; each sets ``args.func``."""
    convert = subparsers.add_parser("convert", help="convert between Hugging Face and Megatron checkpoints")
    directions = convert.add_subparsers(dest="direction", required=True)
    to_mcore = directions.add_parser("hf-to-mcore", help="HF safetensors -> Megatron torch_dist")
    to_mcore.add_argument("--hf", required=True, type=Path, help="Hugging Face model directory")
    to_mcore.add_argument("--out", required=True, type=Path, help="new checkpoint directory")
    _add_layout_arguments(to_mcore)
    to_mcore.set_defaults(func=_run_hf_to_mcore)
    to_hf = directions.add_parser("mcore-to-hf", help="Megatron torch_dist -> HF safetensors")
    to_hf.add_argument("--ckpt", required=True, type=Path, help="directory written by hf-to-mcore")
    to_hf.add_argument("--out", required=True, type=Path, help="new Hugging Face model directory")
    _add_layout_arguments(to_hf)
    to_hf.set_defaults(func=_run_mcore_to_hf)
    parity = subparsers.add_parser("check-parity", help="compare Megatron with transformers on a checkpoint")
    parity.add_argument("--hf", required=True, type=Path, help="Hugging Face model directory")
    parity.add_argument("--tolerance", type=float, default=1e-4, help="max |diff| allowed (fp32)")
    _add_layout_arguments(parity)
    parity.set_defaults(func=_run_check_parity)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m megatron_rl.models.cli_commands ...``."""
    parser = argparse.ArgumentParser(prog="megatron-rl")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (RankFailedError, ValueError, KeyError, FileNotFoundError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
