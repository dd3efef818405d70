"""Modelled GPU figures of a recipe: weight-sync seconds and tokens/s/GPU, from exact counts and named assumptions.

Every figure is a range ``low-high`` that comes from the recipe's exact byte and FLOP counts divided
by a rate. By default every rate is assumed: the constants below, each with its range and basis,
gathered in :data:`ASSUMED`, and ``megatron-rl plan`` prints them next to the figures. ``plan --rates
REPORT.json`` puts in the rates ``megatron-rl preflight`` measured on the cluster
(:func:`with_measured`): a measured rate is one value, and its basis names the preflight step.

Weight sync (:func:`estimate_sync`): the model is every parameter of the Hugging Face model once, in
bf16 (2 B), or with ``rollout.quantization=fp8`` each projection in FP8 with its block scales
(:func:`~megatron_rl.plan.param_count.synced_model_bytes`: the trainer quantises before sending).
The transport is the one :func:`~megatron_rl.weight_sync.syncer.build_transport` picks (``auto``:
tensor when colocated, distributed otherwise); its seconds are the sum of its terms
(:class:`SyncTerm`):

- ``tensor`` (CUDA IPC, colocated, per GPU): engine ``e``'s TP rank ``t`` sits on the GPU of trainer
  rank ``e * k + t`` (``k`` GPUs per engine) and loads from that rank alone, so every trainer rank
  assembles the whole model bucket by bucket on its own GPU and every GPU of every node syncs at once
  (nothing crosses nodes; PP must be 1). Per GPU, one after the other:

  1. the all-gathers: the bytes the GPU receives, dense ``x (tp - 1) / tp`` over its TP group and
     expert ``x (ep etp - 1) / (ep etp)`` over its expert group
     (:func:`gathered_bytes_per_gpu`), over NVLink at :data:`NVLINK_GBPS`;
  2. the engine rank's copy out of the bucket: SGLang's ``weight_loader`` narrows each tensor to the
     rank's shard and copies only that, so the bytes are one engine GPU's weights
     (:func:`~megatron_rl.plan.param_count.engine_gpu_weights`, bf16), also at :data:`NVLINK_GBPS`:
     a same-GPU copy is faster (2.1 TB/s measured on an H200), so this term is an upper bound;
  3. the cost per tensor, in two parts measured on this path's one-GPU form (a TP 1 rank exporting
     the whole model into the reference engine on its GPU, flattened buckets), where it dominated:
     every trainer rank exports every tensor of the checkpoint
     (:func:`~megatron_rl.plan.param_count.hf_tensor_counts`) at :data:`EXPORT_MICROSECONDS_PER_TENSOR`,
     and sends the tensors its engine rank loads, which the rank loads, at
     :data:`LOAD_MICROSECONDS_PER_TENSOR`: every dense tensor and, at ``rollout.ep``, ``1 / ep`` of
     the experts (the transport feeds an engine rank only its own; SGLang's loader takes each tensor
     by name before it narrows), with FP8 rollouts each projection's scales too. SGLang's own
     loaders were not measured, nor the trainer's FP8 quantisation (one pass over each bucket).

- ``distributed`` (NCCL broadcast): the send lock lets one sending rank broadcast at a time, so
  the whole model crosses one sender's network link: model bytes / :data:`NETWORK_GBPS`;
- ``disk``: every byte is written to the shared filesystem, then (after a barrier, no overlap)
  every node reads all of it: model bytes / :data:`FS_WRITE_GBPS` + model bytes / :data:`FS_READ_GBPS`.

With ``lora:`` a sync sends the adapter alone (:func:`sync_payload`): its bf16 bytes
(:func:`~megatron_rl.plan.lora_count.whole_adapter`), never quantised (FP8 rollouts keep their FP8 base);
the tensor transport's terms are the same with the adapter's all-gathers (the bytes a rank lacks of its
stage's adapter), its engine shard (:func:`~megatron_rl.plan.lora_count.engine_adapter`) and its tensors
(:func:`~megatron_rl.plan.lora_count.adapter_tensor_counts`).

Not modelled: the all-gathers' launch latency (for Qwen3-30B-A3B at TP 4 x EP 8, 98 TP gathers and
one EP gather per local expert tensor, 2,304, per rank) and their lower bandwidth at small
messages, per-bucket request round trips and the engines' post-processing. The tensor terms
are summed, not overlapped (two bucket buffers let a rank gather bucket k+1 while its engine loads
bucket k, and the measured cost per tensor already holds a copy), so the sum leans high.
Distributed and disk are data movement alone. With a measured ``sync_gbps`` the recipe's own
transport is not modelled: its sync is model bytes / that rate (:func:`with_measured`).

Tokens/s/GPU (:func:`estimate_throughput`), defined as NeMo-RL publishes it: all tokens of a step
(prompt + response, every sample) / (step seconds x GPUs). Per token, a forward pass costs
``2 x`` the active GEMM parameters (attention projections, the top-k experts and the router, the
output layer; :func:`active_gemm_params`) plus causal attention ``4 x layers x heads x head_dim x
context``, the context being half the assumed mean sequence length (:data:`MEAN_SEQUENCE_FRACTION`
of ``max_prompt_length + max_response_length``). An on-policy step runs its phases one after the
other: generation (one forward per token at :data:`GENERATION_MFU`, on every GPU when colocated,
on the ``rollout.num_gpus`` engine GPUs when disaggregated), the old log-probs (one forward; a
second for the reference model when ``use_kl_loss``) and training (forward + backward = 3
forwards, one more under full recompute), both at :data:`TRAINING_MFU` of
:data:`PEAK_BF16_TFLOPS` (or the measured ``gemm_tflops``) on the trainer's GPUs, then the weight sync.
Not modelled: dynamic sampling's extra generation batches, pipeline bubbles, rewards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from megatron_rl.config.hf_config import QwenArchitecture
from megatron_rl.config.layout import trainer_world_size
from megatron_rl.config.schema import LoRAConfig, ParallelConfig, RunConfig
from megatron_rl.plan.lora_count import adapter_tensor_counts, engine_adapter, stage_adapter, whole_adapter
from megatron_rl.plan.param_count import (
    engine_gpu_weights,
    fp8_dense_projections,
    hf_tensor_counts,
    model_params,
    synced_model_bytes,
)
from megatron_rl.plan.rates import RATE_NAMES, Rate

BF16_BYTES = 2


@dataclass(frozen=True)
class Range:
    """A closed interval ``[low, high]`` (low <= high)."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"range low {self.low} > high {self.high}")

    def scaled(self, factor: float) -> Range:
        """Both ends times ``factor`` (>= 0)."""
        return Range(self.low * factor, self.high * factor)

    def per(self, rate: Range) -> Range:
        """``self / rate`` over both intervals (positive rates): the fewest over the most, the most over the fewest."""
        return Range(self.low / rate.high, self.high / rate.low)

    def __add__(self, other: Range) -> Range:
        return Range(self.low + other.low, self.high + other.high)

    def longer(self, other: Range) -> Range:
        """The longer of two concurrent spans, end by end: ``[max(lows), max(highs)]``."""
        return Range(max(self.low, other.low), max(self.high, other.high))


@dataclass(frozen=True)
class Assumption:
    """A named rate the estimates divide by: its range, unit and where the range comes from."""

    name: str
    value: Range
    unit: str
    basis: str

    def line(self) -> str:
        """``name: low-high unit (basis)``; one value where low == high (a measured rate)."""
        low, high = self.value.low, self.value.high
        value = f"{low:g}" if low == high else f"{low:g}-{high:g}"
        return f"{self.name}: {value} {self.unit} ({self.basis})"


NVLINK_GBPS = Assumption(
    "NVLink copy per GPU",
    Range(200, 350),
    "GB/s",
    "H100 NVLink 4: 450 GB/s per direction nominal; also taken for the engine's same-GPU copy, "
    "which is faster (2.1 TB/s on an H200, docs/gpu-checks.md)",
)
EXPORT_MICROSECONDS_PER_TENSOR = Assumption(
    "export time per tensor",
    Range(16, 17),
    "us",
    "measured on one H200: a TP1 Megatron export of the whole model alone, 6.38 GB in 1,611 tensors in "
    "0.026-0.027 s and in 3,147 in 0.050 s, docs/gpu-checks.md",
)
LOAD_MICROSECONDS_PER_TENSOR = Assumption(
    "send and engine load time per tensor",
    Range(46, 56),
    "us",
    "measured on one H200, flattened buckets: the whole tensor transport (export, CUDA IPC, an engine on the same "
    "GPU) at 62-72 us a tensor (1,611 tensors in 0.099-0.105 s, 3,147 in 0.201-0.225 s, docs/gpu-checks.md), "
    "less the export's 16 us",
)
NETWORK_GBPS = Assumption(
    "network per sending GPU", Range(20, 45), "GB/s", "NCCL broadcast over one 400 Gb/s (50 GB/s) NIC"
)
FS_WRITE_GBPS = Assumption("shared filesystem write", Range(2, 10), "GB/s", "all writers together")
FS_READ_GBPS = Assumption("shared filesystem read per node", Range(2, 10), "GB/s", "every node reads it all")
PEAK_BF16_TFLOPS = 989.0
"""H100 SXM dense bf16 peak (TFLOP/s), the base of both MFUs."""
TRAINING_MFU = Assumption(
    "training MFU", Range(0.10, 0.30), "of 989 TFLOP/s", "Megatron MoE fwd/bwd with EP all-to-all"
)
GENERATION_MFU = Assumption(
    "generation MFU", Range(0.02, 0.08), "of 989 TFLOP/s", "SGLang decode is memory-bound at RL batch sizes"
)
MEAN_SEQUENCE_FRACTION = 0.5
"""Assumed mean sequence length as a fraction of ``max_prompt_length + max_response_length``."""
MEASURED = "measured by preflight"
"""How the basis of a measured rate begins."""


@dataclass(frozen=True)
class Assumptions:
    """The rates the estimates divide by, one per field; the defaults are the assumed constants above.

    ``peak`` is the GEMM TFLOP/s both MFUs are fractions of when measured (else :data:`PEAK_BF16_TFLOPS`);
    ``sync``, when measured, is the recipe's own transport's whole rate (:func:`estimate_sync`).
    ``measured`` holds the names of :data:`~megatron_rl.plan.rates.RATE_NAMES` put in, and ``source``
    where they come from (the report and its date); both empty for the assumed set.
    """

    nvlink: Assumption = NVLINK_GBPS
    export_per_tensor: Assumption = EXPORT_MICROSECONDS_PER_TENSOR
    load_per_tensor: Assumption = LOAD_MICROSECONDS_PER_TENSOR
    network: Assumption = NETWORK_GBPS
    fs_write: Assumption = FS_WRITE_GBPS
    fs_read: Assumption = FS_READ_GBPS
    training_mfu: Assumption = TRAINING_MFU
    generation_mfu: Assumption = GENERATION_MFU
    peak: Assumption | None = None
    sync: Assumption | None = None
    measured: tuple[str, ...] = ()
    source: str = ""

    @property
    def peak_tflops(self) -> float:
        """The TFLOP/s the MFUs are fractions of: the measured GEMM rate, else the nominal bf16 peak."""
        return self.peak.value.low if self.peak is not None else PEAK_BF16_TFLOPS

    @property
    def assumed(self) -> tuple[str, ...]:
        """The names of :data:`~megatron_rl.plan.rates.RATE_NAMES` not measured, whose assumptions stand."""
        return tuple(name for name in RATE_NAMES if name not in self.measured)


ASSUMED = Assumptions()
"""Every rate assumed: what the estimates use without ``plan --rates``."""

_REPLACED_BY = {
    "intra_node_gbps": "nvlink",
    "inter_node_gbps": "network",
    "fs_write_gbps": "fs_write",
    "fs_read_gbps": "fs_read",
}
"""The rates that stand in for one assumption each: rate name -> field of :class:`Assumptions`."""


def _measured(name: str, unit: str, rate: Rate, note: str = "") -> Assumption:
    """``rate`` as an assumption of one value, its basis naming what preflight measured it on."""
    return Assumption(name, Range(rate.value, rate.value), unit, f"{MEASURED}: {rate.source}{note}")


def with_measured(rates: Mapping[str, Rate], source: str = "") -> Assumptions:
    """:data:`ASSUMED` with each assumption a measured rate stands for replaced by that one value.

    ``intra_node_gbps`` replaces :data:`NVLINK_GBPS`, ``inter_node_gbps`` :data:`NETWORK_GBPS`,
    ``fs_write_gbps`` and ``fs_read_gbps`` the filesystem rates; ``gemm_tflops`` replaces the peak both
    MFUs are fractions of (the MFUs themselves stay assumed). ``sync_gbps`` makes the recipe's own
    transport's sync ``model bytes / sync_gbps``, one term: preflight measured it on the cut model, so
    the per-tensor costs of the full-size model (tensor transport: export and load per tensor, the
    all-gathers' launches) are what it leaves out. ``source`` names the report, for the printout.
    """
    changes: dict[str, Any] = {}
    for rate_name, field in _REPLACED_BY.items():
        if rate_name in rates:
            assumed: Assumption = getattr(ASSUMED, field)
            changes[field] = _measured(assumed.name, assumed.unit, rates[rate_name])
    if "gemm_tflops" in rates:
        gemm = rates["gemm_tflops"]
        changes["peak"] = _measured("dense GEMM rate, the MFUs' base", "TFLOP/s", gemm)
        base = f"of {gemm.value:g} TFLOP/s measured"
        changes["training_mfu"] = replace(TRAINING_MFU, unit=base)
        changes["generation_mfu"] = replace(GENERATION_MFU, unit=base)
    if "sync_gbps" in rates:
        note = "; on the cut model, so the per-tensor costs at full size are left out"
        changes["sync"] = _measured("weight sync into the engines", "GB/s", rates["sync_gbps"], note)
    measured = tuple(name for name in RATE_NAMES if name in rates)
    return replace(ASSUMED, **changes, measured=measured, source=source)


@dataclass(frozen=True)
class SyncTerm:
    """One part of a sync's modelled seconds: what it moves or counts (``label``), and its seconds."""

    label: str
    seconds: Range


@dataclass(frozen=True)
class SyncEstimate:
    """Modelled seconds of one weight sync: the sum of its terms (see the module docstring).

    ``link_bytes`` go the way ``link`` says (a phrase for the report): tensor, what each GPU moves at
    the NVLink rate (all-gathers received plus the engine rank's copy); otherwise the whole model.
    """

    transport: str
    model_bytes: int
    link: str
    link_bytes: int
    terms: tuple[SyncTerm, ...]
    assumptions: tuple[Assumption, ...]

    @property
    def seconds(self) -> Range:
        """The terms' sum."""
        return sum((term.seconds for term in self.terms), start=Range(0.0, 0.0))


def gathered_bytes_per_gpu(arch: QwenArchitecture, parallel: ParallelConfig) -> int:
    """bf16 bytes one trainer GPU receives through the all-gathers that assemble the whole model on it:
    dense ``x (tp - 1) / tp`` (its TP group; replicated norms and router counted too, under 1% of the
    dense bytes) plus expert ``x (ep etp - 1) / (ep etp)`` (its expert group)."""
    params = model_params(arch)
    expert_group = parallel.ep * parallel.expert_tp
    dense = params.dense * BF16_BYTES * (parallel.tp - 1) // parallel.tp
    return dense + params.expert * BF16_BYTES * (expert_group - 1) // expert_group


def _exactly(nbytes: int) -> Range:
    return Range(nbytes, nbytes)


def fp8_block(cfg: RunConfig) -> tuple[int, int] | None:
    """The FP8 block a sync quantises to (FP8 rollouts), else None."""
    return cfg.rollout.fp8_block if cfg.rollout.quantization == "fp8" else None


def sync_refusal(cfg: RunConfig, transport: str) -> str | None:
    """Why ``transport`` cannot sync ``cfg``'s layout, or None: tensor needs ``parallel.pp`` 1 on several nodes
    (validate's rule: the pipeline group would cross nodes)."""
    if transport == "tensor" and cfg.parallel.pp > 1 and cfg.cluster.nodes > 1:
        return (
            f"the tensor transport assembles the whole model on every trainer rank within its node, so across "
            f"{cfg.cluster.nodes} nodes it needs parallel.pp 1, not {cfg.parallel.pp}"
        )
    return None


@dataclass(frozen=True)
class SyncPayload:
    """What one sync moves (module docstring), the model or the LoRA adapter: its bytes as sent (``sent_bytes``)
    and in bf16 before any quantisation (``bf16_bytes``), the bytes one trainer GPU gathers of it, one engine
    GPU's share of it, the tensors every trainer rank exports and those an engine rank loads."""

    sent_bytes: int
    bf16_bytes: int
    gathered_bytes: int
    engine_share_bytes: int
    exported_tensors: int
    loaded_tensors: int


def _model_payload(cfg: RunConfig, arch: QwenArchitecture) -> SyncPayload:
    dense_tensors, expert_tensors = hf_tensor_counts(arch)
    loaded = dense_tensors + expert_tensors // cfg.rollout.ep  # an engine rank is fed only its experts
    if fp8_block(cfg) is not None:  # and each projection's scales
        loaded += fp8_dense_projections(arch) + expert_tensors // cfg.rollout.ep
    return SyncPayload(
        sent_bytes=synced_model_bytes(arch, fp8_block(cfg)),
        bf16_bytes=model_params(arch).total * BF16_BYTES,
        gathered_bytes=gathered_bytes_per_gpu(arch, cfg.parallel),
        engine_share_bytes=engine_gpu_weights(arch, cfg.rollout).nbytes(cfg.rollout.quantization),
        exported_tensors=dense_tensors + expert_tensors,
        loaded_tensors=loaded,
    )


def adapter_gathered_bytes(arch: QwenArchitecture, lora: LoRAConfig, parallel: ParallelConfig) -> int:
    """bf16 bytes one trainer GPU receives to assemble its stage's whole adapter: the stage's adapter at one rank
    less the rank's own share (replicated A or B need no gathering), the largest over the stages."""
    whole_rank = parallel.model_copy(update={"tp": 1, "ep": 1, "etp": 1})
    lacking = [
        stage_adapter(arch, lora, whole_rank, p).total - stage_adapter(arch, lora, parallel, p).total
        for p in range(parallel.pp)
    ]
    return max(lacking) * BF16_BYTES


def _adapter_payload(cfg: RunConfig, arch: QwenArchitecture, lora: LoRAConfig) -> SyncPayload:
    dense_tensors, expert_tensors = adapter_tensor_counts(arch, lora)
    nbytes = whole_adapter(arch, lora).total * BF16_BYTES
    return SyncPayload(
        sent_bytes=nbytes,
        bf16_bytes=nbytes,
        gathered_bytes=adapter_gathered_bytes(arch, lora, cfg.parallel),
        engine_share_bytes=engine_adapter(arch, lora, cfg.rollout).total * BF16_BYTES,
        exported_tensors=dense_tensors + expert_tensors,
        loaded_tensors=dense_tensors + expert_tensors // cfg.rollout.ep,
    )


def sync_payload(cfg: RunConfig, arch: QwenArchitecture) -> SyncPayload:
    """What a sync of ``cfg`` moves: the LoRA adapter with ``lora:``, else the whole model."""
    return _model_payload(cfg, arch) if cfg.lora is None else _adapter_payload(cfg, arch, cfg.lora)


def _tensor_sync(cfg: RunConfig, payload: SyncPayload, assumed: Assumptions) -> SyncEstimate:
    """The per-GPU colocated path (module docstring); ValueError where :func:`sync_refusal` refuses it."""
    refusal = sync_refusal(cfg, "tensor")
    if refusal is not None:
        raise ValueError(refusal)
    nvlink = assumed.nvlink.value.scaled(1e9)
    gathered, share = payload.gathered_bytes, payload.engine_share_bytes
    tensors, loaded = payload.exported_tensors, payload.loaded_tensors
    stages = cfg.parallel.pp
    # the other stages' layers, over the node's pipeline group: stages broadcast the export, before any quantisation
    broadcast = payload.bf16_bytes * (stages - 1) // stages
    terms = (
        SyncTerm(f"all-gathers ({gathered / 1e9:.2f} GB)", _exactly(gathered).per(nvlink)),
        *([SyncTerm(f"pipeline broadcast ({broadcast / 1e9:.2f} GB)", _exactly(broadcast).per(nvlink))] * (stages > 1)),
        SyncTerm(f"engine copy ({share / 1e9:.2f} GB)", _exactly(share).per(nvlink)),
        SyncTerm(f"{tensors:,} tensors exported", assumed.export_per_tensor.value.scaled(tensors * 1e-6)),
        SyncTerm(f"{loaded:,} tensors loaded", assumed.load_per_tensor.value.scaled(loaded * 1e-6)),
    )
    link = "per GPU at the NVLink rate, all GPUs at once"
    link_bytes = gathered + broadcast + share
    used = (assumed.nvlink, assumed.export_per_tensor, assumed.load_per_tensor)
    return SyncEstimate("tensor", payload.sent_bytes, link, link_bytes, terms, used)


def estimate_sync(
    cfg: RunConfig, arch: QwenArchitecture, transport: str | None = None, *, assumptions: Assumptions = ASSUMED
) -> SyncEstimate:
    """Seconds of one sync with ``transport`` (default: the recipe's, resolved) at ``assumptions``; see the module
    docstring. A measured ``assumptions.sync`` stands for the recipe's own transport, asked for as None: its
    sync is then the model bytes at that rate, one term; a transport named is modelled.

    Raises ValueError for an unknown transport, and for tensor at ``parallel.pp`` > 1.
    """
    kind = transport or cfg.weight_sync.resolved(cfg.rollout.placement)
    payload = sync_payload(cfg, arch)
    model_bytes = payload.sent_bytes
    if transport is None and assumptions.sync is not None and sync_refusal(cfg, kind) is None:
        measured = (SyncTerm("measured sync", _exactly(model_bytes).per(assumptions.sync.value.scaled(1e9))),)
        link = "into the engines at the rate preflight measured"
        return SyncEstimate(kind, model_bytes, link, model_bytes, measured, (assumptions.sync,))
    if kind == "tensor":
        return _tensor_sync(cfg, payload, assumptions)
    model = _exactly(model_bytes)
    if kind == "distributed":
        broadcast = (SyncTerm("broadcast", model.per(assumptions.network.value.scaled(1e9))),)
        return SyncEstimate(
            kind, model_bytes, "through one sender's NIC", model_bytes, broadcast, (assumptions.network,)
        )
    if kind == "disk":
        terms = (
            SyncTerm("write", model.per(assumptions.fs_write.value.scaled(1e9))),
            SyncTerm("read", model.per(assumptions.fs_read.value.scaled(1e9))),
        )
        link = "through the shared filesystem (written, then read)"
        return SyncEstimate(kind, model_bytes, link, model_bytes, terms, (assumptions.fs_write, assumptions.fs_read))
    raise ValueError(f"unknown weight-sync transport {kind!r}: expected tensor, distributed or disk")


def active_gemm_params(arch: QwenArchitecture) -> int:
    """GEMM weight elements one token passes through: attention projections, its MLP (top-k experts and
    the router in MoE layers), the output layer. Embedding lookups and norms are no GEMMs."""
    hidden, head_dim = arch.hidden_size, arch.head_dim
    attention = (arch.num_attention_heads + 2 * arch.num_query_groups) * head_dim * hidden
    attention += hidden * arch.num_attention_heads * head_dim
    total = 0
    for layer in range(arch.num_layers):
        total += attention
        if arch.moe_layer_pattern and arch.moe_layer_pattern[layer]:
            total += arch.moe_router_topk * 3 * arch.moe_ffn_hidden_size * hidden + arch.num_experts * hidden
        else:
            total += 3 * arch.ffn_hidden_size * hidden
    return total + arch.vocab_size * hidden


def forward_flops_per_token(arch: QwenArchitecture, context: float) -> float:
    """FLOPs of one token's forward pass attending to ``context`` earlier tokens: 2 x active GEMM
    parameters + 4 x layers x heads x head_dim x context (scores and weighted values)."""
    attention = 4 * arch.num_layers * arch.num_attention_heads * arch.head_dim * context
    return 2 * active_gemm_params(arch) + attention


@dataclass(frozen=True)
class ThroughputEstimate:
    """Modelled step of a recipe: tokens, seconds and tokens/s/GPU (NeMo-RL's definition)."""

    tokens_per_step: float
    mean_sequence: float
    forward_flops_per_token: float
    training_forwards: int
    step_seconds: Range
    tokens_per_second_per_gpu: Range
    sync: SyncEstimate
    assumptions: tuple[Assumption, ...]


def estimate_throughput(
    cfg: RunConfig, arch: QwenArchitecture, *, assumptions: Assumptions = ASSUMED
) -> ThroughputEstimate:
    """Tokens/s/GPU of the recipe's step at ``assumptions`` (see the module docstring for the model).

    ``training_forwards``: forward-pass equivalents per token on the trainer (old log-probs,
    reference, forward + backward, recompute). The rate is per GPU over all ``cluster`` GPUs.
    A step is generation + training + sync; with ``train.max_staleness`` > 0 generation runs
    beside training (the rollout pipeline), so it is the longer of the two + sync.
    """
    rollout, train = cfg.rollout, cfg.train
    mean_sequence = MEAN_SEQUENCE_FRACTION * (rollout.max_prompt_length + rollout.max_response_length)
    tokens = train.prompts_per_step * rollout.n_samples_per_prompt * mean_sequence
    gpus = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    engine_gpus = (rollout.num_gpus or gpus) if rollout.placement == "disaggregated" else gpus
    trainer_gpus = trainer_world_size(cfg.cluster, rollout)
    flops = forward_flops_per_token(arch, mean_sequence / 2)
    forwards = 1 + (1 if cfg.algorithm.use_kl_loss else 0) + 3 + (1 if train.recompute == "full" else 0)
    peak = assumptions.peak_tflops * 1e12
    generated = tokens / engine_gpus * flops
    trained = tokens / trainer_gpus * flops * forwards
    generation = Range(generated, generated).per(assumptions.generation_mfu.value.scaled(peak))
    training = Range(trained, trained).per(assumptions.training_mfu.value.scaled(peak))
    sync = estimate_sync(cfg, arch, assumptions=assumptions)
    overlapped = train.max_staleness > 0
    step = (generation.longer(training) if overlapped else generation + training) + sync.seconds
    rate = Range(tokens / gpus / step.high, tokens / gpus / step.low)
    peak_rate = (assumptions.peak,) if assumptions.peak is not None else ()
    used = (*peak_rate, assumptions.generation_mfu, assumptions.training_mfu, *sync.assumptions)
    return ThroughputEstimate(tokens, mean_sequence, flops, forwards, step, rate, sync, used)
