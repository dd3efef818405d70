"""Weight sync from the sharded Megatron model (TP2 x EP2, 4 gloo ranks) per transport and bucket size (CPU).

Writes a Qwen3-MoE Hugging Face checkpoint (random init, fp32, 193M parameters), starts one
reference engine on it with dummy weights, and runs 4 forked gloo ranks that build the Megatron
model at TP2 x EP2 (expert TP 1; data parallel 2 for dense and for expert weights) and load the
checkpoint. Each rank then streams the export ``sync_megatron`` streams into the engine through
``WeightSyncer.sync_export`` (``export_hf_weights(designated_only=True)``, or ``export_full_model`` for
the tensor transport, whose rank 0 feeds the one engine; the export writes into the tensor transport's
bucket memory; the stream passes a tap that keeps the checked rows), through each transport (``tensor``: shared-memory IPC; ``distributed``: a gloo
broadcast group per sending rank; ``disk``: safetensors in a temporary directory on the local disk)
at each bucket size. Per (transport, bucket size): one warm-up sync (buffers, groups), then
``--repeats`` timed syncs, each after every parameter changed (``+1``) and followed by a check that
the engine holds, bit for bit, the first rows of a few tensors of every sending rank as that sync
exported them (embedding, output layer, a gathered attention weight, the router, experts of both EP
ranks, the final norm).

Baselines measured in the same run: ``export only`` (the ranks iterate the export without sending:
the TP gathers and the Megatron -> Hugging Face conversion), ``export into buckets`` (the same
export written into the tensor transport's bucket memory, ``BucketBuffers`` at the smallest bucket
size, without sending: what a sending rank does in a tensor sync besides the requests),
``export, every rank`` (the export
with ``designated_only=False``, interleaved with it: every TP group all-gathers and every rank
yields every tensor of its stage, what the designated export did before it gathered only to the
sending rank and let the other data-parallel replica skip its gathers) and a plain ``copy_`` of the
checkpoint's tensors (the same bytes) in one process before and after the ranks run, the faster of 1
and the default intra-op threads. Seconds are wall time across the ranks (between barriers); ranks
run one intra-op thread each, as trainer ranks do on CPU.

    PYTHONPATH=. .venv/bin/python benchmarks/weight_sync_megatron.py [--buckets-mb 64,256,1024] [--repeats 3]

The last line states the tensor transport's ratio to the plain copy at its best bucket size.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from benchmarks.sync_timing import engine_holds, plain_copy_seconds
from benchmarks.tables import print_table
from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.engines import ReferenceEngine
from megatron_rl.models.builder import build_qwen_model
from megatron_rl.models.weight_transfer import Allocate, export_full_model, export_hf_weights, load_hf_weights
from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
from megatron_rl.parallel.local_launch import free_port, run_local_ranks
from megatron_rl.weight_sync.bucket_buffers import BucketBuffers
from megatron_rl.weight_sync.buckets import MIB, BucketFiller, NamedTensor
from megatron_rl.weight_sync.syncer import WeightSyncer
from megatron_rl.weight_sync.transports import DiskTransport, DistributedTransport, TensorTransport, WeightTransport

SIZES = ParallelSizes(tp=2, ep=2, etp=1)
WORLD = 4
CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512, num_hidden_layers=12,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
    norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
)  # fmt: skip
TRANSPORTS = ("tensor", "distributed", "disk")
CHECKED = re.compile(
    r"model\.embed_tokens\.weight|lm_head\.weight|model\.norm\.weight|model\.layers\.5\.self_attn\.q_proj\.weight"
    r"|model\.layers\.5\.mlp\.gate\.weight|model\.layers\.5\.mlp\.experts\.(0|15)\.(gate|down)_proj\.weight"
)
CHECKED_ROWS = 4


def _write_checkpoint(path: Path) -> Path:
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).save_pretrained(path)
    return path


def _transport(kind: str, engine: ReferenceEngine, hf_dir: Path, work_dir: Path) -> WeightTransport:
    if kind == "tensor":
        return TensorTransport([engine])
    if kind == "distributed":
        return DistributedTransport([engine])
    return DiskTransport([engine], work_dir / "disk_sync", hf_dir)


def _tapped(stream: Iterable[NamedTensor], kept: list[NamedTensor]) -> Iterator[NamedTensor]:
    """The stream unchanged; the first rows of the checked tensors are copied into ``kept``."""
    for name, tensor in stream:
        if CHECKED.fullmatch(name):
            kept.append((name, tensor[:CHECKED_ROWS].clone()))
        yield name, tensor


@torch.no_grad()
def _bump(chunks: list[torch.nn.Module]) -> None:
    for chunk in chunks:
        for param in chunk.parameters():
            param.add_(1.0)


def _start() -> float:
    """A start time common to every rank (after a barrier)."""
    dist.barrier()
    return time.perf_counter()


def _wall(start: float) -> float:
    """Seconds since ``start`` until every rank is done (after a barrier)."""
    dist.barrier()
    return time.perf_counter() - start


def _rank(
    rank: int, world_size: int, hf_dir: Path, work_dir: Path, engine: ReferenceEngine, args: argparse.Namespace
) -> dict:
    """Build and load the model, time the export alone, then every (transport, bucket size); rank 0's wall times."""
    initialize_parallel(SIZES)
    arch, _, chunks = build_qwen_model(load_hf_config(hf_dir), SIZES, params_dtype=torch.float32)
    load_hf_weights(chunks, arch, hf_dir)

    results: dict = {"export": float("inf"), "export_all": float("inf"), "export_buckets": float("inf"), "syncs": {}}
    buffers = BucketBuffers()
    for _ in range(args.repeats + 1):  # the first round allocates the bucket buffers and is not kept
        for key, designated in (("export", True), ("export_all", False)):
            start = _start()
            for _named in export_hf_weights(chunks, arch, designated_only=designated):
                pass
            results[key] = min(results[key], _wall(start))
        buffers.restart()
        filler = BucketFiller(_smallest_bucket_mb(args) * MIB, buffers.seal, buffers.allocate)
        start = _start()
        for name, tensor in export_hf_weights(chunks, arch, designated_only=True, allocate=filler.allocate):
            filler.add(name, tensor)
        filler.flush()
        results["export_buckets"] = min(results["export_buckets"], _wall(start))
    buffers.release()
    for kind in args.transports.split(","):
        for bucket_mb in (int(size) for size in args.buckets_mb.split(",")):
            syncer = WeightSyncer([engine], _transport(kind, engine, hf_dir, work_dir), bucket_bytes=bucket_mb * MIB)
            syncer.sync_megatron(chunks, arch, "warm-up")
            best = float("inf")
            for repeat in range(args.repeats):
                _bump(chunks)
                kept: list[NamedTensor] = []

                def export(
                    allocate: Allocate | None,
                    kept: list[NamedTensor] = kept,
                    full: bool = syncer.transport.exports_full_model,
                ) -> Iterator[NamedTensor]:
                    return _tapped(
                        export_full_model(chunks, arch, allocate=allocate)
                        if full
                        else export_hf_weights(chunks, arch, designated_only=True, allocate=allocate),
                        kept,
                    )

                start = _start()
                stats = syncer.sync_export(export, f"{kind}-{bucket_mb}-{repeat}")
                best = min(best, _wall(start))
                engine_holds(engine, kept, CHECKED_ROWS)
            syncer.close()
            results["syncs"][(kind, bucket_mb)] = (best, stats.num_bytes, stats.num_buckets, len(kept))
    destroy_parallel()
    return results


def _smallest_bucket_mb(args: argparse.Namespace) -> int:
    return min(int(size) for size in args.buckets_mb.split(","))


def _plain_copies(named: list[NamedTensor], repeats: int, copy_s: dict[int, float]) -> None:
    """Lower ``copy_s[threads]`` to the best plain copy of ``named`` with 1 and the default intra-op threads."""
    default = torch.get_num_threads()
    for threads in dict.fromkeys((default, 1)):
        torch.set_num_threads(threads)
        copy_s[threads] = min(copy_s.get(threads, float("inf")), plain_copy_seconds(named, repeats))
    torch.set_num_threads(default)


def _report(per_rank: list[dict], copy_s: dict[int, float], num_bytes: int, bucket_mb_min: int) -> None:
    """The table (one row per baseline and per transport and bucket size) and the last line."""
    gb = num_bytes / 1e9
    copy_best = min(copy_s.values())
    export_s = per_rank[0]["export"]
    rows = [
        [f"plain copy, {threads} thread(s)", "-", "-", f"{s:.3f}", f"{gb / s:.2f}", f"{s / copy_best:.2f}", "-", "-"]
        for threads, s in copy_s.items()
    ]
    rows.append(
        ["export only", "-", "-", f"{export_s:.3f}", f"{gb / export_s:.2f}", f"{export_s / copy_best:.2f}", "1.00", "-"]
    )
    into_s = per_rank[0]["export_buckets"]
    rows.append(
        ["export into buckets", str(bucket_mb_min), "-", f"{into_s:.3f}", f"{gb / into_s:.2f}",
         f"{into_s / copy_best:.2f}", f"{into_s / export_s:.2f}", "-"]
    )  # fmt: skip
    all_s = per_rank[0]["export_all"]
    rows.append(
        [
            "export, every rank",
            "-",
            "-",
            f"{all_s:.3f}",
            "-",
            f"{all_s / copy_best:.2f}",
            f"{all_s / export_s:.2f}",
            "-",
        ]
    )
    tensor_best: tuple[float, int] | None = None
    for key, (seconds, _, _, _) in per_rank[0]["syncs"].items():
        kind, bucket_mb = key
        sent = sum(r["syncs"][key][1] for r in per_rank)
        assert sent == num_bytes, f"{kind} at {bucket_mb} MiB sent {sent} bytes; the checkpoint has {num_bytes}"
        buckets = sum(r["syncs"][key][2] for r in per_rank)
        checked = sum(r["syncs"][key][3] for r in per_rank)
        rows.append(
            [kind, str(bucket_mb), str(buckets), f"{seconds:.3f}", f"{gb / seconds:.2f}", f"{seconds / copy_best:.2f}",
             f"{seconds / export_s:.2f}", str(checked)]
        )  # fmt: skip
        if kind == "tensor" and (tensor_best is None or seconds < tensor_best[0]):
            tensor_best = (seconds, bucket_mb)
    columns = ["path", "bucket MiB", "buckets", "seconds", "GB/s", "/ plain copy", "/ export only", "tensors checked"]
    print_table(columns, rows)
    if tensor_best is not None:
        print(
            f"tensor transport / plain copy: {tensor_best[0] / copy_best:.2f}x (best bucket size, {tensor_best[1]} MiB; "
            f"export alone {export_s / copy_best:.2f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets-mb", default="64,256,1024")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    copy_s: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = Path(tmp)
        hf_dir = _write_checkpoint(work_dir / "hf")
        named = sorted(load_file(hf_dir / "model.safetensors").items())
        num_bytes = sum(t.numel() * t.element_size() for _, t in named)
        num_params = sum(t.numel() for _, t in named)
        _plain_copies(named, args.repeats, copy_s)
        engine = ReferenceEngine("bench", hf_dir, free_port(), log_dir=work_dir, load_format="dummy")
        engine.start()
        try:
            engine.wait_healthy(600)
            start = time.perf_counter()
            per_rank = run_local_ranks(_rank, WORLD, hf_dir, work_dir, engine, args)
            wall = time.perf_counter() - start
        finally:
            engine.shutdown()
        _plain_copies(named, args.repeats, copy_s)
    print(
        f"model: Qwen3-MoE {num_params / 1e6:.0f}M parameters, {num_bytes / 1e9:.2f} GB fp32, TP2 x EP2 on {WORLD} "
        f"gloo ranks; best of {args.repeats}; ranks {wall:.0f} s"
    )
    _report(per_rank, copy_s, num_bytes, _smallest_bucket_mb(args))


if __name__ == "__main__":
    main()
