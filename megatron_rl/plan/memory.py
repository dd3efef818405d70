"""GPU memory of a recipe's layout, trainer and engines, from the architecture alone (no torch, Megatron or Ray).

All amounts are bytes per GPU unless a name says otherwise. What is exact and what is estimated:

Exact (from :mod:`megatron_rl.plan.param_count` and the dtypes the code configures):

- parameters: ``P x 2`` (bf16; also with fp8 training, whose GEMMs keep bf16 weights) or ``P x 4`` (fp32);
- gradients: ``P x 4``: Megatron DDP with ``grad_reduce_in_fp32=True`` (``actor/optimizer.py``);
- distributed optimizer (Adam): fp32 main parameters + ``exp_avg`` + ``exp_avg_sq`` = 12 bytes per
  parameter with bf16 parameters, 8 with fp32 ones (the parameters are then the main copy),
  sharded over the data-parallel ranks (DP x CP) for dense parameters and over expert-DP
  (``world / (etp x ep x pp)``) for expert parameters. Bucket padding (< 0.1%) is ignored.
- the reference policy (``algorithm.use_kl_loss``) lives where ``algorithm.reference_placement``
  says (``actor/reference_policy.py``): on the host, parameter bytes of pinned host memory per
  rank and no GPU bytes; on the device, parameter bytes more per GPU (exact). A reference pass
  exchanges it with the parameters through one parameter-sized scratch tensor.
- with ``lora:`` (issue 40's design; the trainer is not built yet): the base is frozen in the
  parameter dtype with no gradient, no main parameter and no Adam state; the adapters
  (:mod:`megatron_rl.plan.lora_count`) have parameters, fp32 gradients and the distributed
  optimizer's state, sharded as above. The reference policy is the base with the adapters off:
  no copy anywhere.

Estimated (labelled so in the report):

- activations of one micro-batch of ``T = train.max_tokens_per_micro_batch`` tokens, per layer,
  counted as the tensors saved for backward (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", adapted to Qwen3: GQA, SwiGLU, q/k norms, no
  dropout, flash attention so no ``s^2`` term), in activation-dtype elements per token, divided
  by ``t = tp`` (sequence parallelism is on whenever tp > 1, :mod:`megatron_rl.models.megatron_config`);
  with context parallelism a rank holds ``T / cp`` of the micro-batch's tokens (its load-balanced
  share of every row; Transformer Engine's ring attention keeps no other rank's keys and values
  for backward):

  - attention: ``3h + 3(a + g)d`` (two norm inputs and the QKV input; q/k-norm inputs; q, k, v
    and output kept by flash attention);
  - dense MLP: ``h + 3f`` (fc1 input, SwiGLU input ``2f``, fc2 input);
  - MoE: ``2h + 2E`` (router input and probabilities in fp32) ``+ k (2 etp h + 3 f_e)`` per token
    for the ``k`` routed copies (expert input and output, gathered over ETP, and the expert's
    SwiGLU tensors), assuming balanced routing: a skewed router multiplies this part;
  - selective recompute (core attention) saves nothing more here: flash attention stores no
    ``s^2`` scores; full recompute keeps only each layer's input ``h`` plus one layer's full
    set while it is recomputed;
  - pipeline: stage ``p`` holds ``pp - p`` micro-batches in flight (1F1B), or with ``vpp``
    chunks Megatron's interleaved warm-up ``2 (pp - p - 1) + (vpp - 1) pp + 1`` chunk
    micro-batches (``pp (1 + (pp - 1)/(pp vpp))`` stages' worth on stage 0); an upper
    bound when a step has fewer micro-batches.
- log-prob working set on the last stage: logits ``[T / cp, V_padded / tp]`` in the activation dtype
  plus :data:`LOGPROB_WORKSPACE_BYTES` per element of one chunk of ``train.logprob_chunk_tokens``
  tokens (fp32 copy, the max-shifted and exp tensors, the entropy terms of
  ``parallel/vocab_parallel.py``; 21.1 measured on CPU at the forward peak, the same with and
  without gradients; chunks are recomputed one at a time in backward);
- :data:`PROCESS_RESERVE_GIB` per process on a GPU (CUDA context, NCCL communicators, allocator
  slack): an assumption.

Engines (SGLang): weights per GPU from :func:`~megatron_rl.plan.param_count.engine_gpu_weights`;
SGLang sizes its KV pool at start (on an empty GPU: the engines start before the trainer) as
``mem_fraction x GPU - weights`` (less, with ``lora:``, SGLang's LoRA memory pool:
``lora.max_loras_per_batch`` slots of :func:`~megatron_rl.plan.lora_count.engine_slot` in bf16, taken
from the KV share, an assumption about SGLang's start-up order); KV bytes per token per GPU
``2 x layers x kv_heads_per_gpu x head_dim x 2`` (bf16 cache). Colocated peaks (``orchestration/memory_handover.py``): training
(engines released), weight sync (trainer parameters, engine weights and :func:`sync_staging`: the
largest gathered tensor and a bucket; with the tensor transport, on every GPU since every trainer
rank assembles the whole model, its two device bucket buffers, each up to twice the larger of a
bucket and that tensor, the bucket being filled, and the largest tensor with its all-gather
shards), rollout (the engine's ``mem_fraction`` share plus both processes' reserves; the trainer
is fully offloaded to pinned host memory). With ``lora:`` the colocated engines keep their weights and LoRA
pool through training (they serve the base; a sync sends the adapter alone): the training peak counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.config.hf_config import QwenArchitecture, padded_vocab_size
from megatron_rl.config.layout import engine_layout, trainer_layout
from megatron_rl.config.schema import ParallelConfig, RunConfig, TrainConfig
from megatron_rl.plan.lora_count import engine_slot, largest_adapter_tensor, stage_adapter
from megatron_rl.plan.param_count import (
    ParamCount,
    chunk_layers,
    engine_gpu_weights,
    engine_kv_heads_per_gpu,
    stage_params,
)

GIB = 1024**3
PROCESS_RESERVE_GIB = 3.0
"""Assumed GPU bytes of one process beyond its tensors: CUDA context, NCCL communicators, allocator slack."""
LOGPROB_WORKSPACE_BYTES = 21.1
"""Bytes per ``[token, vocab/tp]`` element that ``vocab_parallel_logprobs_entropy`` allocates beyond the logits."""
KV_CACHE_BYTES = 2
"""Bytes per KV-cache element (SGLang's default cache dtype for a bf16 model)."""


@dataclass(frozen=True)
class Amount:
    """One labelled amount of memory in bytes; ``exact`` False marks an estimate or an assumption."""

    label: str
    nbytes: float
    exact: bool = True


@dataclass(frozen=True)
class Problem:
    """Something that does not fit, and the recipe knob to turn."""

    what: str
    knob: str


def optimizer_state_bytes(params: ParamCount, train: TrainConfig, dp: int, expert_dp: int) -> int:
    """Adam state of the distributed optimizer on one rank: ``ceil(P_dense / dp) + ceil(P_expert / expert_dp)``
    elements x 12 bytes (fp32 main params, m, v) with bf16 parameters, x 8 with fp32 parameters."""
    per_element = 8 if train.precision == "fp32" else 12
    return (math.ceil(params.dense / dp) + math.ceil(params.expert / expert_dp)) * per_element


def state_amounts(params: ParamCount, train: TrainConfig, dp: int, expert_dp: int) -> list[Amount]:
    """Parameters, fp32 gradient buffer and optimizer state of one rank holding ``params`` (exact)."""
    param_bytes = 4 if train.precision == "fp32" else 2
    dtype = "fp32" if train.precision == "fp32" else "bf16"
    return [
        Amount(f"parameters ({dtype})", params.total * param_bytes),
        Amount("gradients (fp32 main grads)", params.total * 4),
        Amount(
            f"optimizer (Adam, /dp {dp}, experts /edp {expert_dp})", optimizer_state_bytes(params, train, dp, expert_dp)
        ),
    ]


def lora_state_amounts(
    base: ParamCount, adapter: ParamCount, train: TrainConfig, dp: int, expert_dp: int
) -> list[Amount]:
    """The frozen ``base`` (parameters only) and the trainable ``adapter`` (parameters, fp32 gradients, optimizer
    state) of one rank (exact)."""
    param_bytes = 4 if train.precision == "fp32" else 2
    dtype = "fp32" if train.precision == "fp32" else "bf16"
    return [
        Amount(f"frozen base parameters ({dtype}; no grads, no optimizer)", base.total * param_bytes),
        Amount(f"LoRA adapter parameters ({dtype})", adapter.total * param_bytes),
        Amount("LoRA adapter gradients (fp32 main grads)", adapter.total * 4),
        Amount(
            f"LoRA adapter optimizer (Adam, /dp {dp}, experts /edp {expert_dp})",
            optimizer_state_bytes(adapter, train, dp, expert_dp),
        ),
    ]


def activation_dtype_bytes(train: TrainConfig) -> int:
    """Bytes per activation element: 4 with fp32 training, else 2 (bf16)."""
    return 4 if train.precision == "fp32" else 2


def layer_activation_elements(arch: QwenArchitecture, layer: int, parallel: ParallelConfig) -> float:
    """Elements per token that layer ``layer`` saves for backward without recompute, per rank (module docstring)."""
    h, d = arch.hidden_size, arch.head_dim
    attention = 3 * h + 3 * (arch.num_attention_heads + arch.num_query_groups) * d
    if arch.moe_layer_pattern[layer]:
        routed = arch.moe_router_topk * (2 * parallel.expert_tp * h + 3 * arch.moe_ffn_hidden_size)
        mlp = 2 * h + 2 * arch.num_experts + routed
    else:
        mlp = h + 3 * arch.ffn_hidden_size
    return (attention + mlp) / parallel.tp


def micro_batches_in_flight(parallel: ParallelConfig, pp_rank: int) -> float:
    """Micro-batches whose activations stage ``pp_rank`` holds at once, in whole-stage units (module docstring)."""
    vpp = parallel.vpp or 1
    if vpp == 1:
        return parallel.pp - pp_rank
    chunk_micro_batches = 2 * (parallel.pp - pp_rank - 1) + (vpp - 1) * parallel.pp + 1
    return chunk_micro_batches / vpp


def stage_layers(arch: QwenArchitecture, parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """Global layer indices held by pipeline stage ``pp_rank`` over all its chunks."""
    return [layer for v in range(parallel.vpp or 1) for layer in chunk_layers(arch.num_layers, parallel, pp_rank, v)]


def activation_bytes(arch: QwenArchitecture, parallel: ParallelConfig, train: TrainConfig, pp_rank: int) -> float:
    """Estimated activation bytes stage ``pp_rank`` holds at its peak (module docstring)."""
    tokens, width = train.max_tokens_per_micro_batch / parallel.cp, activation_dtype_bytes(train)
    per_layer = [
        layer_activation_elements(arch, layer, parallel) * tokens * width
        for layer in stage_layers(arch, parallel, pp_rank)
    ]
    in_flight = micro_batches_in_flight(parallel, pp_rank)
    if train.recompute == "full":
        layer_input = arch.hidden_size / parallel.tp * tokens * width
        return in_flight * len(per_layer) * layer_input + max(per_layer)
    return in_flight * sum(per_layer)


def logprob_bytes(arch: QwenArchitecture, parallel: ParallelConfig, train: TrainConfig) -> float:
    """Estimated log-prob working set of the last stage, bytes: the logits and one chunk's softmax workspace.

    ``T x V_padded/tp x dtype`` for the logits plus ``min(T, chunk) x V_padded/tp x workspace``
    (``train.logprob_chunk_tokens``; 0: the whole micro-batch), T the micro-batch token budget
    divided by ``cp`` (a CP rank's share of the rows).
    """
    local_vocab = padded_vocab_size(arch.vocab_size, parallel.tp) // parallel.tp
    tokens = math.ceil(train.max_tokens_per_micro_batch / parallel.cp)
    chunk = min(tokens, train.logprob_chunk_tokens or tokens)
    return local_vocab * (tokens * activation_dtype_bytes(train) + chunk * LOGPROB_WORKSPACE_BYTES)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's ranks: their parameters and their peak training memory per GPU.

    ``state``: parameters, gradients and optimizer state (exact; offloaded when colocated);
    ``working``: activations, log-prob working set and runtime reserve (estimates);
    ``parameter_bytes``: the parameters alone (with ``lora:``, the frozen base and the adapter), what stays
    on the GPU through a weight sync; ``adapter``: the rank's LoRA adapter elements (``lora:`` only).
    """

    pp_rank: int
    params: ParamCount
    state: tuple[Amount, ...]
    working: tuple[Amount, ...]
    parameter_bytes: float
    adapter: ParamCount | None = None

    @property
    def state_bytes(self) -> float:
        """Bytes of parameters, gradients and optimizer state."""
        return sum(amount.nbytes for amount in self.state)

    @property
    def total(self) -> float:
        """Peak training bytes: state plus working memory."""
        return self.state_bytes + sum(amount.nbytes for amount in self.working)


def stage_plan(arch: QwenArchitecture, cfg: RunConfig, pp_rank: int, reserves: int) -> StagePlan:
    """Peak training memory of a rank of stage ``pp_rank``; ``reserves``: processes on its GPU."""
    parallel, train = cfg.parallel, cfg.train
    layout = trainer_layout(parallel, cfg.cluster, cfg.rollout)
    params = stage_params(arch, parallel, pp_rank)
    dp, adapter = layout.dp * parallel.cp, None
    if cfg.lora is None:
        state = state_amounts(params, train, dp, layout.expert_dp)
        parameter_bytes = state[0].nbytes
    else:  # the reference is the base with the adapters off: no copy
        adapter = stage_adapter(arch, cfg.lora, parallel, pp_rank)
        state = lora_state_amounts(params, adapter, train, dp, layout.expert_dp)
        parameter_bytes = state[0].nbytes + state[1].nbytes
    if cfg.algorithm.use_kl_loss and cfg.algorithm.reference_placement == "device" and cfg.lora is None:
        state.append(Amount("reference weights (algorithm.reference_placement=device)", state[0].nbytes))
    recompute = f"recompute {train.recompute}, {train.max_tokens_per_micro_batch} tokens/micro-batch"
    working = [Amount(f"activations ({recompute})", activation_bytes(arch, parallel, train, pp_rank), exact=False)]
    if pp_rank == parallel.pp - 1:
        working.append(
            Amount("log-prob working set (logits + fp32 softmax)", logprob_bytes(arch, parallel, train), exact=False)
        )
    if cfg.lora is not None and cfg.rollout.placement == "colocated" and cfg.cluster.gpus_per_node > 0:
        # colocated LoRA engines keep the base they serve: each sync sends the adapter alone
        engine_bytes = engine_gpu_weights(arch, cfg.rollout).nbytes(cfg.rollout.quantization)
        working.append(
            Amount("engine weights + LoRA pool (kept through training)", engine_bytes + lora_pool_bytes(arch, cfg))
        )
    working.append(_reserve(reserves))
    return StagePlan(pp_rank, params, tuple(state), tuple(working), parameter_bytes, adapter)


def _reserve(processes: int) -> Amount:
    return Amount(f"runtime reserve ({processes} process(es))", processes * PROCESS_RESERVE_GIB * GIB, exact=False)


@dataclass(frozen=True)
class EnginePlan:
    """One engine: GPU count, weights (and with ``lora:`` the LoRA pool) and KV cache per GPU, and tokens of KV
    cache vs one generation batch."""

    num_engines: int
    gpus: int
    weight_bytes: int
    kv_pool_bytes: float
    kv_bytes_per_token: int
    tokens_fit: int
    tokens_needed: int
    sequence_tokens: int
    lora_pool_bytes: int = 0


def lora_pool_bytes(arch: QwenArchitecture, cfg: RunConfig) -> int:
    """bf16 bytes of SGLang's LoRA memory pool on one engine GPU: ``lora.max_loras_per_batch`` adapter slots
    (0 without ``lora:``)."""
    if cfg.lora is None:
        return 0
    return cfg.lora.max_loras_per_batch * engine_slot(arch, cfg.lora, cfg.rollout).total * 2


def engine_plan(arch: QwenArchitecture, cfg: RunConfig, gpu_bytes: float) -> EnginePlan:
    """The engine side (module docstring). ``tokens_fit`` is per engine (all its DP replicas);
    ``tokens_needed`` is its share of one generation batch at full length:
    ``ceil(prompts_per_step / engines)`` prompts (at most ``max_concurrent_requests``) x samples x
    (max prompt + max response)."""
    rollout = cfg.rollout
    layout = engine_layout(cfg.cluster, rollout)
    weight_bytes = engine_gpu_weights(arch, rollout).nbytes(rollout.quantization)
    pool = lora_pool_bytes(arch, cfg)
    kv_pool = rollout.mem_fraction * gpu_bytes - weight_bytes - pool
    kv_per_token = 2 * arch.num_layers * engine_kv_heads_per_gpu(arch, rollout.tp) * arch.head_dim * KV_CACHE_BYTES
    sequence = rollout.max_prompt_length + rollout.max_response_length
    prompts = min(math.ceil(cfg.train.prompts_per_step / max(layout.num_engines, 1)), rollout.max_concurrent_requests)
    return EnginePlan(
        num_engines=layout.num_engines,
        gpus=layout.gpus_per_engine,
        weight_bytes=weight_bytes,
        kv_pool_bytes=kv_pool,
        kv_bytes_per_token=kv_per_token,
        tokens_fit=rollout.dp * max(0, int(kv_pool // kv_per_token)),
        tokens_needed=prompts * rollout.n_samples_per_prompt * sequence,
        sequence_tokens=sequence,
        lora_pool_bytes=pool,
    )


@dataclass(frozen=True)
class MemoryPlan:
    """Everything ``megatron-rl plan`` reports, and what does not fit."""

    gpu_bytes: float
    stages: tuple[StagePlan, ...]
    engine: EnginePlan | None
    sync_peak: tuple[Amount, ...]
    rollout_peak: tuple[Amount, ...]
    host_bytes_per_node: float
    problems: tuple[Problem, ...]
    notes: tuple[str, ...]


def largest_gathered_bytes(arch: QwenArchitecture, parallel: ParallelConfig) -> int:
    """bf16 bytes of the largest tensor a sync gathers whole: the vocabulary table, padded at ``parallel.tp``."""
    return padded_vocab_size(arch.vocab_size, parallel.tp) * arch.hidden_size * 2


def _largest_synced_bytes(cfg: RunConfig, arch: QwenArchitecture) -> int:
    """bf16 bytes of the largest tensor a sync of ``cfg`` sends: the vocabulary table, or with ``lora:`` the
    adapter's largest tensor."""
    if cfg.lora is None:
        return largest_gathered_bytes(arch, cfg.parallel)
    return largest_adapter_tensor(arch, cfg.lora) * 2


def sync_staging(cfg: RunConfig, arch: QwenArchitecture) -> tuple[Amount, ...]:
    """What a weight sync holds on a GPU beyond the trainer parameters and the engine weights (module docstring);
    the largest tensor is the vocabulary table, or with ``lora:`` the adapter's largest.

    Tensor transport (every trainer rank assembles the whole model, so every GPU holds this): the two
    device bucket buffers, each up to ``2 x max(bucket, largest tensor)``; the gathered full tensors of
    the bucket being filled, fresh CUDA tensors until the bucket is copied into a buffer (up to a
    bucket); the largest tensor assembled and its all-gather shards, both alive when the tensor that
    does not fit sends that bucket. Other transports: one bucket and the largest gathered tensor.
    """
    largest = _largest_synced_bytes(cfg, arch)
    bucket = cfg.weight_sync.bucket_size_mb * 2**20
    if cfg.weight_sync.resolved(cfg.rollout.placement) != "tensor":
        return (Amount("bucket + largest gathered tensor (bf16)", bucket + largest),)
    return (
        # a tensor larger than a bucket is a bucket of its own
        Amount("2 device bucket buffers (each <= 2 x largest bucket)", 4 * max(bucket, largest)),
        Amount("gathered tensors of the bucket being filled (bf16)", bucket),
        Amount("largest tensor + its all-gather shards (bf16)", 2 * largest),
    )


def _sync_peak(cfg: RunConfig, arch: QwenArchitecture, stage: StagePlan, engine: EnginePlan) -> tuple[Amount, ...]:
    return (
        Amount(
            "trainer base + LoRA adapter parameters" if cfg.lora else f"trainer {stage.state[0].label}",
            stage.parameter_bytes,
        ),
        Amount("engine weights", engine.weight_bytes),
        *([Amount("engine LoRA pool", engine.lora_pool_bytes)] if engine.lora_pool_bytes else []),
        *sync_staging(cfg, arch),
        _reserve(2),
    )


def _rollout_peak(cfg: RunConfig, gpu_bytes: float, reserves: int) -> tuple[Amount, ...]:
    return (
        Amount(
            f"engine weights + KV cache (mem_fraction {cfg.rollout.mem_fraction})", cfg.rollout.mem_fraction * gpu_bytes
        ),
        _reserve(reserves),
    )


def _host_bytes_per_node(cfg: RunConfig, stages: tuple[StagePlan, ...]) -> float:
    """Pinned host memory per node of offloaded trainer state (colocated) and reference weights (KL loss)."""
    per_rank = max(
        (stage.state_bytes if cfg.rollout.placement == "colocated" else 0)
        + (
            stage.parameter_bytes
            if cfg.algorithm.use_kl_loss and cfg.algorithm.reference_placement == "host" and cfg.lora is None
            else 0
        )
        for stage in stages
    )
    return per_rank * min(cfg.cluster.gpus_per_node, trainer_layout(cfg.parallel, cfg.cluster, cfg.rollout).world_size)


def _training_problems(stages: tuple[StagePlan, ...], gpu_bytes: float) -> list[Problem]:
    return [
        Problem(
            f"trainer stage {stage.pp_rank}: {stage.total / GIB:.1f} GiB > {gpu_bytes / GIB:.0f} GiB GPU",
            "raise parallel.ep / parallel.tp / parallel.pp (fewer parameters and optimizer state per GPU), "
            "set train.recompute=full, or lower train.max_tokens_per_micro_batch (activations and logits)",
        )
        for stage in stages
        if stage.total > gpu_bytes
    ]


def _engine_problems(cfg: RunConfig, engine: EnginePlan) -> list[Problem]:
    if engine.kv_pool_bytes < engine.sequence_tokens * engine.kv_bytes_per_token:
        return [
            Problem(
                f"engine: weights {engine.weight_bytes / GIB:.1f} GiB per GPU leave {engine.kv_pool_bytes / GIB:.1f} GiB "
                f"of KV cache under mem_fraction {cfg.rollout.mem_fraction}, less than one "
                f"{engine.sequence_tokens}-token sequence",
                "raise rollout.mem_fraction, rollout.tp (weights per GPU) or rollout.quantization=fp8",
            )
        ]
    return []


def _colocated_problems(
    cfg: RunConfig, sync: tuple[Amount, ...], rollout: tuple[Amount, ...], gpu_bytes: float
) -> list[Problem]:
    problems = []
    if sum(a.nbytes for a in sync) > gpu_bytes:
        problems.append(
            Problem(
                f"weight sync: {sum(a.nbytes for a in sync) / GIB:.1f} GiB > {gpu_bytes / GIB:.0f} GiB GPU",
                "raise parallel.tp / parallel.ep (trainer parameters per GPU) or rollout.tp, "
                "or lower weight_sync.bucket_size_mb",
            )
        )
    if sum(a.nbytes for a in rollout) > gpu_bytes:
        problems.append(
            Problem(
                f"rollout: {sum(a.nbytes for a in rollout) / GIB:.1f} GiB > {gpu_bytes / GIB:.0f} GiB GPU "
                "(SGLang also needs room for CUDA graphs and activations outside mem_fraction)",
                "lower rollout.mem_fraction",
            )
        )
    return problems


def _kv_cache_knobs(cfg: RunConfig) -> str:
    """The knobs that give an engine more KV cache, less those the recipe has already turned all the way: a
    larger rollout.tp only while the engine stays within its node, FP8 only when the rollouts are not FP8."""
    rollout, per_node = cfg.rollout, cfg.cluster.gpus_per_node
    knobs = "rollout.mem_fraction or rollout.tp" if 2 * rollout.tp * rollout.dp <= per_node else "rollout.mem_fraction"
    return f"raise {knobs}" + (", or use rollout.quantization=fp8" if rollout.quantization != "fp8" else "")


def _notes(cfg: RunConfig, engine: EnginePlan | None) -> list[str]:
    notes = []
    if engine is not None and engine.tokens_fit < engine.tokens_needed:
        share = engine.tokens_fit / engine.tokens_needed
        notes.append(
            f"KV cache holds {share:.0%} of an engine's share of one generation batch at full length "
            f"({engine.tokens_fit // engine.sequence_tokens} full-length sequences at once): SGLang queues the rest "
            f"(slower, not an error); {_kv_cache_knobs(cfg)}"
        )
    if cfg.train.precision == "fp8":
        notes.append("fp8: Transformer Engine's cached FP8 weight copies are not counted")
    return notes


def plan_memory(cfg: RunConfig, arch: QwenArchitecture, gpu_memory_gib: float) -> MemoryPlan:
    """The memory plan of ``cfg`` on GPUs of ``gpu_memory_gib`` GiB (CPU recipes: trainer state only, no checks)."""
    gpu_bytes = gpu_memory_gib * GIB
    on_gpu = cfg.cluster.gpus_per_node > 0
    colocated = on_gpu and cfg.rollout.placement == "colocated"
    trainer_processes = 2 if colocated else 1
    stages = tuple(stage_plan(arch, cfg, p, trainer_processes) for p in range(cfg.parallel.pp))
    engine = engine_plan(arch, cfg, gpu_bytes) if on_gpu else None
    # The engine is planned exactly on GPUs (on_gpu), and colocated implies on_gpu.
    sync = (
        _sync_peak(cfg, arch, max(stages, key=lambda s: s.parameter_bytes), engine)
        if colocated and engine is not None
        else ()
    )
    rollout = _rollout_peak(cfg, gpu_bytes, trainer_processes) if engine is not None else ()
    problems: list[Problem] = []
    if engine is not None:
        problems += _training_problems(stages, gpu_bytes) + _engine_problems(cfg, engine)
        problems += _colocated_problems(cfg, sync, rollout, gpu_bytes)
    return MemoryPlan(
        gpu_bytes=gpu_bytes,
        stages=stages,
        engine=engine,
        sync_peak=sync,
        rollout_peak=rollout,
        host_bytes_per_node=_host_bytes_per_node(cfg, stages) if on_gpu else 0.0,
        problems=tuple(problems),
        notes=tuple(_notes(cfg, engine)),
    )
