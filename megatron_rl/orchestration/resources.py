"""What a run holds while it trains: Ray, rollout engines, trainer ranks, rollout managers, metric sinks.

:func:`start_run` builds one component per block and :meth:`RunResources.close` tears
all of them down (engines and Ray included) even when a block in between failed.
The initial weights are one Hugging Face checkpoint both sides load, so trainer and
engines start identical: ``model.path``, or for ``model.random_init`` a checkpoint
written once into ``<run_dir>/initial_hf`` (seeded by ``train.seed``).
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
import transformers
from ray.util.placement_group import PlacementGroup

import megatron_rl
from megatron_rl.config import RunConfig, trainer_layout
from megatron_rl.config.schema import DynamicSamplingConfig, OverlongConfig
from megatron_rl.data import PromptSampler
from megatron_rl.data.preparation import PreparedData, prepare_data
from megatron_rl.metrics.logger import MetricLogger, build_metric_logger
from megatron_rl.orchestration.placement import create_rank_slots
from megatron_rl.orchestration.trainer_worker import TrainerWorker
from megatron_rl.orchestration.worker_group import RankWorkerGroup
from megatron_rl.rollout import ReferenceEngine, RolloutEngine
from megatron_rl.rollout.manager import RolloutManager

CPU_RANK_NUM_CPUS = 0.5
"""Ray CPUs reserved per CPU trainer rank (a scheduling token: the ranks share the machine's cores)."""


@dataclass
class RunResources:
    """The live parts of a run; :meth:`close` releases them in reverse order of creation."""

    cfg: RunConfig
    data: PreparedData
    hf_dir: Path
    engines: list[RolloutEngine] = field(default_factory=list)
    trainers: RankWorkerGroup | None = None
    placement: PlacementGroup | None = None
    rollout: RolloutManager | None = None
    validation: RolloutManager | None = None
    logger: MetricLogger | None = None

    def close(self) -> None:
        """Stop sinks, managers, trainer ranks, engines and Ray (local Ray stops; a cluster is left)."""
        closers = [part.close for part in (self.logger, self.rollout, self.validation) if part is not None]
        closers += [self._close_trainers] if self.trainers is not None else []
        closers += [engine.shutdown for engine in self.engines]
        if self.placement is not None:
            closers.append(lambda: ray.util.remove_placement_group(self.placement))
        closers.append(ray.shutdown)
        for close in closers:
            with contextlib.suppress(Exception):  # tear down the rest; the run's own error is what matters
                close()

    def _close_trainers(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError):
            self.trainers.call("close")
        self.trainers.shutdown()


def start_run(cfg: RunConfig, *, resume_step: int) -> RunResources:
    """Prepare data, write or locate the initial weights, start Ray, engines, trainer ranks, managers and sinks.

    ``resume_step`` is the step the run continues after (-1 for a fresh run); metric records
    logged after it are dropped. The caller must :meth:`~RunResources.close` the result.
    """
    if cfg.rollout.engine != "reference":
        raise ValueError(f"rollout.engine={cfg.rollout.engine!r}: the driver launches only the reference engine so far")
    data = prepare_data(
        cfg.data,
        tokenizer_path=cfg.model.tokenizer or cfg.model.path,
        model_vocab_size=_vocab_size(cfg),
        max_prompt_length=cfg.rollout.max_prompt_length,
        work_dir=f"{cfg.run_dir}/data",
    )
    run = RunResources(cfg, data, initial_weights(cfg, data.tokenizer))
    try:
        start_ray(cfg)
        run.engines = start_reference_engines(cfg, run.hf_dir)
        run.placement, run.trainers = start_trainers(cfg, run.hf_dir, run.engines)
        run.rollout = build_rollout_manager(cfg, data, run.engines)
        run.validation = build_validation_manager(cfg, data, run.engines)
        run.logger = build_metric_logger(
            cfg.logging, log_dir=cfg.log_dir, run_name=cfg.name, total_steps=cfg.train.steps, resume_step=resume_step
        )
    except BaseException:
        run.close()
        raise
    return run


def _vocab_size(cfg: RunConfig) -> int:
    from megatron_rl.config import read_architecture

    return read_architecture(cfg.model.path, cfg.model.random_init).vocab_size


def initial_weights(cfg: RunConfig, tokenizer: transformers.PreTrainedTokenizerBase) -> Path:
    """``model.path``, or ``<run_dir>/initial_hf`` written once from ``model.random_init`` (seed ``train.seed``).

    The written config takes its bos/eos/pad ids from the tokenizer, so engines stop at its ``<eos>``.
    """
    if cfg.model.random_init is None:
        return Path(cfg.model.path)
    target = Path(cfg.run_dir) / "initial_hf"
    if (target / "config.json").is_file():
        return target
    fields = dict(cfg.model.random_init)
    architecture = fields["architectures"][0]
    model_cls = getattr(transformers, architecture)
    token_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = model_cls.config_class(**(fields | token_ids))
    torch.manual_seed(cfg.train.seed)
    staging = target.with_name(target.name + ".tmp")
    model_cls(config).to(torch.float32).save_pretrained(staging)
    staging.rename(target)
    return target


def start_ray(cfg: RunConfig) -> None:
    """Join the cluster at ``RAY_ADDRESS`` or start a local Ray with this machine's CPUs and the recipe's GPUs.

    Ray workers import this package from the same location as the driver (``PYTHONPATH``).
    """
    package_root = str(Path(megatron_rl.__file__).resolve().parents[1])
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": python_path}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=runtime_env, log_to_driver=False)
        return
    ray.init(
        num_cpus=os.cpu_count(),
        num_gpus=cfg.cluster.nodes * cfg.cluster.gpus_per_node,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=runtime_env,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_reference_engines(cfg: RunConfig, hf_dir: Path) -> list[RolloutEngine]:
    """One reference engine process on this machine, loading ``hf_dir``; healthy on return."""
    routed_experts_shape = None
    if cfg.algorithm.routing_replay:
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        routed_experts_shape = (config.num_hidden_layers, config.num_experts_per_tok)
    engine = ReferenceEngine(
        "ref0",
        hf_dir,
        _free_port(),
        log_dir=cfg.log_dir,
        seed=cfg.train.seed,
        max_concurrent_requests=cfg.rollout.max_concurrent_requests,
        request_timeout_s=cfg.rollout.request_timeout_s,
        routed_experts_shape=routed_experts_shape,
    )
    engine.start()
    try:
        engine.wait_healthy(cfg.rollout.startup_timeout_s)
    except BaseException:
        engine.shutdown()
        raise
    return [engine]


def start_trainers(
    cfg: RunConfig, hf_dir: Path, engines: list[RolloutEngine]
) -> tuple[PlacementGroup, RankWorkerGroup]:
    """One Ray actor per trainer rank (a GPU each, or a fraction of a CPU on CPU recipes), actors built."""
    world = trainer_layout(cfg.parallel, cfg.cluster, cfg.rollout).world_size
    on_cpu = cfg.cluster.gpus_per_node == 0
    num_gpus, num_cpus = (0.0, CPU_RANK_NUM_CPUS) if on_cpu else (1.0, 1.0)
    placement, slots = create_rank_slots(world, num_gpus=num_gpus, num_cpus=num_cpus, name=f"{cfg.name}-trainer")
    addresses = [(e.name, *_host_port(e)) for e in engines]
    try:
        group = RankWorkerGroup(
            TrainerWorker,
            placement,
            slots,
            num_gpus=num_gpus,
            num_cpus=num_cpus,
            args=(cfg, str(hf_dir), addresses),
            env={"OMP_NUM_THREADS": "1"} if on_cpu else None,
        )
    except BaseException:
        ray.util.remove_placement_group(placement)
        raise
    return placement, group


def _host_port(engine: RolloutEngine) -> tuple[str, int]:
    host, port = engine.base_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def build_rollout_manager(cfg: RunConfig, data: PreparedData, engines: list[RolloutEngine]) -> RolloutManager:
    """The training rollout: ``prompts_per_step`` prompts per generation batch, sampler seeded by ``train.seed``."""
    sampler = PromptSampler(len(data.train), cfg.train.prompts_per_step, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    return RolloutManager(
        engines,
        data.train,
        sampler,
        cfg.rollout,
        cfg.algorithm.overlong,
        cfg.algorithm.dynamic_sampling,
        prompts_per_step=cfg.train.prompts_per_step,
        reward=cfg.data.reward,
        reward_num_workers=cfg.data.reward_num_workers,
        decode=lambda ids: data.tokenizer.decode(ids, skip_special_tokens=False),
        routing_replay=cfg.algorithm.routing_replay,
        seed=cfg.train.seed,
    )


def build_validation_manager(cfg: RunConfig, data: PreparedData, engines: list[RolloutEngine]) -> RolloutManager | None:
    """The whole validation set per call, ``val_samples_per_prompt`` at ``val_temperature``, unshaped, unfiltered."""
    if data.val is None or cfg.train.val_interval == 0:
        return None
    rollout = cfg.rollout.model_copy(
        update={"temperature": cfg.train.val_temperature, "n_samples_per_prompt": cfg.train.val_samples_per_prompt}
    )
    return RolloutManager(
        engines,
        data.val,
        PromptSampler(len(data.val), len(data.val), shuffle=False),
        rollout,
        OverlongConfig(enable=False),
        DynamicSamplingConfig(enable=False),
        prompts_per_step=len(data.val),
        reward=cfg.data.reward,
        reward_num_workers=1,
        decode=lambda ids: data.tokenizer.decode(ids, skip_special_tokens=False),
        uid_prefix="val",
    )
