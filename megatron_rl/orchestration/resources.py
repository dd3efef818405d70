"""What a run holds while it trains: Ray, rollout engines, trainer ranks, rollout managers, metric sinks.

:func:`start_run` builds one component per block and :meth:`RunResources.close` tears
all of them down (engines and Ray included) even when a block in between failed.
The initial weights are one Hugging Face checkpoint both sides load, so trainer and
engines start identical: ``model.path``, or for ``model.random_init`` a checkpoint
written once into ``<run_dir>/initial_hf`` (seeded by ``train.seed``).

Network and access (:mod:`network`, :mod:`megatron_rl.engines.access`): a run that fits one
node (``cluster.nodes: 1``) starts its local Ray on 127.0.0.1 and keeps every server it starts
on loopback; a run on several nodes listens on the address of ``cluster.network_interface`` on
each node. Each run draws an API key (or takes ``MEGATRON_RL_ENGINE_API_KEY``) that its engines
require on every request but ``/health``; it lives in this process, the engine hosts and the
trainer ranks only, never in the recipe, a command line, a log or a checkpoint.

Placement (:mod:`run_placement`): one placement group holds every trainer rank and
engine (a one-node run's all on the driver's node). Engines are hosted by Ray actors on
their bundles (:mod:`engine_host`), on
GPU recipes SGLang (or the reference engine), on CPU recipes ``cluster.cpu_engines``
reference engines; the driver and the trainer ranks reach them over HTTP. Colocated
runs start with the engines holding their initial weights but no KV cache, and the
actor resident; :class:`~megatron_rl.orchestration.memory_handover.ColocatedHandOver`
moves memory from there.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray
import torch
import transformers
from ray.util.placement_group import PlacementGroup

import megatron_rl
from megatron_rl.actor.step_data import expert_index_dtype
from megatron_rl.checkpoint.fp8_convert import convert_hf_to_fp8
from megatron_rl.config import RunConfig, read_architecture
from megatron_rl.config.schema import JUDGE_REWARD, REMOTE_REWARD
from megatron_rl.data import PromptSampler
from megatron_rl.data.preparation import PreparedData, prepare_recipe_data
from megatron_rl.data.remote_reward import RemoteReward
from megatron_rl.data.rewards import ServedReward
from megatron_rl.engines import RolloutEngine
from megatron_rl.engines.access import API_KEY_ENV, new_api_key
from megatron_rl.metrics.logger import MetricLogger, build_metric_logger
from megatron_rl.orchestration.engine_host import EngineHosts, EngineSpec
from megatron_rl.orchestration.engine_recovery import DeferredEngineRecovery, EngineRecovery
from megatron_rl.orchestration.judge_engines import JudgeEngines, start_judge_engines
from megatron_rl.orchestration.memory_handover import ColocatedHandOver, HandOver, release_engine_caches
from megatron_rl.orchestration.network import LOOPBACK_ADDRESS, RunNetwork
from megatron_rl.orchestration.placement_group import RankSlot, create_rank_slots, engine_gpu_ids, engine_node_slots
from megatron_rl.orchestration.preemption import handlers_kept_through_ray_init
from megatron_rl.orchestration.trainer_group import TrainerGroup
from megatron_rl.orchestration.trainer_worker import RankPaths, TrainerWorker
from megatron_rl.orchestration.validation import ValidationSet, build_validation_sets
from megatron_rl.orchestration.worker_group import RankWorkerGroup, WorkerSpec
from megatron_rl.plan.placement import PlacementError, RunPlacementPlan, plan_judge_placement, plan_run_placement
from megatron_rl.rollout.engine_pool import EnginePool, Recovery
from megatron_rl.rollout.episodes import Episode, build_episode
from megatron_rl.rollout.group_assembler import GroupAssembler
from megatron_rl.rollout.manager import RolloutManager, StepPolicy
from megatron_rl.rollout.policy_adapter import PolicyAdapter
from megatron_rl.rollout.submissions import SubmissionPlanner
from megatron_rl.weight_sync.engine_feeds import engine_feeders


@dataclass
class RunResources:
    """The live parts of a run; :meth:`close` releases them in reverse order of creation."""

    cfg: RunConfig
    data: PreparedData
    hf_dir: Path
    network: RunNetwork = field(default_factory=RunNetwork)
    api_key: str | None = field(default=None, repr=False)
    placement: PlacementGroup | None = None
    engine_hosts: EngineHosts | None = None
    engines: list[RolloutEngine] = field(default_factory=list)
    judge: JudgeEngines | None = None
    """The judge's engines (``data.reward: judge``), never synced."""
    expert_dtype: torch.dtype = torch.uint8
    validation: list[ValidationSet] = field(default_factory=list)
    """The validation sets training validates (:mod:`megatron_rl.orchestration.validation`)."""
    episode: Episode | None = None
    """How responses unfold over turns (``rollout.episode``), shared by the training and validation rollouts."""
    deferred_recovery: DeferredEngineRecovery | None = None
    trainer_nodes: list[str] = field(default_factory=list)
    engine_feeders: list[tuple[int, ...]] | None = None
    """Each engine's feeding trainer ranks when weights go by device (colocated tensor sync), else None."""
    # Set by start_run, one by one (close tears down those set); read through the properties below.
    _trainers: TrainerGroup | None = None
    _hand_over: HandOver | None = None
    _rollout: RolloutManager | None = None
    _logger: MetricLogger | None = None

    @property
    def trainers(self) -> TrainerGroup:
        """The trainer ranks."""
        return _started(self._trainers, "trainer ranks")

    @property
    def hand_over(self) -> HandOver:
        """The moves between generation and training (memory, weight sync)."""
        return _started(self._hand_over, "hand-over")

    @property
    def rollout(self) -> RolloutManager:
        """The training rollout's manager."""
        return _started(self._rollout, "rollout manager")

    @property
    def logger(self) -> MetricLogger:
        """The metric sinks."""
        return _started(self._logger, "metric logger")

    def recover_judge(self) -> int:
        """Restart the judge engines that stopped (``rollout.max_engine_restarts`` each in the run) and have every
        reward pool ask the engines at their new addresses; how many were restarted (0 without a judge)."""
        if self.judge is None:
            return 0
        restarted = self.judge.recover(self.cfg.rollout.max_engine_restarts)
        if restarted:
            reward = self.judge.reward()
            for manager in (self._rollout, *(validation_set.manager for validation_set in self.validation)):
                if manager is not None:
                    manager.assembler.rewards.replace_served(reward)
        return restarted

    def placement_notice(self) -> str:
        """One line: the network, the trainer ranks' nodes and each engine's address."""
        engines = self.engine_hosts.addresses if self.engine_hosts is not None else []
        ranks = ", ".join(f"{node} x{self.trainer_nodes.count(node)}" for node in dict.fromkeys(self.trainer_nodes))
        where = ", ".join(f"{name} at {host}:{port}" for name, host, port in engines)
        notice = f"# network: {self.network.describe()}; trainer ranks on {ranks}; engines: {where}"
        if self.engine_feeders is None or self._trainers is None:
            return notice
        pids = self._trainers.pids
        feeds = [
            f"{name} <- " + ", ".join(f"rank {rank} (pid {pids[rank]}, {self.trainer_nodes[rank]})" for rank in feeders)
            for (name, _, _), feeders in zip(engines, self.engine_feeders, strict=True)
        ]
        return f"{notice}; weights by device: {'; '.join(feeds)}"

    def close(self) -> None:
        """Stop sinks, trainer ranks, engines, managers and Ray (local Ray stops; a cluster is left).

        Engines stop before the rollout managers, so requests still in flight (a run that failed while
        generating ahead) fail at once instead of holding the managers' threads.
        """
        closers = [self._logger.close] if self._logger is not None else []
        closers += [self._trainers.close] if self._trainers is not None else []
        closers += [self.engine_hosts.close] if self.engine_hosts is not None else []
        closers += [self.judge.close] if self.judge is not None else []
        closers += [part.close for part in (self._rollout, *self.validation, self.episode) if part is not None]
        if self.placement is not None:
            closers.append(lambda: ray.util.remove_placement_group(self.placement))
        closers.append(ray.shutdown)
        for close in closers:
            with contextlib.suppress(Exception):  # tear down the rest; the run's own error is what matters
                close()


def _started[T](part: T | None, what: str) -> T:
    assert part is not None, f"the run's {what} is not started: start_run starts it"
    return part


def start_run(cfg: RunConfig, *, resume_step: int) -> RunResources:
    """Prepare data, write or locate the initial weights, start Ray, engines, trainer ranks, managers and sinks.

    ``resume_step`` is the step the run continues after (-1 for a fresh run); metric records
    logged after it are dropped. The caller must :meth:`~RunResources.close` the result.
    """
    arch = read_architecture(cfg.model.path, cfg.model.random_init)
    data = prepare_recipe_data(cfg, model_vocab_size=arch.vocab_size, work_dir=f"{cfg.run_dir}/data")
    expert_dtype = expert_index_dtype(max(1, arch.num_experts))  # what a step's routed experts travel in
    network = RunNetwork.of_run(cfg)
    network.address()  # a node without the recipe's interface fails here, before Ray starts
    run = RunResources(
        cfg,
        data,
        initial_weights(cfg, data.tokenizer),
        network=network,
        api_key=os.environ.get(API_KEY_ENV) or new_api_key(),
        expert_dtype=expert_dtype,
    )
    try:
        run.episode = build_episode(cfg.rollout, data.tokenizer)  # tool workers: a missing sandbox stops here
        start_ray(cfg, network)
        run.judge = start_judge_engines(cfg, network, run.api_key)  # they start while the rest of the run does
        plan = plan_run_placement(cfg)
        bundle = plan.bundle
        run.placement, slots = create_rank_slots(
            plan.num_bundles,
            num_gpus=bundle.num_gpus,
            num_cpus=bundle.num_cpus,
            name=cfg.name,
            on_this_node=network.is_loopback,
        )
        run.engine_feeders = feeders_of_engines(cfg, plan)
        if run.engine_feeders is not None:
            check_engines_beside_feeders(slots, plan, run.engine_feeders)
        engine_weights = prepare_rollout_weights(cfg, run.hf_dir)
        run.engine_hosts = start_engines(cfg, engine_weights, run.placement, slots, plan, network, run.api_key)
        colocated = engines_hand_over_memory(cfg)
        # Engines size their KV cache from the free GPU memory: colocated on GPUs they start and release it
        # before any trainer rank allocates. Elsewhere the trainer ranks are built while the engines start.
        engines_first = colocated and cfg.cluster.gpus_per_node > 0
        if engines_first:
            run.engine_hosts.wait_healthy()
            release_engine_caches(run.engine_hosts.clients)
        trainer_slots = [slots[position] for position in plan.trainer_positions]
        run.trainer_nodes = [slot.node_ip for slot in trainer_slots]
        run._trainers = start_trainers(cfg, run.hf_dir, run.placement, trainer_slots, plan, network, run.api_key)
        run.engine_hosts.wait_healthy()
        run.engines = list(run.engine_hosts.clients)
        if colocated and not engines_first:
            release_engine_caches(run.engines)
        run.trainers.connect_engines(run.engine_hosts.addresses)
        # a LoRA run's requests name the adapter of the version the engines hold, which each sync moves on
        adapter = PolicyAdapter() if cfg.lora is not None else None
        run._hand_over = (ColocatedHandOver if colocated else HandOver)(run.engines, run.trainers, adapter)
        recovery = EngineRecovery(
            run.engine_hosts, run.trainers, run.hand_over, max_restarts=cfg.rollout.max_engine_restarts
        )
        # With max_staleness > 0 the training rollout runs beside training, which a re-sync cannot join:
        # restarted engines wait for the next sync, the others take their requests.
        run.deferred_recovery = DeferredEngineRecovery(recovery) if cfg.train.max_staleness else None
        served = served_reward(cfg, run.judge)
        run._rollout = build_rollout_manager(
            cfg, data, run.engines, run.deferred_recovery or recovery, run.episode, served, adapter
        )
        run.validation = build_validation_sets(
            cfg, data, run.engines, recover=recovery, episode=run.episode, served_reward=served, adapter=adapter
        )
        run._logger = build_metric_logger(
            cfg.logging, log_dir=cfg.log_dir, run_name=cfg.name, total_steps=cfg.train.steps, resume_step=resume_step
        )
    except BaseException:
        run.close()
        raise
    return run


def served_reward(cfg: RunConfig, judge: JudgeEngines | None) -> ServedReward | None:
    """The reward the workers get served: the reward server's (``data.reward: remote``), the judge engines'
    (``judge``, waiting until they are healthy), else None (a reward function the workers look up)."""
    if cfg.data.reward == REMOTE_REWARD:
        assert cfg.data.remote_reward is not None, "validation requires data.remote_reward with data.reward: remote"
        return RemoteReward(cfg.data.remote_reward)
    if cfg.data.reward == JUDGE_REWARD:
        assert judge is not None, "start_judge_engines starts the judge of data.reward: judge"
        return judge.reward()
    return None


def engines_hand_over_memory(cfg: RunConfig) -> bool:
    """Whether engines release and resume memory around training: colocated ones, except SGLang on CPU.

    SGLang 0.5.23's release synchronises a CUDA device and so kills its scheduler on CPU, where
    trainer and engines share host memory and there is nothing to hand over.
    """
    return cfg.rollout.placement == "colocated" and not cfg.sglang_on_cpu


def initial_weights(cfg: RunConfig, tokenizer: transformers.PreTrainedTokenizerBase) -> Path:
    """``model.path``, or ``<run_dir>/initial_hf`` written once from ``model.random_init`` (seed ``train.seed``).

    The written config takes its bos/eos/pad ids from the tokenizer, so engines stop at its ``<eos>``.
    """
    if cfg.model.random_init is None:
        assert cfg.model.path is not None, "the schema asks for model.path or model.random_init"
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


def prepare_rollout_weights(cfg: RunConfig, hf_dir: Path) -> Path:
    """The checkpoint the engines start from: ``hf_dir``, or with FP8 rollouts ``cfg.rollout_fp8_dir``, converted
    once from ``hf_dir`` when it is not there yet (an interrupted conversion leaves only its partial directory,
    redone next time)."""
    if cfg.rollout_fp8_dir is None:
        return hf_dir
    target = Path(cfg.rollout_fp8_dir)
    if not (target / "config.json").is_file():
        print(f"# FP8 rollouts: converting {hf_dir} into {target} (blocks of {list(cfg.rollout.fp8_block)})")
        convert_hf_to_fp8(hf_dir, target, cfg.rollout.fp8_block)
    return target


@contextlib.contextmanager
def _ray_on_loopback() -> Iterator[None]:
    """Let Ray take 127.0.0.1 as its node address while the block runs.

    Ray 2.60 replaces a node address of 127.0.0.1 by the machine's outward address unless its
    cluster mode is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read into
    ``ray._private.ray_constants`` at import); with 127.0.0.1 kept, its GCS, raylet, agents and
    workers listen on 127.0.0.1 only (measured), where they otherwise listen on every interface.
    """
    from ray._private import ray_constants

    variable = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    saved_env, saved_flag = os.environ.get(variable), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[variable], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved_env


def start_ray(cfg: RunConfig, network: RunNetwork | None = None) -> None:
    """Join the cluster at ``RAY_ADDRESS`` or start a local Ray with this machine's CPUs and the recipe's GPUs.

    A local Ray runs on the run's network: 127.0.0.1 for a one-node run (every Ray process
    listening there only), else the address of the recipe's interface; no dashboard. A cluster
    at ``RAY_ADDRESS`` was started by someone else (``slurm/ray_cluster.sh`` starts it on the
    recipe's interface). Ray workers import this package from the same location as the driver
    (``PYTHONPATH``). The driver's SIGTERM and SIGUSR1 handlers are the same after as before
    (``ray.init`` would take SIGTERM, :func:`handlers_kept_through_ray_init`).
    """
    with handlers_kept_through_ray_init():
        _init_ray(cfg, network or RunNetwork.of_run(cfg))


@contextlib.contextmanager
def _python_path(python_path: str) -> Iterator[None]:
    """Set ``PYTHONPATH`` in this process's environment while the block runs (restored after)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = python_path
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved


def _init_ray(cfg: RunConfig, network: RunNetwork) -> None:
    package_root = str(Path(megatron_rl.__file__).resolve().parents[1])
    python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env={"env_vars": {"PYTHONPATH": python_path}}, log_to_driver=False)
        return
    judge = plan_judge_placement(cfg)
    judge_cpus = math.ceil(judge.num_bundles * judge.bundle.num_cpus) if judge and cfg.cluster.gpus_per_node == 0 else 0
    start = functools.partial(
        ray.init,
        address="local",  # a Ray of its own, never the last `ray start` cluster of the machine (/tmp/ray)
        num_cpus=(os.cpu_count() or 1) + judge_cpus,  # CPU bundles are scheduling tokens: the judge's come on top
        num_gpus=cfg.job_nodes * cfg.cluster.gpus_per_node,
        include_dashboard=False,
        log_to_driver=False,
    )
    # A local Ray's workers inherit PYTHONPATH from the raylet ray.init starts, so the job needs no runtime_env:
    # with one, the workers Ray starts ahead at init do not match it and every actor waits for a new worker
    # (measured: 3 actors 0.8 s instead of 1.8 s after ray.init).
    with _python_path(python_path):
        if network.is_loopback:
            with _ray_on_loopback():
                start(_node_ip_address=LOOPBACK_ADDRESS)
        else:
            start(_node_ip_address=network.address())


def feeders_of_engines(cfg: RunConfig, plan: RunPlacementPlan) -> list[tuple[int, ...]] | None:
    """Each engine's feeding trainer ranks in TP-rank order when weights go by device (colocated, tensor
    transport: :func:`~megatron_rl.weight_sync.engine_feeds.engine_feeders`), else None."""
    if cfg.rollout.placement != "colocated" or cfg.weight_sync.resolved(cfg.rollout.placement) != "tensor":
        return None
    return engine_feeders(len(plan.trainer_positions), [cfg.engine_tp_ranks] * len(plan.engine_positions))


def engine_rank_nodes(engine_slots: list[RankSlot], nnodes: int, tp_size: int) -> list[str]:
    """The node IP of each TP rank ``0 .. tp_size-1`` of an engine on ``engine_slots`` spanning ``nnodes`` nodes.

    The engine runs one process per node of its bundles, in
    :func:`~megatron_rl.orchestration.placement_group.engine_node_slots` order (their node ranks), and SGLang
    gives node ``k`` the TP ranks ``k * tp_size / nnodes ..``; an engine on one node holds them all there.
    """
    nodes = engine_node_slots(engine_slots, nnodes)
    return [nodes[tp_rank * len(nodes) // tp_size][0].node_ip for tp_rank in range(tp_size)]


def check_engines_beside_feeders(slots: list[RankSlot], plan: RunPlacementPlan, feeders: list[tuple[int, ...]]) -> None:
    """Raise PlacementError when Ray put an engine's TP rank on another node than the trainer rank that feeds it
    (``feeders[e][t]`` feeds TP rank ``t`` of engine ``e``)."""
    for engine, (positions, ranks) in enumerate(zip(plan.engine_positions, feeders, strict=True)):
        engine_ips = engine_rank_nodes([slots[position] for position in positions], plan.engine_nodes, len(ranks))
        apart = []
        for tp_rank, (rank, engine_ip) in enumerate(zip(ranks, engine_ips, strict=True)):
            trainer_ip = slots[plan.trainer_positions[rank]].node_ip
            if trainer_ip != engine_ip:
                apart.append(f"TP rank {tp_rank} on {engine_ip}, fed by trainer rank {rank} on {trainer_ip}")
        if apart:
            raise PlacementError(
                f"Ray placed engine {engine}'s ranks on other nodes than the trainer ranks that feed them their "
                f"weights ({'; '.join(apart)}); the tensor transport needs each beside its feeder: give every node "
                "the same free CPUs (or GPUs), or use weight_sync.transport=disk"
            )


def _routed_experts_shape(cfg: RunConfig, hf_dir: Path) -> tuple[int, int] | None:
    if not cfg.algorithm.routing_replay:
        return None
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    return config.num_hidden_layers, config.num_experts_per_tok


def engine_specs(
    cfg: RunConfig,
    hf_dir: Path,
    slots: list[RankSlot],
    plan: RunPlacementPlan,
    network: RunNetwork,
    api_key: str | None = None,
) -> tuple[list[list[EngineSpec]], list[list[int]]]:
    """Per ``plan.engine_positions`` entry, the spec of each node's process (one per node it spans, in node-rank
    order) and the first bundle of each of its nodes, where that node's host goes.

    The engines load ``hf_dir`` and log into ``cfg.log_dir``, both resolved here against the driver's working
    directory: a host on another node has its own.
    """
    specs: list[list[EngineSpec]] = []
    host_bundles: list[list[int]] = []
    routed_experts_shape = _routed_experts_shape(cfg, hf_dir)
    nnodes = plan.engine_nodes
    for index, positions in enumerate(plan.engine_positions):
        nodes = engine_node_slots([slots[position] for position in positions], nnodes)
        spec = EngineSpec(
            name=f"{cfg.rollout.engine}{index}",
            kind=cfg.rollout.engine,
            model_path=str(hf_dir.resolve()),
            log_dir=str(Path(cfg.log_dir).resolve()),
            rollout=cfg.rollout,
            seed=cfg.train.seed + index,
            routing_replay=cfg.algorithm.routing_replay,
            routed_experts_shape=routed_experts_shape,
            network=network,
            api_key=api_key,
            nnodes=nnodes,
            lora=cfg.lora,
        )
        gpus = [engine_gpu_ids(node) if cfg.cluster.gpus_per_node else () for node in nodes]
        specs.append([replace(spec, node_rank=rank, gpu_ids=ids) for rank, ids in enumerate(gpus)])
        host_bundles.append([node[0].bundle_index for node in nodes])
    return specs, host_bundles


def start_engines(
    cfg: RunConfig,
    hf_dir: Path,
    placement: PlacementGroup,
    slots: list[RankSlot],
    plan: RunPlacementPlan,
    network: RunNetwork | None = None,
    api_key: str | None = None,
) -> EngineHosts:
    """One engine per ``plan.engine_positions`` entry (:func:`engine_specs`), on the GPUs of its bundles, loading
    ``hf_dir``; starting on return (:meth:`~megatron_rl.orchestration.engine_host.EngineHosts.wait_healthy` waits
    for them). An engine whose bundles span ``plan.engine_nodes`` nodes runs one process per node.

    Each listens on its node's address in ``network`` and requires ``api_key``.
    """
    specs, host_bundles = engine_specs(cfg, hf_dir, slots, plan, network or RunNetwork.of_run(cfg), api_key)
    return EngineHosts(specs, placement, host_bundles, plan.engine_host)


def start_trainers(
    cfg: RunConfig,
    hf_dir: Path,
    placement: PlacementGroup,
    slots: list[RankSlot],
    plan: RunPlacementPlan,
    network: RunNetwork | None = None,
    api_key: str | None = None,
) -> TrainerGroup:
    """One Ray actor per trainer rank on ``slots`` (with the plan's share of each bundle), actors built.

    The ranks' stores and gloo/NCCL sockets stay on ``network``; they send ``api_key`` to the engines, which
    :meth:`~megatron_rl.orchestration.trainer_group.TrainerGroup.connect_engines` names.
    """
    on_cpu = cfg.cluster.gpus_per_node == 0
    ranks = RankWorkerGroup(
        WorkerSpec(TrainerWorker, cfg, RankPaths.of(cfg, hf_dir), api_key),
        placement,
        slots,
        num_gpus=plan.trainer.num_gpus,
        num_cpus=plan.trainer.num_cpus,
        env={"OMP_NUM_THREADS": "1"} if on_cpu else None,
        network=network or RunNetwork.of_run(cfg),
    )
    return TrainerGroup(ranks)


def build_rollout_manager(
    cfg: RunConfig,
    data: PreparedData,
    engines: list[RolloutEngine],
    recover: Recovery | None = None,
    episode: Episode | None = None,
    served: ServedReward | None = None,
    adapter: PolicyAdapter | None = None,
) -> RolloutManager:
    """The training rollout: ``dynamic_sampling.gen_batch_prompts`` (default ``prompts_per_step``) prompts per
    generation batch, sampler seeded by ``train.seed``; ``recover`` restarts crashed engines; ``episode`` (from
    :func:`~megatron_rl.rollout.episodes.build_episode`; None: single-turn) is not closed by the manager;
    ``served``: the served reward (:func:`served_reward`); ``adapter``: a LoRA run's, named by every request."""
    batch = cfg.algorithm.dynamic_sampling.gen_batch_prompts or cfg.train.prompts_per_step
    sampler = PromptSampler(len(data.train), batch, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    pool = EnginePool(engines, cfg.rollout.max_concurrent_requests, recover)
    planner = SubmissionPlanner(
        data.train,
        sampler,
        cfg.rollout,
        pool.next_engine,
        uid_prefix="g",
        seed=cfg.train.seed,
        routing_replay=cfg.algorithm.routing_replay,
        stop_token_ids=episode.stop_token_ids if episode is not None else (),
        adapter=adapter,
    )
    assembler = GroupAssembler(
        cfg.algorithm.overlong,
        cfg.algorithm.dynamic_sampling,
        cfg.rollout.max_response_length,
        reward=cfg.data.reward,
        reward_num_workers=cfg.data.reward_num_workers,
        reward_timeout_s=cfg.data.reward_timeout_s,
        decode=data.decode,
        served_reward=served,
    )
    policy = StepPolicy(cfg.train.prompts_per_step, cfg.algorithm.dynamic_sampling, max_token_lag(cfg))
    return RolloutManager(pool, planner, assembler, policy, episode)


def max_token_lag(cfg: RunConfig) -> int:
    """How many weight versions a trained token may lag behind the policy that trains on it:
    ``train.max_staleness``, plus ``partial_rollout_max_windows - 1`` with partial rollouts (a response
    continued over that many more steps' generations)."""
    windows = cfg.rollout.partial_rollout_max_windows - 1 if cfg.rollout.partial_rollout_tokens else 0
    return cfg.train.max_staleness + windows
