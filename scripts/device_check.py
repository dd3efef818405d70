"""The GPU checks of issue 12 on one GPU, each in its own process, with a Markdown report.

Run by ``scripts/device_check.sh`` on the lent H200 (Python 3.12, torch, transformers;
megatron-core and pydantic come from carried wheels). ``--dry-run`` runs the same
code on CPU (gloo, shared-memory instead of CUDA IPC, no memory measurement): the
rehearsal ``tests/distributed/test_device_check.py`` runs it.

Checks (the parent process never touches CUDA, so ranks can fork):

1. ``parity``: ``check-parity`` of the tiny Qwen3-MoE (4 layers, 4 experts, a dense
   layer), Megatron (TP1, one rank, NCCL on GPU, fp32, no Transformer Engine: the
   local spec on CUDA) vs transformers fp32 on CPU, max |logit diff| <= 1e-4.
2. ``train``: one PPO step of a Qwen3-MoE in bf16 with fp32 master weights (the
   distributed optimizer's main parameters are fp32, the model's bf16); the loss is
   finite and parameters changed (how many is reported). GPU: the medium model
   (about 0.29 B parameters); dry run: the tiny recipe's model.
3. ``offload``: after that step, ``offload()`` then ``reload()``: every parameter,
   master weight and Adam moment is bit-identical; on GPU at most 10 % of the state's
   device bytes stay allocated while offloaded.
4. ``plan``: ``megatron-rl plan``'s per-GPU training estimate for the same model,
   parallel sizes and micro-batch budget vs ``torch.cuda.max_memory_allocated`` and
   ``memory_allocated`` around the step (the plan's exact state bytes must be within
   10 % of the measured steady state, its total estimate at or above the measured peak).
5. ``ipc_sync``: the tiny model's bf16 Megatron weights, exported and sent to a
   reference engine (its own process, fp32, same GPU) as CUDA IPC handles inside a
   weight-update session: every engine weight equals the export bit for bit, and a
   generation reports the synced version.
6. ``sync_bench``: a measurement (issue 15's GPU sync seconds): a Qwen3-MoE of about 3.2 B
   parameters with Qwen3-30B-A3B's layer shapes (hidden 2048, 64 experts of 768, vocabulary
   151,936; 8 layers), bf16 on one GPU, synced through the tensor transport (CUDA IPC) into a
   bf16 reference engine on the same GPU at two bucket sizes, best of 3, against the export
   alone and a device-to-device copy of the same bytes (one buffer, and tensor by tensor);
   then the same bytes in twice the expert tensors (128 experts of 384), which separates the
   per-byte from the per-tensor cost. Passes when, for each model, the engine's weights equal
   the last export (first rows of six tensors) and a generation reports the synced version.
   Dry run: small models on CPU, shared memory.
7. ``early_batches``: a measurement (issue 15's dynamic-sampling batches on a GPU engine):
   ``benchmarks/early_generation_batches.py`` with the reference engine on the GPU, generation
   batches sent as soon as they are certain to be needed against one after the other. Passes when
   both keep the same groups in every step (the benchmark exits 0). Dry run: the engine on CPU, 2 steps.
8. ``engine_invariance``: ``tests/unit/test_reference_engine_batching.py`` with
   ``MEGATRON_RL_TEST_DEVICE=cuda``: the reference engine's ops and forward give a row the same bits
   whatever rows are computed with it, and whole responses do not depend on the requests running
   with them, on the GPU's kernels. Passes when every test passes. Dry run: the same tests on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# torch.cuda.is_available() through NVML, without initialising CUDA: the ranks are forked from this process.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

from megatron_rl.parallel.local_launch import free_port, run_local_ranks  # noqa: E402

if TYPE_CHECKING:
    from megatron_rl.actor.step_data import StepData

PARITY_TOLERANCE = 1e-4
STATE_TOLERANCE = 0.10
OFFLOAD_LEFT_TOLERANCE = 0.10
MEDIUM_MODEL = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "max_position_embeddings": 4096,
}
SYNC_MODEL = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 4096,
}
SYNC_MODEL_DRY_RUN = {**SYNC_MODEL, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256}
SYNC_MODEL_DRY_RUN |= {"moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
SYNC_MODEL_DRY_RUN |= {"head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4}
SYNC_MODEL_MORE_TENSORS = {**SYNC_MODEL, "num_experts": 128, "moe_intermediate_size": 384}
SYNC_MODEL_MORE_TENSORS_DRY_RUN = {**SYNC_MODEL_DRY_RUN, "num_experts": 32, "moe_intermediate_size": 32}
SYNC_BUCKETS_MB = (256, 1024)
SYNC_BUCKETS_MB_DRY_RUN = (1, 4)
SYNC_REPEATS = 3
MEDIUM_BATCH = (8, 512)  # sequences x tokens: one micro-batch of 4096 tokens
TINY_BATCH = (8, 16)


@dataclass
class CheckResult:
    """One check: passed or not, its measurements, its wall seconds, and an error when it crashed."""

    name: str
    passed: bool
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None


def _run(name: str, check: Callable[[], tuple[bool, dict[str, Any]]]) -> CheckResult:
    start = time.perf_counter()
    try:
        passed, details = check()
        return CheckResult(name, passed, details, time.perf_counter() - start)
    except Exception:  # noqa: BLE001 - a crashed check is reported, the others still run
        return CheckResult(name, False, {}, time.perf_counter() - start, traceback.format_exc()[-4000:])


# ---------------------------------------------------------------- 1. parity


def check_parity_on_device(hf_dir: Path) -> tuple[bool, dict[str, Any]]:
    """``check_parity`` at TP1 on this process's device (its ranks fork and pick the device)."""
    from megatron_rl.models.parity import check_parity
    from megatron_rl.parallel.distributed import ParallelSizes

    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        passed = check_parity(hf_dir, ParallelSizes(), tolerance=PARITY_TOLERANCE)
    return passed, {"report": output.getvalue().strip()}


# ---------------------------------------------------------------- 2-4. train, offload, plan


def run_config(dry_run: bool, model_dir: Path, model: dict[str, int] | None = None):
    """The recipe of the training check: the tiny CPU recipe, on one GPU with ``model`` (default: the
    medium model) unless dry run, where the tiny recipe's model stays unless ``model`` is given."""
    from megatron_rl.config.loading import load_recipe

    overrides = [
        "train.precision=bf16",
        "train.recompute=none",
        "train.mini_batches_per_step=1",
        "train.prompts_per_step=1",
        "rollout.n_samples_per_prompt=8",
        "parallel.ep=1",
        "train.lr=1.0e-4",
        "train.grad_clip=null",
        f"checkpoint.dir={model_dir / 'checkpoints'}",
    ]
    if dry_run:
        overrides += ["cluster.cpu_trainer_ranks=1", "train.max_tokens_per_micro_batch=128"]
    else:
        overrides += ["cluster.gpus_per_node=1", "train.max_tokens_per_micro_batch=4096"]
        model = model or MEDIUM_MODEL
    overrides += [f"model.random_init.{key}={value}" for key, value in (model or {}).items()]
    cfg, _ = load_recipe(REPO / "recipes" / "tiny_moe_cpu_dapo.yaml", overrides)
    return cfg


def _state_tensors(actor) -> list[torch.Tensor]:
    """Host copies of every parameter, master weight and Adam moment (on the host, so that the device
    memory measured after an offload is the actor's alone)."""
    tensors = [p.detach().to("cpu", copy=True) for model in actor.models for p in model.parameters()]
    for optimizer in actor.optimizer.optimizer.chained_optimizers:
        for group in optimizer.optimizer.param_groups:
            tensors += [p.detach().to("cpu", copy=True) for p in group["params"]]
        for values in optimizer.optimizer.state.values():
            tensors += [v.to("cpu", copy=True) for v in values.values() if isinstance(v, torch.Tensor)]
    return tensors


def _step_data(vocab_size: int, num_sequences: int, seq_length: int) -> StepData:
    """One mini-batch of ``num_sequences`` random samples, ``seq_length`` down to half that long, 2 prompt tokens."""
    from megatron_rl.actor.step_data import StepData

    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(seq_length, seq_length // 2, num_sequences).round().long()
    total = int(lengths.sum())
    return StepData(
        token_ids=torch.randint(1, vocab_size, (total,), generator=generator, dtype=torch.int32),
        offsets=torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]),
        prompt_lengths=torch.full((num_sequences,), 2),
        advantages=torch.linspace(-1.0, 1.0, num_sequences),
        loss_mask=torch.ones(total - 2 * num_sequences, dtype=torch.bool),
        rollout_log_probs=None,
        routed_experts=None,
        sample_ids=torch.arange(num_sequences),
        mini_batch_sizes=(num_sequences,),
    )


def _train_rank(rank: int, world_size: int, cfg, model_dir: Path, batch_shape: tuple[int, int]) -> dict[str, Any]:
    from megatron_rl.actor.policy_actor import PolicyActor
    from megatron_rl.actor.train_step import train_step
    from megatron_rl.config.hf_config import load_hf_config
    from megatron_rl.parallel.device import on_accelerator
    from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel

    cuda = on_accelerator()
    initialize_parallel(ParallelSizes())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    actor = PolicyActor(
        load_hf_config(model_dir),
        cfg.parallel,
        cfg.train,
        cfg.algorithm,
        norm_constant=batch_shape[1],
        temperature=cfg.rollout.temperature,
    )
    shard = _step_data(actor.arch.vocab_size, *batch_shape)  # one rank: the whole step is its shard
    before = [p.detach().to("cpu", copy=True) for model in actor.models for p in model.parameters()]  # not on the GPU
    metrics = train_step(actor, shard)
    after = [p.detach() for model in actor.models for p in model.parameters()]
    moved = sum(int(not torch.equal(a, b.cpu())) for a, b in zip(before, after, strict=True))
    main_dtypes = sorted(
        {
            str(p.dtype)
            for optimizer in actor.optimizer.optimizer.chained_optimizers
            for group in optimizer.optimizer.param_groups
            for p in group["params"]
        }
    )
    result: dict[str, Any] = {
        "loss": float(metrics["loss"]),
        "param_dtypes": sorted({str(p.dtype) for p in after}),
        "main_param_dtypes": main_dtypes,
        "params_moved": moved,
        "params": len(after),
        "param_count": sum(p.numel() for p in after),
        "device": str(after[0].device),
    }
    if cuda:
        torch.cuda.synchronize()
        result["measured_state_bytes"] = torch.cuda.memory_allocated() - base
        result["measured_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    saved = _state_tensors(actor)
    actor.offload()
    if cuda:
        torch.cuda.synchronize()
        result["bytes_after_offload"] = torch.cuda.memory_allocated() - base
    actor.reload()
    result["identical_after_reload"] = all(torch.equal(a, b) for a, b in zip(saved, _state_tensors(actor), strict=True))
    destroy_parallel()
    return result


def plan_estimate(cfg) -> dict[str, float]:
    """The plan's bytes for trainer stage 0: exact state, estimated working memory, runtime reserve."""
    from megatron_rl.config.model_source import read_architecture
    from megatron_rl.plan.memory import stage_plan

    stage = stage_plan(read_architecture(cfg.model.path, cfg.model.random_init), cfg, 0, reserves=1)
    reserve = stage.working[-1].nbytes
    return {
        "state_bytes": float(stage.state_bytes),
        "working_bytes_without_reserve": float(sum(a.nbytes for a in stage.working[:-1])),
        "reserve_bytes": float(reserve),
        "total_bytes": float(stage.total),
    }


def check_training(cfg, model_dir: Path, dry_run: bool) -> tuple[CheckResult, CheckResult, CheckResult]:
    """One rank: the training step, the offload round trip and the plan comparison."""
    shape = TINY_BATCH if dry_run else MEDIUM_BATCH
    holder: dict[str, Any] = {}

    def train() -> tuple[bool, dict[str, Any]]:
        (result,) = run_local_ranks(_train_rank, 1, cfg, model_dir, shape)
        holder.update(result)
        passed = (
            torch.isfinite(torch.tensor(result["loss"])).item()
            and result["param_dtypes"] == ["torch.bfloat16"]
            and result["main_param_dtypes"] == ["torch.float32"]
            and result["params_moved"] > 0
        )
        keys = ("loss", "device", "param_count", "param_dtypes", "main_param_dtypes", "params_moved", "params")
        return passed, {key: result[key] for key in keys}

    def offload() -> tuple[bool, dict[str, Any]]:
        if not holder:
            raise RuntimeError("the training step failed; nothing to offload")
        keys = ("identical_after_reload", "measured_state_bytes", "bytes_after_offload")
        freed = "bytes_after_offload" not in holder or (
            holder["bytes_after_offload"] <= OFFLOAD_LEFT_TOLERANCE * holder["measured_state_bytes"]
        )
        return holder["identical_after_reload"] and freed, {key: holder[key] for key in keys if key in holder}

    def plan() -> tuple[bool, dict[str, Any]]:
        estimate = plan_estimate(cfg)
        if dry_run or "measured_peak_bytes" not in holder:
            return True, {**estimate, "measured": "n/a (no CUDA in the dry run)"}
        state, peak = holder["measured_state_bytes"], holder["measured_peak_bytes"]
        details = {
            **estimate,
            "measured_state_bytes": state,
            "measured_peak_bytes": peak,
            "state_ratio_measured_over_plan": state / estimate["state_bytes"],
            "peak_ratio_measured_over_plan_without_reserve": peak
            / (estimate["state_bytes"] + estimate["working_bytes_without_reserve"]),
        }
        passed = (
            abs(details["state_ratio_measured_over_plan"] - 1) <= STATE_TOLERANCE and peak <= estimate["total_bytes"]
        )
        return passed, details

    return _run("train", train), _run("offload", offload), _run("plan", plan)


# ---------------------------------------------------------------- 5. ipc_sync


def _ipc_sync_rank(rank: int, world_size: int, hf_dir: Path, log_dir: Path) -> dict[str, Any]:
    from megatron_rl.config.schema import TrainConfig
    from megatron_rl.engines import GenerateRequest, ReferenceEngine, SamplingParams
    from megatron_rl.models.weight_transfer import export_hf_weights
    from megatron_rl.parallel.device import on_accelerator
    from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
    from megatron_rl.weight_sync.syncer import WeightSyncer
    from megatron_rl.weight_sync.transports import TensorTransport
    from tests.actor_setup import tiny_actor

    initialize_parallel(ParallelSizes())
    actor = tiny_actor(hf_dir, ParallelSizes(), train=TrainConfig(steps=1, prompts_per_step=8, precision="bf16"))
    device = "cuda" if on_accelerator() else "cpu"
    engine = ReferenceEngine("ipc", hf_dir, free_port(), log_dir=log_dir, load_format="dummy", device=device)
    engine.start()
    try:
        engine.wait_healthy(180)
        syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=1 << 16)
        stats = syncer.sync_megatron(actor.chunks, actor.arch, "gpu-1")
        exported = dict(export_hf_weights(actor.chunks, actor.arch))
        dtypes = sorted({str(t.dtype) for t in exported.values()})
        exported = {name: t.detach().float().cpu() for name, t in exported.items()}
        differing = [n for n, t in exported.items() if not torch.equal(torch.tensor(engine.weights_by_name(n)), t)]
        params = SamplingParams(max_new_tokens=4, temperature=0.7, sampling_seed=1)
        (result,) = engine.generate(GenerateRequest([5, 17, 42], params))
    finally:
        engine.shutdown()
    destroy_parallel()
    return {
        "tensors": len(exported),
        "bytes_sent": stats.num_bytes,
        "buckets": stats.num_buckets,
        "sync_seconds": stats.seconds,
        "differing": differing[:10],
        "exported_dtypes": dtypes,
        "weight_version": result.weight_version,
        "engine_device": device,
    }


def check_ipc_sync(hf_dir: Path, log_dir: Path) -> tuple[bool, dict[str, Any]]:
    (result,) = run_local_ranks(_ipc_sync_rank, 1, hf_dir, log_dir)
    return not result["differing"] and result["weight_version"] == "gpu-1", result


# ---------------------------------------------------------------- 5b. colocated_contexts (two or more GPUs)


def _colocated_rank(rank: int, world_size: int, hf_dir: Path, log_dir: Path) -> dict[str, Any]:
    """Trainer rank ``rank`` (DP 2) and its engine on the same device; one tensor sync, each engine fed by its rank."""
    import torch.distributed as dist

    from megatron_rl.config.schema import TrainConfig
    from megatron_rl.engines import HttpEngine, ReferenceEngine
    from megatron_rl.models.weight_transfer import export_hf_weights
    from megatron_rl.parallel.device import on_accelerator
    from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
    from megatron_rl.weight_sync.syncer import WeightSyncer
    from megatron_rl.weight_sync.transports import TensorTransport
    from tests.actor_setup import tiny_actor

    initialize_parallel(ParallelSizes())
    actor = tiny_actor(hf_dir, ParallelSizes(), train=TrainConfig(steps=1, prompts_per_step=8, precision="bf16"))
    device = f"cuda:{torch.cuda.current_device()}" if on_accelerator() else "cpu"
    own = ReferenceEngine(f"colocated{rank}", hf_dir, free_port(), log_dir=log_dir, load_format="dummy", device=device)
    own.start()
    try:
        own.wait_healthy(180)
        ports: list[int | None] = [None] * world_size
        dist.all_gather_object(ports, own.port)
        engines = [own if i == rank else HttpEngine(f"colocated{i}", "127.0.0.1", port) for i, port in enumerate(ports)]
        syncer = WeightSyncer(engines, TensorTransport(engines), bucket_bytes=1 << 16)
        syncer.sync_megatron(actor.chunks, actor.arch, "gpu-1")
        exported = {name: t.detach().float().cpu() for name, t in export_hf_weights(actor.chunks, actor.arch)}
        differing = [n for n, t in exported.items() if not torch.equal(torch.tensor(own.weights_by_name(n)), t)]
        apps = _compute_apps() if on_accelerator() else []
        syncer.close()
        dist.barrier()
    finally:
        own.shutdown()
    destroy_parallel()
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid) if on_accelerator() else None
    return {
        "engine_pid": own.process.pid if own.process else None,
        "gpu_uuid": uuid,
        "apps": apps,
        "differing": differing,
    }


def _compute_apps() -> list[dict[str, str]]:
    """nvidia-smi's compute processes: pid, GPU UUID and used memory (MiB) of every CUDA context on the node."""
    done = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line.split(", ") for line in done.stdout.strip().splitlines()]
    return [{"pid": pid, "gpu_uuid": gpu, "used_mib": used} for pid, gpu, used in rows]


def check_colocated_contexts(hf_dir: Path, log_dir: Path, dry_run: bool) -> tuple[bool, dict[str, Any]]:
    """Two trainer ranks and two one-GPU engines colocated on GPUs 0 and 1: after one tensor sync every engine
    holds the weights and has a CUDA context on its own GPU only (issue 25: no engine opens another GPU's memory).
    Skipped (passed, with the reason) on fewer than two GPUs."""
    if not dry_run and torch.cuda.device_count() < 2:
        return True, {"skipped": f"{torch.cuda.device_count()} GPU(s); needs 2"}
    results = run_local_ranks(_colocated_rank, 2, hf_dir, log_dir)
    contexts = {
        r["engine_pid"]: sorted({a["gpu_uuid"] for a in r["apps"] if a["pid"] == str(r["engine_pid"])}) for r in results
    }
    own_gpu_only = dry_run or all(contexts[r["engine_pid"]] == [r["gpu_uuid"]] for r in results)
    details = {
        "engine_contexts": contexts,
        "processes": results[0]["apps"],
        "differing": [r["differing"] for r in results],
    }
    return own_gpu_only and not any(r["differing"] for r in results), details


# ---------------------------------------------------------------- 6. sync_bench

SYNC_CHECKED = (
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.gate.weight",
    "model.layers.1.mlp.experts.3.down_proj.weight",
    "model.norm.weight",
)


def _timed(action: Callable[[], object], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    action()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _plain_copies(shapes: list[tuple[tuple[int, ...], torch.dtype]], device: str, cuda: bool) -> dict[str, float]:
    """Best-of-repeats seconds to copy the bytes of ``shapes`` as one buffer and tensor by tensor (freed on return)."""
    nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes)
    flat = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    one_buffer = min(_timed(lambda: flat[1].copy_(flat[0]), cuda) for _ in range(SYNC_REPEATS))
    flat.clear()
    sources = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    targets = [torch.empty_like(t) for t in sources]
    copy_each = lambda: [b.copy_(a) for a, b in zip(sources, targets, strict=True)]  # noqa: E731
    each = min(_timed(copy_each, cuda) for _ in range(SYNC_REPEATS))
    return {"copy_one_buffer_s": one_buffer, "copy_tensor_by_tensor_s": each}


def _sync_bench_rank(
    rank: int, world_size: int, cfg, model_dir: Path, log_dir: Path, buckets_mb: tuple[int, ...]
) -> dict[str, Any]:
    from megatron_rl.actor.policy_actor import PolicyActor
    from megatron_rl.config.hf_config import load_hf_config
    from megatron_rl.engines import GenerateRequest, ReferenceEngine, SamplingParams
    from megatron_rl.models.weight_transfer import export_hf_weights
    from megatron_rl.parallel.device import on_accelerator
    from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
    from megatron_rl.weight_sync.syncer import WeightSyncer
    from megatron_rl.weight_sync.transports import TensorTransport

    cuda = on_accelerator()
    device = "cuda" if cuda else "cpu"
    initialize_parallel(ParallelSizes())
    start = time.perf_counter()
    actor = PolicyActor(
        load_hf_config(model_dir), cfg.parallel, cfg.train, cfg.algorithm, norm_constant=16, temperature=1.0
    )
    result: dict[str, Any] = {"actor_build_s": time.perf_counter() - start, "engine_device": device}
    export = lambda: export_hf_weights(actor.chunks, actor.arch, designated_only=True)  # noqa: E731
    shapes = [(tuple(t.shape), t.dtype) for _, t in export()]
    result["tensors"] = len(shapes)
    result["bytes"] = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes)
    result["export_only_s"] = min(_timed(lambda: sum(1 for _ in export()), cuda) for _ in range(SYNC_REPEATS))
    result |= _plain_copies(shapes, device, cuda)
    start = time.perf_counter()
    engine = ReferenceEngine(
        "sync", model_dir, free_port(), log_dir=log_dir, load_format="dummy", dtype="bfloat16", device=device
    )
    engine.start()
    try:
        engine.wait_healthy(300)
        result["engine_start_s"] = time.perf_counter() - start
        for bucket_mb in buckets_mb:
            syncer = WeightSyncer([engine], TensorTransport([engine]), bucket_bytes=bucket_mb << 20)
            try:
                runs = [
                    syncer.sync_megatron(actor.chunks, actor.arch, f"b{bucket_mb}-{i}") for i in range(SYNC_REPEATS)
                ]
            finally:
                syncer.close()
            result[f"sync_{bucket_mb}mb_s"] = [round(stats.seconds, 4) for stats in runs]
            result[f"sync_{bucket_mb}mb_buckets"] = runs[-1].num_buckets
        exported = {name: t[:2].float().cpu() for name, t in export() if name in SYNC_CHECKED}
        differing = [n for n, t in exported.items() if not torch.equal(torch.tensor(engine.weights_by_name(n, 2)), t)]
        params = SamplingParams(max_new_tokens=4, temperature=0.7, sampling_seed=1)
        (generated,) = engine.generate(GenerateRequest([5, 17, 42], params))
    finally:
        engine.shutdown()
    destroy_parallel()
    result["checked"] = sorted(exported)
    result["differing"] = differing
    result["weight_version"] = generated.weight_version
    result["expected_version"] = f"b{buckets_mb[-1]}-{SYNC_REPEATS - 1}"
    return result


def check_sync_bench(cfg, model_dir: Path, log_dir: Path, buckets_mb: tuple[int, ...]) -> tuple[bool, dict[str, Any]]:
    """Sync seconds through CUDA IPC against the export alone and plain device copies (see the module docstring),
    for the model of ``cfg``."""
    from transformers import Qwen3MoeConfig

    model_dir.mkdir(parents=True, exist_ok=True)
    Qwen3MoeConfig(**cfg.model.random_init).save_pretrained(model_dir)
    (result,) = run_local_ranks(_sync_bench_rank, 1, cfg, model_dir, log_dir, buckets_mb)
    gigabytes = result["bytes"] / 1e9
    best = {mb: min(result[f"sync_{mb}mb_s"]) for mb in buckets_mb}
    fastest = min(best, key=best.__getitem__)
    result["summary"] = (
        f"{result['tensors']} tensors, {gigabytes:.2f} GB: best sync {best[fastest]:.3f} s at {fastest} MiB buckets "
        f"({gigabytes / best[fastest]:.1f} GB/s), export alone {result['export_only_s']:.3f} s, copy of one buffer "
        f"{result['copy_one_buffer_s'] * 1e3:.2f} ms, tensor by tensor {result['copy_tensor_by_tensor_s'] * 1e3:.1f} ms; "
        f"sync / copy tensor by tensor {best[fastest] / result['copy_tensor_by_tensor_s']:.1f}x, "
        f"sync / export alone {best[fastest] / result['export_only_s']:.2f}x"
    )
    passed = not result["differing"] and result["weight_version"] == result["expected_version"]
    return passed and len(result["checked"]) == len(SYNC_CHECKED), result


# ---------------------------------------------------------------- report


def environment() -> dict[str, str]:
    """Versions and, on GPU, the device (read in a child process: the parent stays CUDA-free)."""
    import importlib.metadata

    info = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "megatron-core", "pydantic"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = "missing"
    return info


def _device_name(rank: int, world_size: int) -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def render(results: list[CheckResult], env: dict[str, str], dry_run: bool) -> str:
    """The Markdown report (docs/gpu-checks.md's measured section)."""
    mode = "CPU dry run (rehearsal, no CUDA)" if dry_run else "GPU"
    lines = [f"Mode: {mode}. " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    lines += ["| check | result | seconds |", "| --- | --- | --- |"]
    lines += [f"| {r.name} | {'PASS' if r.passed else 'FAIL'} | {r.seconds:.1f} |" for r in results]
    for r in results:
        lines += ["", f"### {r.name}", "", "```"]
        lines += [f"{key}: {value}" for key, value in r.details.items() if key != "report"]
        if "report" in r.details:
            lines.append(r.details["report"])
        if r.error:
            lines.append(r.error)
        lines.append("```")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- 7. early_batches


def check_early_batches(dry_run: bool) -> tuple[bool, dict[str, Any]]:
    """The benchmark in its own process (its engine and reward workers are processes of their own)."""
    command = [sys.executable, str(REPO / "benchmarks" / "early_generation_batches.py")]
    command += ["--device", "cpu", "--steps", "2"] if dry_run else ["--device", "cuda", "--steps", "8"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("|") or "x (same groups" in line]
    return done.returncode == 0, {"report": "\n".join(lines) or (done.stdout + done.stderr)[-3000:]}


# ---------------------------------------------------------------- 8. engine_invariance


def check_engine_invariance(dry_run: bool) -> tuple[bool, dict[str, Any]]:
    """The reference engine's batch-invariance tests on the device, in a pytest process of their own."""
    test_file = REPO / "tests" / "unit" / "test_reference_engine_batching.py"
    env = {
        **os.environ,
        "MEGATRON_RL_TEST_DEVICE": "cpu" if dry_run else "cuda",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    outcome = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E  "))]
    summary = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else [done.stderr[-2000:]]
    return done.returncode == 0, {"report": "\n".join(outcome[:40] + summary)}


# ---------------------------------------------------------------- 9. fp8_quantiser

FP8_SHAPES = ((768, 2048), (2048, 768), (4096, 2048), (512, 2048))
"""Qwen3-30B-A3B's projections: an expert's gate/up and down, q_proj, k/v_proj."""


def check_fp8_quantiser(dry_run: bool) -> tuple[bool, dict[str, Any]]:
    """FP8 rollouts' blockwise quantiser (torch's float8 casts, no Transformer Engine) on this device: the FP8
    bytes and scales equal the CPU's, bit for bit, for bf16 weights of Qwen3-30B-A3B's shapes; and its time
    per GB of bf16 over one layer's worth of experts (384 tensors), what each sync adds per GPU."""
    from megatron_rl.wire.fp8_blocks import quantize_blocks

    device = torch.device("cpu" if dry_run else "cuda")
    generator = torch.Generator().manual_seed(0)
    differing = []
    for shape in FP8_SHAPES:
        weight = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        here, here_scales = quantize_blocks(weight.to(device), (128, 128))
        cpu, cpu_scales = quantize_blocks(weight, (128, 128))
        if not (
            torch.equal(here.cpu().view(torch.uint8), cpu.view(torch.uint8))
            and torch.equal(here_scales.cpu(), cpu_scales)
        ):
            differing.append(shape)
    experts = [
        torch.randn(shape, dtype=torch.bfloat16, device=device)
        for shape in FP8_SHAPES[:2]
        for _ in range(4 if dry_run else 192)
    ]
    nbytes = sum(t.numel() * 2 for t in experts)
    timings = []
    for _ in range(3):
        if not dry_run:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for tensor in experts:
            quantize_blocks(tensor, (128, 128))
        if not dry_run:
            torch.cuda.synchronize()
        timings.append(time.perf_counter() - start)
    best = min(timings)
    details = {
        "differing_shapes": differing,
        "bf16_gb": round(nbytes / 1e9, 3),
        "seconds": [round(t, 4) for t in timings],
    }
    details["gb_per_s"] = round(nbytes / 1e9 / best, 1)
    return not differing, details


CHECKS = (
    "parity",
    "train",
    "ipc_sync",
    "colocated_contexts",
    "sync_bench",
    "early_batches",
    "engine_invariance",
    "fp8_quantiser",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="rehearse on CPU (no CUDA calls)")
    parser.add_argument("--workdir", type=Path, required=True, help="scratch directory (checkpoints, logs)")
    parser.add_argument("--report", type=Path, help="write the Markdown report here")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--only",
        nargs="*",
        help=f"run only these checks ({', '.join(CHECKS)})",
    )
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to rehearse on CPU", file=sys.stderr)
        return 2
    from tests.tiny_checkpoints import save_tiny_moe

    args.workdir.mkdir(parents=True, exist_ok=True)
    tiny = save_tiny_moe(args.workdir / "tiny_moe")
    env = environment()
    if not args.dry_run:
        (env["gpu"],) = run_local_ranks(_device_name, 1)
    wanted = set(args.only or CHECKS)
    results: list[CheckResult] = []
    if "parity" in wanted:
        results.append(_run("parity", lambda: check_parity_on_device(tiny)))
        print(render(results[-1:], env, args.dry_run), flush=True)
    if "train" in wanted:
        model_dir = args.workdir / "train_model"
        cfg = run_config(args.dry_run, model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(cfg.model.random_init))
        results += check_training(cfg, model_dir, args.dry_run)
        print(render(results[-3:], env, args.dry_run), flush=True)
    if "ipc_sync" in wanted:
        results.append(_run("ipc_sync", lambda: check_ipc_sync(tiny, args.workdir / "logs")))
        print(render(results[-1:], env, args.dry_run), flush=True)
    if "colocated_contexts" in wanted:
        contexts = partial(check_colocated_contexts, tiny, args.workdir / "logs", args.dry_run)
        results.append(_run("colocated_contexts", contexts))
        print(render(results[-1:], env, args.dry_run), flush=True)
    if "sync_bench" in wanted:
        models = (
            (SYNC_MODEL_DRY_RUN, SYNC_MODEL_MORE_TENSORS_DRY_RUN)
            if args.dry_run
            else (SYNC_MODEL, SYNC_MODEL_MORE_TENSORS)
        )
        buckets = SYNC_BUCKETS_MB_DRY_RUN if args.dry_run else SYNC_BUCKETS_MB
        for name, model in zip(("sync_bench", "sync_bench_more_tensors"), models, strict=True):
            model_dir = args.workdir / name
            cfg = run_config(args.dry_run, model_dir, model)
            bench = partial(check_sync_bench, cfg, model_dir, args.workdir / "logs", buckets)
            results.append(_run(name, bench))
            print(render(results[-1:], env, args.dry_run), flush=True)
    if "engine_invariance" in wanted:
        results.append(_run("engine_invariance", partial(check_engine_invariance, args.dry_run)))
        print(render(results[-1:], env, args.dry_run), flush=True)
    if "early_batches" in wanted:
        results.append(_run("early_batches", partial(check_early_batches, args.dry_run)))
        print(render(results[-1:], env, args.dry_run), flush=True)
    if "fp8_quantiser" in wanted:
        results.append(_run("fp8_quantiser", partial(check_fp8_quantiser, args.dry_run)))
        print(render(results[-1:], env, args.dry_run), flush=True)
    report = render(results, env, args.dry_run)
    if args.report:
        args.report.write_text(report)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1, default=str))
    print("ALL PASSED" if all(r.passed for r in results) else "SOME CHECKS FAILED", flush=True)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
