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
   master weight and Adam moment is bit-identical; on GPU the freed bytes are reported.
4. ``plan``: ``megatron-rl plan``'s per-GPU training estimate for the same model,
   parallel sizes and micro-batch budget vs ``torch.cuda.max_memory_allocated`` and
   ``memory_allocated`` around the step (the plan's exact state bytes must be within
   10 % of the measured steady state, its total estimate at or above the measured peak).
5. ``ipc_sync``: the tiny model's bf16 Megatron weights, exported and sent to a
   reference engine (its own process, fp32, same GPU) as CUDA IPC handles inside a
   weight-update session: every engine weight equals the export bit for bit, and a
   generation reports the synced version.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# torch.cuda.is_available() through NVML, without initialising CUDA: the ranks are forked from this process.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

from megatron_rl.parallel.local_launch import free_port, run_local_ranks  # noqa: E402

PARITY_TOLERANCE = 1e-4
STATE_TOLERANCE = 0.10
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


def run_config(dry_run: bool, model_dir: Path):
    """The recipe of the training check: the tiny CPU recipe, on one GPU with the medium model unless dry run."""
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
        overrides += [f"model.random_init.{key}={value}" for key, value in MEDIUM_MODEL.items()]
    cfg, _ = load_recipe(REPO / "recipes" / "tiny_moe_cpu_dapo.yaml", overrides)
    return cfg


def _state_tensors(actor) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for model in actor.models for p in model.parameters()]
    for optimizer in actor.optimizer.optimizer.chained_optimizers:
        for group in optimizer.optimizer.param_groups:
            tensors += [p.detach().clone() for p in group["params"]]
        for values in optimizer.optimizer.state.values():
            tensors += [v.clone() for v in values.values() if isinstance(v, torch.Tensor)]
    return tensors


def _batch(vocab_size: int, num_sequences: int, seq_length: int):
    from megatron_rl.actor import ActorBatch

    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(seq_length, seq_length // 2, num_sequences).round().long()
    positions = torch.arange(seq_length)
    valid = positions < lengths.unsqueeze(1)
    input_ids = torch.randint(1, vocab_size, (num_sequences, seq_length), generator=generator).masked_fill(~valid, 0)
    advantages = torch.linspace(-1.0, 1.0, num_sequences)
    return ActorBatch(
        input_ids=input_ids, lengths=lengths, response_mask=valid & (positions >= 2), advantages=advantages
    )


def _train_rank(rank: int, world_size: int, cfg, model_dir: Path, batch_shape: tuple[int, int]) -> dict[str, Any]:
    from megatron_rl.actor import PolicyActor
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
    batch = _batch(actor.arch.vocab_size, *batch_shape)
    batch = batch.replace(old_log_probs=actor.compute_log_probs(batch).log_probs.cpu())
    before = [p.detach().to("cpu", copy=True) for model in actor.models for p in model.parameters()]  # not on the GPU
    metrics = actor.train_step(batch)
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
        return holder["identical_after_reload"], {key: holder[key] for key in keys if key in holder}

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
    from megatron_rl.models.weight_transfer import export_hf_weights
    from megatron_rl.parallel.device import on_accelerator
    from megatron_rl.parallel.distributed import ParallelSizes, destroy_parallel, initialize_parallel
    from megatron_rl.rollout import GenerateRequest, ReferenceEngine, SamplingParams
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="rehearse on CPU (no CUDA calls)")
    parser.add_argument("--workdir", type=Path, required=True, help="scratch directory (checkpoints, logs)")
    parser.add_argument("--report", type=Path, help="write the Markdown report here")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--only", nargs="*", help="run only these checks (parity, train, ipc_sync)")
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
    wanted = set(args.only or ("parity", "train", "ipc_sync"))
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
    report = render(results, env, args.dry_run)
    if args.report:
        args.report.write_text(report)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1, default=str))
    print("ALL PASSED" if all(r.passed for r in results) else "SOME CHECKS FAILED", flush=True)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
