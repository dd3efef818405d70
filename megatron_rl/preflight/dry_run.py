"""``megatron-rl preflight --dry-run``: the steps a recipe's preflight would run, and where each runs.

Nothing is started: the placement comes from the planner (:func:`~megatron_rl.plan.placement.plan_run_placement`),
the process groups from Megatron's own rank generator with the order the trainer initialises
(``tp-cp-ep-dp-pp``), so the groups listed are the ones the devices step times.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_rl.config import RunConfig, engine_layout, read_architecture, trainer_layout
from megatron_rl.plan.placement import plan_run_placement
from megatron_rl.preflight.cut_model import cut_depth
from megatron_rl.preflight.report import STEP_NAMES

GROUP_ORDER = "tp-cp-ep-dp-pp"
"""Megatron's default rank order, the one :func:`~megatron_rl.parallel.distributed.initialize_parallel` uses."""


def process_groups(cfg: RunConfig) -> dict[str, list[list[int]]]:
    """The trainer's TP, CP, DP, PP and EP groups of size > 1, as lists of global ranks (Megatron's RankGenerator)."""
    from megatron.core.parallel_state import RankGenerator

    par = cfg.parallel
    layout = trainer_layout(par, cfg.cluster, cfg.rollout)
    dense = RankGenerator(tp=par.tp, ep=1, dp=layout.dp, pp=par.pp, cp=par.cp, order=GROUP_ORDER)
    expert = RankGenerator(tp=par.expert_tp, ep=par.ep, dp=layout.expert_dp, pp=par.pp, cp=1, order=GROUP_ORDER)
    groups = {name: dense.get_ranks(name) for name in ("tp", "cp", "dp", "pp")} | {"ep": expert.get_ranks("ep")}
    return {name: ranks for name, ranks in groups.items() if len(ranks[0]) > 1}


def _where(cfg: RunConfig, positions: Sequence[int]) -> str:
    """``node 0 GPUs 0-7, node 1 GPUs 0-3`` for bundle positions (node x gpus_per_node + GPU); CPU bundles by node."""
    per_node = cfg.cluster.gpus_per_node
    if per_node == 0:
        return f"{len(positions)} CPU bundle(s)"
    nodes: dict[int, list[int]] = {}
    for position in positions:
        nodes.setdefault(position // per_node, []).append(position % per_node)
    return ", ".join(f"node {node} GPUs {min(gpus)}-{max(gpus)}" for node, gpus in nodes.items())


def _engines_where(cfg: RunConfig, engine_positions: Sequence[Sequence[int]]) -> str:
    """Where the engines run: each listed when few, else how many per node and on which nodes."""
    if len(engine_positions) <= 4 or cfg.cluster.gpus_per_node == 0:
        return "; ".join(_where(cfg, positions) for positions in engine_positions)
    per_node = cfg.cluster.gpus_per_node
    nodes = sorted({p // per_node for positions in engine_positions for p in positions})
    return f"{len(engine_positions) / len(nodes):g} per node on nodes {nodes[0]}-{nodes[-1]}"


def describe_steps(cfg: RunConfig) -> list[str]:
    """One paragraph per step: what it runs, on which ranks, nodes and GPUs."""
    plan = plan_run_placement(cfg)
    layout = trainer_layout(cfg.parallel, cfg.cluster, cfg.rollout)
    engines = engine_layout(cfg.cluster, cfg.rollout)
    per_node = cfg.cluster.gpus_per_node
    node_of = [position // per_node if per_node else 0 for position in plan.trainer_positions]
    arch = read_architecture(cfg.model.path, cfg.model.random_init, cfg.model.config_fallback)
    transport = cfg.weight_sync.resolved(cfg.rollout.placement)
    groups = []
    for name, ranks in process_groups(cfg).items():
        across = any(len({node_of[r] for r in group}) > 1 for group in ranks)
        groups.append(f"{len(ranks)} {name} group(s) of {len(ranks[0])}{' across nodes' if across else ''}")
    engine_gpus = (
        f" and the engines' {sum(len(p) for p in plan.engine_positions)} {'GPUs' if per_node else 'CPU bundles'}"
        if cfg.rollout.placement == "disaggregated"
        else ""
    )
    model = f"{cfg.model.path}: config, index, shards" if cfg.model.path else "random init (no weights to read)"
    data = ", ".join(str(f) for f in (cfg.data.train_files or [])) or "the synthetic task"
    steps = {
        "install": f"the driver's node: torch, CUDA, pinned versions{', TE FP8' if cfg.train.precision == 'fp8' else ''}"
        f"{', SGLang where the engines run' if cfg.rollout.engine == 'sglang' else ''}",
        "inputs": f"{model}; tokenizer; {data}; reward {cfg.data.reward} on 3 rows",
        "storage": f"256 MB written, read back and checked in {cfg.checkpoint_dir}",
        "devices": f"{layout.world_size} trainer ranks ({_where(cfg, plan.trainer_positions)}){engine_gpus}: a GEMM "
        "each; "
        f"all-reduce, all-gather, all-to-all over {'; '.join(groups) or 'no group larger than 1'}; a broadcast over "
        f"all ranks; network {cfg.cluster.network_interface or 'loopback'}",
        "trainer": f"{arch.num_layers} decoder layers cut to {cut_depth(cfg, arch.num_layers)}; the same "
        f"{layout.world_size} ranks at tp {cfg.parallel.tp} pp {cfg.parallel.pp} cp {cfg.parallel.cp} ep "
        f"{cfg.parallel.ep} etp {cfg.parallel.expert_tp} dp {layout.dp}, {cfg.train.precision}, recompute "
        f"{cfg.train.recompute}: one PPO step, offload, reload, memory against the plan",
        "engines": f"{engines.num_engines} {cfg.rollout.engine} engine(s) of tp {cfg.rollout.tp} ep {cfg.rollout.ep}"
        f"{f' spanning {plan.engine_nodes} nodes' if plan.engine_nodes > 1 else ''} ("
        + _engines_where(cfg, plan.engine_positions)
        + f"), {cfg.rollout.placement}; weight sync by {transport}"
        f"{' in FP8' if cfg.rollout.quantization == 'fp8' else ''}, compared with /weights_checker; one step "
        f"generated ({cfg.train.prompts_per_step} prompts x {cfg.rollout.n_samples_per_prompt}) and trained on",
    }
    assert tuple(steps) == STEP_NAMES
    return [f"{number}. {name}: {text}" for number, (name, text) in enumerate(steps.items(), start=1)]
