"""Preflight's steps on the allocation: every trainer GPU and the network, the trainer at the recipe's layout, the
engines with a checked weight sync. They share one Ray placement, as a run does, and :meth:`close` releases it.

The trainer and engines run the recipe's model cut to a few layers (:mod:`megatron_rl.preflight.cut_model`) at the
recipe's own layout; everything they write goes under ``runs/<name>/preflight/``.
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_rl.actor.step_data import StepData, expert_index_dtype
from megatron_rl.config import RunConfig, load_recipe, read_architecture, trainer_layout
from megatron_rl.data.preparation import prepare_data
from megatron_rl.engines.access import new_api_key
from megatron_rl.engines.engine import EngineError, RolloutEngine
from megatron_rl.orchestration.batch_assembly import assemble_step_data, group_advantages, trim_to_even_split
from megatron_rl.orchestration.judge_engines import start_judge_engines
from megatron_rl.orchestration.memory_handover import ColocatedHandOver, HandOver, release_engine_caches
from megatron_rl.orchestration.network import NetworkError, RunNetwork
from megatron_rl.orchestration.placement_group import RankSlot, create_rank_slots
from megatron_rl.orchestration.resources import (
    RunResources,
    build_rollout_manager,
    engines_hand_over_memory,
    initial_weights,
    prepare_rollout_weights,
    served_reward,
    start_engines,
    start_ray,
    start_trainers,
)
from megatron_rl.orchestration.worker_group import RankWorkerGroup, WorkerSpec
from megatron_rl.plan.memory import stage_plan
from megatron_rl.plan.param_count import synced_model_bytes
from megatron_rl.plan.placement import RunPlacementPlan, plan_run_placement
from megatron_rl.plan.rates import Rate
from megatron_rl.preflight.cut_model import cut_model
from megatron_rl.preflight.device_probe import DeviceProbe
from megatron_rl.preflight.report import StepFailure, StepOutcome
from megatron_rl.rollout.episodes import build_episode

PREFLIGHT_RESPONSE_TOKENS = 64
"""Longest response the engines step generates: enough to compare log-probs on, short enough for minutes."""
SLOW_GPU_FRACTION = 0.5
"""A GPU whose GEMM rate is below this fraction of the median GPU's is named as slow."""


def random_step_data(vocab_size: int, num_sequences: int, seq_length: int, mini_batches: int = 1) -> StepData:
    """``num_sequences`` samples of random tokens, ``seq_length`` down to half that long, 2 prompt tokens each,
    advantages from -1 to 1, in ``mini_batches`` equal mini-batches (it must divide ``num_sequences``); seeded, so
    every call returns the same data."""
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
        mini_batch_sizes=(num_sequences // mini_batches,) * mini_batches,
    )


def _bandwidths(per_rank: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (group, collective): the slowest rank's bus bandwidth and whether any of its groups spans nodes."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for entries in per_rank:
        for entry in entries:
            key = (entry["group"], entry["collective"])
            seen = merged.setdefault(key, dict(entry))
            if entry["bus_gbps"] < seen["bus_gbps"]:
                seen |= {"bus_gbps": entry["bus_gbps"], "where": entry["where"]}
            seen["spans_nodes"] = seen["spans_nodes"] or entry["spans_nodes"]
    return list(merged.values())


def _gemm_faults(gemms: Sequence[dict[str, Any]]) -> list[str]:
    """Ranks whose GEMM was wrong (beyond the error bound) or slow (below :data:`SLOW_GPU_FRACTION` of the median)."""
    median = statistics.median(g["tflops"] for g in gemms)
    faults = [f"{g['where']}: GEMM off by {g['max_error_ratio']:.3g}x its error bound" for g in gemms if not g["ok"]]
    faults += [
        f"{g['where']}: {g['tflops']:.1f} TFLOP/s, below {SLOW_GPU_FRACTION:.0%} of the median {median:.1f}"
        for g in gemms
        if g["tflops"] < SLOW_GPU_FRACTION * median
    ]
    return faults


def weight_checksums(engine: RolloutEngine) -> dict[str, str]:
    """``engine``'s checksum of every weight, keyed ``<tp rank>/<name>`` (SGLang's ``/weights_checker`` checksum: a
    hash of each tensor's bytes, on each TP rank)."""
    ranks = engine.check_weights("checksum")["ranks"]
    return {f"{rank}/{name}": value for rank, entry in enumerate(ranks) for name, value in entry["checksums"].items()}


class ClusterSteps:
    """The devices, trainer and engines steps of one preflight run, in that order, on one placement.

    Args:
        recipe, overrides: what the user ran; reloaded with the cut model's overrides for the trainer and engines.
        cfg: the recipe loaded.
        work_dir: ``runs/<name>/preflight``: the cut model, and the run folder of its trainer and engines.
    """

    def __init__(self, recipe: str, overrides: Sequence[str], cfg: RunConfig, work_dir: Path) -> None:
        self.recipe, self.overrides, self.work_dir = recipe, list(overrides), work_dir
        # The run's own folders (runs/<name>) stay untouched: initial weights, data and logs go under work_dir.
        self.cfg = self._reload(cfg, [f"name={cfg.name}/preflight"])
        self.run: RunResources | None = None
        self.slots: list[RankSlot] = []
        self.offloaded = False
        self.trained_dir = work_dir / "trained_hf"
        """The trainer's weights after its PPO step, as a Hugging Face checkpoint the engines load."""

    def _reload(self, cfg: RunConfig, extra: Sequence[str]) -> RunConfig:
        overrides = [*self.overrides, f"checkpoint.dir={cfg.checkpoint_dir}", *extra]
        loaded, _ = load_recipe(self.recipe, overrides, require_files=False)
        return loaded

    @property
    def _run(self) -> RunResources:
        assert self.run is not None, "the devices step starts the placement the later steps use"
        return self.run

    def _trainer_slots(self) -> list[RankSlot]:
        plan = plan_run_placement(self.cfg)
        return [self.slots[position] for position in plan.trainer_positions]

    def devices(self) -> StepOutcome:
        """A GEMM on every trainer rank's device (and a disaggregated engine's), checked and timed, then collectives on
        the recipe's groups."""
        cfg = self.cfg
        network = RunNetwork.of_run(cfg)
        try:
            network.address()
        except NetworkError as error:
            raise StepFailure(
                str(error), "cluster.network_interface: an interface every node has (`ip -brief address`)"
            ) from error
        start_ray(cfg, network)
        plan = plan_run_placement(cfg)
        # Data and weights come with the trainer step; until then the resources hold the placement, which close()
        # releases with Ray whatever step failed.
        self.run = RunResources(cfg, data=None, hf_dir=Path(), network=network, api_key=new_api_key())  # type: ignore[arg-type]
        self.run.placement, self.slots = create_rank_slots(
            plan.num_bundles,
            num_gpus=plan.bundle.num_gpus,
            num_cpus=plan.bundle.num_cpus,
            name=cfg.name,
            on_this_node=network.is_loopback,
        )
        probes = self._probes(self._trainer_slots(), joins_groups=True)
        try:
            gemms = probes.call(DeviceProbe.gemm)
            engine_gemms = self._engine_gemms(plan)
            faults = _gemm_faults([*gemms, *engine_gemms])
            if faults:
                raise StepFailure(
                    "; ".join(faults), "leave the named node out of the allocation (sbatch --exclude=HOST)"
                )
            bandwidths = _bandwidths(probes.call(DeviceProbe.collectives))
            probes.call(DeviceProbe.close)
        finally:
            probes.shutdown()
        return self._devices_outcome(network, gemms, engine_gemms, bandwidths)

    def _probes(self, slots: list[RankSlot], *, joins_groups: bool) -> RankWorkerGroup[DeviceProbe]:
        """A :class:`DeviceProbe` on each of ``slots``, with a trainer rank's share of its bundle."""
        cfg, run = self.cfg, self._run
        plan = plan_run_placement(cfg)
        assert run.placement is not None
        return RankWorkerGroup(
            WorkerSpec(DeviceProbe, cfg, joins_groups=joins_groups),
            run.placement,
            slots,
            num_gpus=plan.trainer.num_gpus,
            num_cpus=plan.trainer.num_cpus,
            env={"OMP_NUM_THREADS": "1"} if cfg.cluster.gpus_per_node == 0 else None,
            network=run.network,
        )

    def _engine_gemms(self, plan: RunPlacementPlan) -> list[dict[str, Any]]:
        """The GEMM on every engine GPU of a disaggregated layout (colocated engines share the trainer's GPUs)."""
        if self.cfg.rollout.placement != "disaggregated":
            return []
        slots = [self.slots[position] for positions in plan.engine_positions for position in positions]
        probes = self._probes(slots, joins_groups=False)
        try:
            return probes.call(DeviceProbe.gemm)
        finally:
            probes.shutdown()

    def _devices_outcome(
        self,
        network: RunNetwork,
        gemms: list[dict[str, Any]],
        engine_gemms: list[dict[str, Any]],
        bandwidths: list[dict[str, Any]],
    ) -> StepOutcome:
        slowest = min(gemms, key=lambda g: g["tflops"])  # the trainer's: the rate plan's MFUs are fractions of
        lines = [f"network: {network.describe()}"]
        lines += [
            f"{g['where']} {g['device_name']}: {g['size']}^2 {g['dtype']} GEMM {g['tflops']:.2f} TFLOP/s, "
            f"error {g['max_error_ratio']:.2g} of its bound"
            for g in [*gemms, *engine_gemms]
        ]
        lines += [
            f"{b['collective']} over {b['group']} groups of {b['size']}"
            f"{' across nodes' if b['spans_nodes'] else ' within a node'}: {b['bus_gbps']:.2f} GB/s bus "
            f"(slowest: {b['where']})"
            for b in bandwidths
        ]
        source = f"{slowest['device_name']}, {slowest['dtype']}, {slowest['where']}"
        rates = {"gemm_tflops": Rate(slowest["tflops"], "TFLOP/s", source)}
        within = [b for b in bandwidths if b["collective"] == "all-gather" and not b["spans_nodes"]]
        if within:
            low = min(within, key=lambda b: b["bus_gbps"])
            rates["intra_node_gbps"] = Rate(low["bus_gbps"], "GB/s", f"all-gather over {low['group']} groups")
        across = [b for b in bandwidths if b["collective"] == "broadcast" and b["spans_nodes"]]
        if across:
            rates["inter_node_gbps"] = Rate(across[0]["bus_gbps"], "GB/s", "broadcast from rank 0 to every rank")
        figures = {"ranks": len(gemms), "slowest_gemm_tflops": round(slowest["tflops"], 3)}
        return StepOutcome(lines, figures, rates)

    @staticmethod
    def _short_rollout(cfg: RunConfig) -> list[str]:
        """Overrides for the engines step: one generated step of one group per DP rank and mini-batch, responses of at
        most :data:`PREFLIGHT_RESPONSE_TOKENS`, nothing filtered (a cut model's rewards are all alike, so dynamic
        sampling would never fill a step), no validation; FP8 engines convert the trainer's export."""
        dp = trainer_layout(cfg.parallel, cfg.cluster, cfg.rollout).dp
        return [
            f"train.prompts_per_step={dp * cfg.train.mini_batches_per_step}",
            f"rollout.max_response_length={min(cfg.rollout.max_response_length, PREFLIGHT_RESPONSE_TOKENS)}",
            "algorithm.preset=custom",  # a preset fixes dynamic sampling and overlong shaping on
            "algorithm.dynamic_sampling.enable=false",
            "algorithm.overlong.enable=false",
            "validation.interval=0",
            # FP8 engines start from the trainer's export converted here, not from the recipe's FP8 checkpoint
            *(["rollout.fp8_checkpoint=null"] if cfg.rollout.quantization == "fp8" else []),
        ]

    def trainer(self) -> StepOutcome:
        """The trainer ranks at the recipe's layout on the cut model: built, one PPO step, offload and reload, and
        the measured memory (GPU) against the plan's figure for the same cut."""
        run = self._run
        arch = read_architecture(self.cfg.model.path, self.cfg.model.random_init, self.cfg.model.config_fallback)
        cut = cut_model(self.cfg, arch.num_layers, self.work_dir)
        full = self.cfg
        self.cfg = run.cfg = self._reload(full, [f"name={full.name}", *cut.overrides, *self._short_rollout(full)])
        cfg = self.cfg
        arch = read_architecture(cfg.model.path, cfg.model.random_init)
        run.data = prepare_data(
            cfg.data,
            tokenizer_path=cfg.model.tokenizer or cfg.model.path,
            model_vocab_size=arch.vocab_size,
            max_prompt_length=cfg.rollout.max_prompt_length,
            work_dir=f"{cfg.run_dir}/data",
        )
        run.hf_dir = initial_weights(cfg, run.data.tokenizer)
        plan = plan_run_placement(cfg)
        slots = self._trainer_slots()
        assert run.placement is not None
        run.trainer_nodes = [slot.node_ip for slot in slots]
        run._trainers = start_trainers(cfg, run.hf_dir, run.placement, slots, plan, run.network, run.api_key)
        trainers = run.trainers
        dp, mini = trainers.data_parallel_size, cfg.train.mini_batches_per_step
        length = min(
            cfg.rollout.max_prompt_length + cfg.rollout.max_response_length, cfg.train.max_tokens_per_micro_batch
        )
        step = random_step_data(arch.vocab_size, 2 * dp * mini, length, mini)
        metrics, _ = trainers.train_step(step.shard(dp, mini))
        if not math.isfinite(metrics["loss"]):
            raise StepFailure(f"the PPO step's loss is {metrics['loss']}", "train.precision, train.lr")
        trained = trainers.device_memory()
        trainers.offload()
        offloaded = trainers.device_memory()
        trainers.reload()
        lines = [
            f"model cut to {cut.layers} of {cut.of_layers} decoder layers ({', '.join(cut.overrides)})",
            f"{trainers.world_size} ranks built, one PPO step on {2 * dp * mini} sequences of up to {length} tokens: "
            f"loss {metrics['loss']:.4g}, grad norm {metrics.get('grad_norm', float('nan')):.4g}",
            "offloaded and reloaded",
        ]
        figures: dict[str, Any] = {"loss": metrics["loss"], "layers": cut.layers}
        if all(trained):  # CPU ranks measure nothing
            figures |= self._memory_against_plan(arch, trained, offloaded, lines)
        else:
            lines.append("device memory: not measured (CPU ranks)")
        # What the engines start from, so their checksums of what they loaded are the ones a sync must reproduce.
        shutil.rmtree(self.trained_dir, ignore_errors=True)
        trainers.export_hf(self.trained_dir)
        if engines_hand_over_memory(cfg) and cfg.cluster.gpus_per_node > 0:
            trainers.offload()  # colocated engines size their KV cache from the free memory they start with
            self.offloaded = True
        return StepOutcome(lines, figures)

    def _memory_against_plan(
        self, arch: Any, trained: list[dict[str, int]], offloaded: list[dict[str, int]], lines: list[str]
    ) -> dict[str, Any]:
        """The peak of every rank against the plan's total for its stage; StepFailure when a rank went above."""
        cfg, per_stage = self.cfg, self.cfg.parallel.pp
        reserves = 2 if cfg.rollout.placement == "colocated" else 1
        plans = [stage_plan(arch, cfg, stage, reserves) for stage in range(per_stage)]
        ranks_per_stage = len(trained) // per_stage
        over = []
        for rank, memory in enumerate(trained):
            planned = plans[rank // ranks_per_stage].total  # pipeline stage is the slowest-varying rank coordinate
            if memory["peak"] > planned:
                over.append(f"rank {rank}: peak {memory['peak'] / 2**30:.2f} GiB > plan {planned / 2**30:.2f} GiB")
        peak = max(m["peak"] for m in trained)
        left = max(m["allocated"] for m in offloaded)
        lines.append(f"device memory: peak {peak / 2**30:.2f} GiB; {left / 2**30:.2f} GiB left while offloaded")
        if over:
            raise StepFailure(
                "measured memory above `megatron-rl plan`'s figure: " + "; ".join(over),
                "train.max_tokens_per_micro_batch or train.recompute (and report the plan's miss)",
            )
        return {"peak_gib": round(peak / 2**30, 3), "offloaded_gib": round(left / 2**30, 3)}

    def engines(self) -> StepOutcome:
        """The engines at the recipe's engine layout, started from the trainer's weights as exported after its step:
        each engine's checksums of what it loaded, then its weights reset, synced through the recipe's transport
        and checked against those checksums (SGLang's ``/weights_checker``); then one step generated and trained
        on, for the trainer-vs-engine log-prob gap."""
        run, cfg = self._run, self.cfg
        plan = plan_run_placement(cfg)
        assert run.placement is not None
        weights = prepare_rollout_weights(cfg, self.trained_dir)
        run.judge = start_judge_engines(cfg, run.network, run.api_key)  # on their own bundles, starting meanwhile
        run.engine_hosts = start_engines(cfg, weights, run.placement, self.slots, plan, run.network, run.api_key)
        try:
            run.engine_hosts.wait_healthy()
        except Exception as error:
            raise StepFailure(
                f"an engine did not start: {error}", "rollout.engine, rollout.tp / ep / mem_fraction (engine log above)"
            ) from error
        engines = run.engines = list(run.engine_hosts.clients)
        if engines_hand_over_memory(cfg):
            release_engine_caches(engines)
        if self.offloaded:
            run.trainers.reload()
        run.trainers.connect_engines(run.engine_hosts.addresses)
        hand_over = (ColocatedHandOver if engines_hand_over_memory(cfg) else HandOver)(engines, run.trainers)
        fp8 = cfg.rollout.quantization == "fp8"
        loaded = [weight_checksums(engine) for engine in engines]
        for engine in engines:
            if fp8:  # the compare that tolerates FP8 rounding needs it
                engine.check_weights("snapshot")
            engine.check_weights("reset_tensors")  # so a tensor the sync leaves out cannot stay equal
        started = time.perf_counter()
        hand_over.sync_weights(1)
        seconds = time.perf_counter() - started
        within_rounding = self._check_synced(engines, loaded, fp8)
        arch = read_architecture(cfg.model.path, cfg.model.random_init)
        nbytes = synced_model_bytes(arch, cfg.rollout.fp8_block if fp8 else None)
        transport = cfg.weight_sync.resolved(cfg.rollout.placement)
        lines = [
            f"{len(engines)} {cfg.rollout.engine} engine(s) at {', '.join(f'{h}:{p}' for _, h, p in run.engine_hosts.addresses)}",
            f"weight sync ({transport}): {nbytes / 1e6:.1f} MB in {seconds:.2f} s; every engine's weights equal "
            f"the trainer's export{' within FP8 rounding' if within_rounding else ' bit for bit'} (/weights_checker: "
            "checksums of every tensor as loaded from it, then reset, synced)",
        ]
        figures: dict[str, Any] = {"sync_seconds": round(seconds, 3), "synced_mb": round(nbytes / 1e6, 1)}
        figures |= self._generate_and_train(hand_over, lines)
        rate = Rate(nbytes / seconds / 1e9, "GB/s", f"{transport} sync of the {nbytes / 1e6:.3g} MB cut model")
        return StepOutcome(lines, figures, {"sync_gbps": rate})

    def _check_synced(self, engines: Sequence[RolloutEngine], loaded: list[dict[str, str]], fp8: bool) -> bool:
        """StepFailure naming each engine's tensors whose checksum after the sync differs from the one the engine
        computed on the trainer's export it loaded. With FP8 rollouts, differing tensors are compared once more allowing
        one FP8 rounding step (the trainer quantises bf16 weights itself); True when that was needed."""
        cfg = self.cfg
        differing = {}
        for engine, before in zip(engines, loaded, strict=True):
            after = weight_checksums(engine)
            names = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
            if names:
                differing[engine] = names
        if not differing:
            return False
        if fp8:
            try:
                for engine in differing:
                    engine.check_weights("compare", allow_quant_error=True)
                return True
            except EngineError as error:
                cause = str(error)
        else:
            cause = "; ".join(
                f"{engine.name}: {len(names)} tensor(s) differ after the sync from the trainer's weights it loaded: {', '.join(names[:8])}"
                + (" ..." if len(names) > 8 else "")
                for engine, names in differing.items()
            )
        transport = cfg.weight_sync.resolved(cfg.rollout.placement)
        raise StepFailure(cause, f"weight_sync.transport ({transport}): a sync bug; report it with this report.json")

    def _generate_and_train(self, hand_over: HandOver, lines: list[str]) -> dict[str, Any]:
        """One step's rollout from the synced engines, scored as the run scores (by the judge's engines, with
        ``data.reward: judge``), and a PPO step on it: the log-prob gap between them."""
        run, cfg = self._run, self.cfg
        run.episode = build_episode(cfg.rollout, run.data.tokenizer)
        try:
            served = served_reward(cfg, run.judge)
        except EngineError as error:
            raise StepFailure(
                f"a judge engine did not start: {error}", "judge.model, judge.engine, judge.tp (judge engine log above)"
            ) from error
        manager = build_rollout_manager(cfg, run.data, run.engines, None, run.episode, served)
        try:
            hand_over.to_rollout()
            rollout = manager.generate_step(1)
        finally:
            manager.close()
        hand_over.to_training()
        unit = cfg.train.mini_batches_per_step * run.trainers.data_parallel_size
        groups = trim_to_even_split(rollout.groups, unit)
        if not groups:
            lines.append(f"generated {len(rollout.groups)} groups, fewer than one per DP rank: no gap measured")
            return {}
        algorithm = cfg.algorithm
        advantages = group_advantages(
            groups, estimator=algorithm.advantage_estimator, norm_by_std=algorithm.norm_adv_by_std
        )
        experts = read_architecture(cfg.model.path, cfg.model.random_init).num_experts
        step = assemble_step_data(groups, advantages, expert_dtype=expert_index_dtype(max(1, experts)))
        metrics, _ = run.trainers.train_step(
            step.shard(run.trainers.data_parallel_size, cfg.train.mini_batches_per_step)
        )
        gap: dict[str, Any] = {
            key: metrics[key] for key in ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_kl") if key in metrics
        }
        lines.append(
            f"generated {sum(len(g.samples) for g in groups)} responses; trainer vs engine log-probs on them: "
            + ", ".join(f"{key} {value:.3g}" for key, value in gap.items())
        )
        if run.judge is not None:
            judged = sum(len(g.samples) for g in rollout.groups)
            errors = rollout.metrics.get("rollout/reward_errors", 0.0)
            lines.append(
                f"judge: {len(run.judge.hosts.addresses)} engine(s) of {cfg.judge and cfg.judge.model} scored "
                f"{judged} responses, {errors:g} without a verdict (rollout/reward_errors)"
            )
        return gap

    def close(self) -> None:
        """Release trainer ranks, engines, the placement and a local Ray."""
        if self.run is not None:
            self.run.close()
