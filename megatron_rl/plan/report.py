"""The text report of ``megatron-rl plan``: parameters, memory per GPU, engines, placement, verdict.

Pure formatting of a :class:`~megatron_rl.plan.memory.MemoryPlan`; sizes in GiB (2^30 bytes),
estimates marked ``~``.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_rl.config.hf_config import QwenArchitecture, padded_vocab_size
from megatron_rl.config.layout import judge_layout, trainer_layout
from megatron_rl.config.schema import RunConfig
from megatron_rl.plan.estimates import (
    ASSUMED,
    MEASURED,
    Assumptions,
    SyncEstimate,
    estimate_sync,
    estimate_throughput,
    sync_refusal,
)
from megatron_rl.plan.lora_count import whole_adapter
from megatron_rl.plan.memory import GIB, Amount, EnginePlan, MemoryPlan, StagePlan, stage_layers
from megatron_rl.plan.param_count import model_params


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _billions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 10**8 else f"{count:,}"


def _spans(values: Sequence[int]) -> str:
    """``0-3,6`` for [0, 1, 2, 3, 6]."""
    runs: list[tuple[int, int]] = []  # (first, last) of each run of consecutive values
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs) or "-"


def model_section(cfg: RunConfig, arch: QwenArchitecture) -> list[str]:
    """Model and layout lines."""
    total = model_params(arch)
    moe_layers = sum(arch.moe_layer_pattern)
    par, train = cfg.parallel, cfg.train
    layout = trainer_layout(par, cfg.cluster, cfg.rollout)
    padded = padded_vocab_size(arch.vocab_size, par.tp)
    return [
        f"model: {arch.architecture}, {_billions(total.total)} parameters (dense {_billions(total.dense)}, "
        f"expert {_billions(total.expert)}), {arch.num_layers} layers ({moe_layers} MoE), "
        f"vocab {arch.vocab_size} padded to {padded} at tp {par.tp}, tied embeddings {arch.tie_word_embeddings}",
        f"trainer: {layout.world_size} ranks = tp {par.tp} x pp {par.pp} x vpp {par.vpp or 1} x cp {par.cp} x "
        f"dp {layout.dp}; experts etp {par.expert_tp} x ep {par.ep} x edp {layout.expert_dp}; "
        f"{train.precision}, recompute {train.recompute}, {train.max_tokens_per_micro_batch} tokens per micro-batch",
    ]


def parameter_section(cfg: RunConfig, arch: QwenArchitecture, stages: Sequence[StagePlan]) -> list[str]:
    """Exact parameter counts per rank of each pipeline stage, and the largest."""
    lines = ["", "parameters per rank (exact; every TP/EP rank of a stage holds the same count)"]
    lines.append(f"  {'stage':<6}{'layers':<18}{'dense':>16}{'expert':>16}{'total':>16}")
    for stage in stages:
        layers = _spans(sorted(stage_layers(arch, cfg.parallel, stage.pp_rank)))
        p = stage.params
        lines.append(f"  {stage.pp_rank:<6}{layers:<18}{p.dense:>16,}{p.expert:>16,}{p.total:>16,}")
    largest = max(stages, key=lambda s: s.params.total)
    lines.append(f"  max over ranks: {largest.params.total:,} (stage {largest.pp_rank})")
    return lines


def lora_section(cfg: RunConfig, arch: QwenArchitecture, plan: MemoryPlan) -> list[str]:
    """With ``lora:``: the adapter's size whole and per trainer GPU, the frozen base, the engines' LoRA pool and
    the bytes each sync sends (nothing without ``lora:``)."""
    lora = cfg.lora
    if lora is None:
        return []
    whole, base = whole_adapter(arch, lora).total, model_params(arch).total
    experts = "shared outer A/B" if lora.experts_shared_outer else "per expert"
    per_rank = ", ".join(f"stage {s.pp_rank} {s.adapter.total:,}" for s in plan.stages if s.adapter is not None)
    lines = [
        "",
        f"LoRA (lora:): rank {lora.rank}, alpha {lora.alpha:g}, {', '.join(lora.target_modules)}; experts {experts}",
        f"  adapter: {whole:,} parameters ({whole / base:.2%} of the base's {_billions(base)}); "
        f"per trainer rank: {per_rank}",
        "  base frozen: no gradient, no fp32 main parameter, no Adam state; the distributed optimizer holds the "
        "adapter only; the KL reference is the base with the adapter off (no copy)",
        f"  each weight sync sends the adapter alone: {whole * 2 / 1e6:,.1f} MB ({whole * 2:,} bytes, bf16)",
    ]
    if plan.engine is not None:
        lines.append(
            f"  engine LoRA pool per GPU: {_gib(plan.engine.lora_pool_bytes)} GiB "
            f"({lora.max_loras_per_batch} slot(s), --max-loras-per-batch)"
        )
    return lines


def _amount_rows(stages: Sequence[StagePlan]) -> list[tuple[str, bool, list[Amount | None]]]:
    labels: dict[str, bool] = {}
    for stage in reversed(stages):  # the last stage has every row (the log-prob working set too)
        for amount in (*stage.state, *stage.working):
            labels.setdefault(amount.label, amount.exact)
    rows = []
    for label, exact in labels.items():
        cells = [next((a for a in (*s.state, *s.working) if a.label == label), None) for s in stages]
        rows.append((label, exact, cells))
    return rows


def trainer_memory_section(plan: MemoryPlan) -> list[str]:
    """Peak training memory per GPU, one column per pipeline stage (GiB; ``~`` marks estimates)."""
    header = "".join(f"{'stage ' + str(s.pp_rank):>12}" for s in plan.stages)
    lines = ["", "trainer memory per GPU at the training peak (GiB; ~ estimate)", f"  {'':<58}{header}"]
    for label, exact, cells in _amount_rows(plan.stages):
        mark = " " if exact else "~"
        values = "".join(f"{_gib(c.nbytes) if c else '-':>12}" for c in cells)
        lines.append(f"  {mark} {label:<56}{values}")
    totals = "".join(f"{_gib(s.total):>12}" for s in plan.stages)
    lines.append(f"  {'  total of ' + _gib(plan.gpu_bytes) + ' GiB':<58}{totals}")
    return lines


def engine_section(cfg: RunConfig, arch: QwenArchitecture, engine: EnginePlan, gpu_bytes: float) -> list[str]:
    """Engine weights, KV cache and how much of one generation batch it holds."""
    rollout = cfg.rollout
    dtype = "fp8 GEMM weights" if rollout.quantization == "fp8" else "bf16 weights"
    kv_heads = engine.kv_bytes_per_token // (2 * arch.num_layers * arch.head_dim * 2)
    fit = engine.tokens_fit / engine.tokens_needed if engine.tokens_needed else 0.0
    per_node = cfg.cluster.gpus_per_node
    nodes = f" over {engine.gpus // per_node} nodes, one SGLang process per node" if engine.gpus > per_node else ""
    return [
        "",
        f"engines: {engine.num_engines} x {rollout.engine} tp {rollout.tp} ep {rollout.ep} dp {rollout.dp} "
        f"({engine.gpus} GPUs each{nodes}), {rollout.placement}, {dtype}",
        f"    weights per GPU                 {_gib(engine.weight_bytes):>10} GiB",
        f"    KV cache per GPU                {_gib(engine.kv_pool_bytes):>10} GiB "
        f"= {rollout.mem_fraction} x {_gib(gpu_bytes)} GiB - weights" + (" - LoRA pool" if cfg.lora else ""),
        f"    KV bytes per token per GPU      {engine.kv_bytes_per_token:>10,} "
        f"= 2 (K,V) x {arch.num_layers} layers x {kv_heads} KV head(s) x {arch.head_dim} x 2 B",
        f"    KV tokens per engine            {engine.tokens_fit:>10,} "
        f"({engine.tokens_fit // engine.sequence_tokens} sequences of {engine.sequence_tokens:,} tokens)",
        f"    one generation batch per engine {engine.tokens_needed:>10,} tokens at full length "
        f"-> the KV cache holds {fit:.0%}",
        *_pipeline_lines(cfg),
    ]


def _pipeline_lines(cfg: RunConfig) -> list[str]:
    """What ``train.max_staleness`` > 0 and partial rollouts do to a step (nothing for the synchronous loop)."""
    staleness, window = cfg.train.max_staleness, cfg.rollout.partial_rollout_tokens
    lines = []
    if staleness:
        lines += [
            f"    pipeline: train.max_staleness {staleness}: the engines generate step k+{staleness} "
            "(weights after step k-1) while the trainer trains step k;",
            "              a step takes about max(generation, log-probs + training) + weight sync, not their sum",
        ]
    if window is not None:
        windows = cfg.rollout.partial_rollout_max_windows
        lines += [
            f"    partial rollouts: at most {window:,} new tokens per response per step's generation; a response "
            f"spans at most {windows} windows,",
            f"              so a trained token lags at most {staleness + windows - 1} weight versions "
            "(train.max_staleness + windows - 1)",
        ]
    return lines


def _peak_lines(title: str, amounts: Sequence[Amount]) -> list[str]:
    lines = [f"  {title}: {_gib(sum(a.nbytes for a in amounts))} GiB"]
    lines += [f"    {' ' if a.exact else '~'} {a.label:<54}{_gib(a.nbytes):>10}" for a in amounts]
    return lines


def colocated_section(plan: MemoryPlan) -> list[str]:
    """The other per-GPU peaks of a colocated run: weight sync and rollout."""
    if not plan.sync_peak and not plan.rollout_peak:
        return []
    where = "trainer offloaded to host during rollout" if plan.sync_peak else "the engines' own GPUs"
    lines = ["", f"other peaks per GPU (GiB; {where})"]
    if plan.sync_peak:
        lines += _peak_lines("weight sync (trainer parameters stay on the GPU)", plan.sync_peak)
    return lines + _peak_lines("rollout", plan.rollout_peak)


def placement_section(
    cfg: RunConfig, trainer_positions: Sequence[int], engine_positions: Sequence[Sequence[int]]
) -> list[str]:
    """One line per node: its GPUs' trainer ranks and engines (positions = node x gpus_per_node + GPU); an engine
    spanning nodes is listed on each of its nodes with its GPUs there."""
    per_node = cfg.cluster.gpus_per_node
    par = cfg.parallel
    lines = [
        "",
        f"placement ({cfg.cluster.nodes} nodes x {per_node} GPUs; Megatron rank order tp-cp-ep-dp-pp: "
        f"TP groups are {par.tp} consecutive ranks, expert groups {par.expert_tp * par.ep})",
    ]
    for node in range(cfg.cluster.nodes):
        ranks = [r for r, pos in enumerate(trainer_positions) if pos // per_node == node]
        gpus = [trainer_positions[r] % per_node for r in ranks]
        engines = []
        for e, positions in enumerate(engine_positions):
            here = [p % per_node for p in positions if p // per_node == node]
            spanned = sorted({p // per_node for p in positions})
            if here:
                spanning = f" of the engine on nodes {_spans(spanned)}" if len(spanned) > 1 else ""
                engines.append(f"{e} (GPUs {_spans(here)}{spanning})")
        trainer = f"trainer ranks {_spans(ranks)} on GPUs {_spans(gpus)}" if ranks else "no trainer ranks"
        lines.append(f"  node {node}: {trainer}; engines {', '.join(engines) or '-'}")
    return lines


def judge_section(cfg: RunConfig) -> list[str]:
    """The judge's engines (``data.reward: judge``) and, on GPU recipes, the nodes of its own they fill: one line
    per node, numbered after the run's; nothing without a judge."""
    layout = judge_layout(cfg)
    if cfg.judge is None or layout.num_engines == 0:
        return []
    engine = cfg.judge.engine or cfg.rollout.engine
    what = f"{layout.num_engines} {engine} engine(s) of {cfg.judge.model}"
    if layout.nodes == 0:
        return ["", f"judge (data.reward: judge): {what}, beside the run on its node"]
    per_node = cfg.cluster.gpus_per_node
    lines = [
        "",
        f"judge (data.reward: judge): {what}, tp {layout.gpus_per_engine}, {layout.gpus} GPUs on {layout.nodes} "
        f"node(s) of its own; the allocation holds {cfg.job_nodes} nodes (cluster.nodes {cfg.cluster.nodes} + "
        f"{layout.nodes}): sbatch --nodes={cfg.job_nodes}",
    ]
    for node in range(layout.nodes):
        engines = [
            f"{e} (GPUs {_spans([g % per_node for g in gpus])})"
            for e in range(layout.num_engines)
            if (gpus := range(e * layout.gpus_per_engine, (e + 1) * layout.gpus_per_engine))[0] // per_node == node
        ]
        lines.append(f"  node {cfg.cluster.nodes + node}: judge engines {', '.join(engines)}")
    return lines


def _range(values: tuple[float, float], digits: int) -> str:
    return f"{values[0]:,.{digits}f}-{values[1]:,.{digits}f}"


def _sync_lines(sync: SyncEstimate, title: str = "weight sync") -> list[str]:
    """A sync: bytes over its limiting link, seconds, and the terms they add up from."""
    lines = [
        f"  ~ {title} ({sync.transport}): {sync.link_bytes / 1e9:.2f} GB {sync.link} -> "
        f"{_range((sync.seconds.low, sync.seconds.high), 2)} s"
    ]
    if len(sync.terms) > 1:
        terms = " + ".join(f"{t.label} {_range((t.seconds.low, t.seconds.high), 2)} s" for t in sync.terms)
        lines.append(f"      = {terms}")
    return lines


def _rates_line(assumptions: Assumptions) -> list[str]:
    """Where measured rates come from and which rates stay assumed; nothing for the assumed set."""
    if not assumptions.source:
        return []
    measured = ", ".join(assumptions.measured) or "none"
    return [f"  rates: {MEASURED} in {assumptions.source} for {measured}; assumed: {', '.join(assumptions.assumed)}"]


def estimates_section(cfg: RunConfig, arch: QwenArchitecture, *, assumptions: Assumptions = ASSUMED) -> list[str]:
    """Modelled weight-sync seconds and tokens/s/GPU (:mod:`megatron_rl.plan.estimates`) at ``assumptions``, with
    each rate used (a measured one's basis says so); a transport
    :func:`~megatron_rl.plan.estimates.sync_refusal` refuses is named instead of modelled."""
    refusal = sync_refusal(cfg, cfg.weight_sync.resolved(cfg.rollout.placement))
    if refusal is not None:
        return ["", f"estimated GPU figures: none ({refusal})"]
    step = estimate_throughput(cfg, arch, assumptions=assumptions)
    sync = step.sync
    kinds = [k for k in ("tensor", "distributed", "disk") if k != sync.transport and sync_refusal(cfg, k) is None]
    others = [estimate_sync(cfg, arch, kind, assumptions=assumptions) for kind in kinds]
    # a measured sync leaves its transport's model out of the step; shown beside it, to compare
    modelled = [estimate_sync(cfg, arch, sync.transport, assumptions=assumptions)] if assumptions.sync else []
    rates = (
        "the rates below, some measured by preflight"
        if assumptions.measured
        else "the assumed rates below, not measured"
    )
    lines = [
        "",
        f"estimated GPU figures (~ modelled from exact counts and {rates})",
        *_sync_lines(sync, "weight sync of the LoRA adapter" if cfg.lora else "weight sync"),
        *(line for m in modelled for line in _sync_lines(m, "weight sync modelled")),
        "  ~ other transports: "
        + ", ".join(f"{o.transport} {_range((o.seconds.low, o.seconds.high), 2)} s" for o in others)
        + (" (tensor: colocated engines, per GPU, every node at once)" if "tensor" in kinds else ""),
        f"  ~ step: {step.tokens_per_step:,.0f} tokens ({cfg.train.prompts_per_step} prompts x "
        f"{cfg.rollout.n_samples_per_prompt} samples x {step.mean_sequence:,.0f} mean tokens) -> "
        f"{_range((step.step_seconds.low, step.step_seconds.high), 0)} s"
        + (" (generation beside training: the longer of the two + sync)" if cfg.train.max_staleness else ""),
        f"  ~ tokens/s/GPU: {_range((step.tokens_per_second_per_gpu.low, step.tokens_per_second_per_gpu.high), 0)} "
        f"({step.forward_flops_per_token / 1e9:.1f} GFLOP per token forward; generation 1 forward, "
        f"trainer {step.training_forwards} forwards per token)",
        *_rates_line(assumptions),
        "  assumptions:" if not assumptions.measured else "  assumptions (measured ones say so; the rest assumed):",
    ]
    used = dict.fromkeys([*step.assumptions, *(a for o in (*modelled, *others) for a in o.assumptions)])
    return lines + [f"    {a.line()}" for a in used]


def verdict_section(plan: MemoryPlan) -> list[str]:
    """Notes, then FITS or every problem with its knob."""
    lines = [""] + [f"note: {note}" for note in plan.notes]
    if plan.host_bytes_per_node:
        lines.append(
            f"note: host memory per node for offloaded trainer state / reference weights: "
            f"{_gib(plan.host_bytes_per_node)} GiB (pinned)"
        )
    if not plan.problems:
        return [*lines, f"FITS: every peak is within {_gib(plan.gpu_bytes)} GiB per GPU"]
    lines.append("DOES NOT FIT:")
    for problem in plan.problems:
        lines += [f"  - {problem.what}", f"    knob: {problem.knob}"]
    return lines


def render_plan(
    cfg: RunConfig,
    arch: QwenArchitecture,
    plan: MemoryPlan,
    trainer_positions: Sequence[int],
    engine_positions: Sequence[Sequence[int]],
    *,
    assumptions: Assumptions = ASSUMED,
) -> str:
    """The whole report as text (no trailing newline); the GPU figures at ``assumptions``."""
    lines = [*model_section(cfg, arch), *parameter_section(cfg, arch, plan.stages), *lora_section(cfg, arch, plan)]
    if plan.engine is None:
        state = ", ".join(f"{a.label} {a.nbytes / 2**20:.2f}" for a in max(plan.stages, key=lambda s: s.total).state)
        cpu = f"CPU recipe, no GPU memory to check; trainer state per rank (MiB): {state}"
        return "\n".join([*lines, "", cpu, *judge_section(cfg)])
    lines += trainer_memory_section(plan) + engine_section(cfg, arch, plan.engine, plan.gpu_bytes)
    lines += colocated_section(plan) + estimates_section(cfg, arch, assumptions=assumptions)
    lines += placement_section(cfg, trainer_positions, engine_positions) + judge_section(cfg) + verdict_section(plan)
    return "\n".join(lines)
