"""Cross-field checks of a recipe, run before any rank or engine starts.

Each check is a small named function taking the recipe (and the model's
:class:`QwenArchitecture`) and returning :class:`Finding` objects; a finding names the
dotted field, what is wrong and how to fix it. Errors stop the run; warnings are
printed and the run goes on. ``needed`` findings name files the recipe reads that are
not on this machine (weights, data), or the network interface of a multi-node run when
this machine lacks it: ``validate`` and ``plan`` report them as warnings,
so a layout can be checked before downloading anything; ``validate --strict`` and
``train`` refuse them.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

from megatron_rl.config.fp8_checkpoint import checkpoint_block, sglang_block_problems
from megatron_rl.config.hf_config import INDEX_FILE, SINGLE_FILE, QwenArchitecture
from megatron_rl.config.hf_weights import weight_problems
from megatron_rl.config.layout import trainer_layout
from megatron_rl.config.lora_checks import SGLangEngineShape, lora_errors, lora_warnings
from megatron_rl.config.model_source import has_hf_config, has_hf_weights
from megatron_rl.config.pipeline_split import pipeline_split
from megatron_rl.config.schema import JUDGE_REWARD, REMOTE_REWARD, RunConfig
from megatron_rl.config.sglang_env import INSTALL_HINT, sglang_python
from megatron_rl.config.sglang_pin import LORA_NOT_BY_BROADCAST, SGLANG_VERSION


@dataclass(frozen=True)
class Finding:
    """One problem of a recipe: the dotted field it concerns and a message with the fix."""

    level: Literal["error", "warning", "needed"]
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _error(field: str, message: str) -> Finding:
    return Finding("error", field, message)


def _warning(field: str, message: str) -> Finding:
    return Finding("warning", field, message)


def _needed(field: str, message: str) -> Finding:
    return Finding("needed", field, f"{message}: needed before training")


Check = Callable[[RunConfig, QwenArchitecture], Iterator[Finding]]


def _check_attention_vs_tp(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    tp = cfg.parallel.tp
    if arch.num_attention_heads % tp:
        yield _error("parallel.tp", f"{tp} does not divide the model's {arch.num_attention_heads} attention heads")
    if arch.num_query_groups % tp:
        yield _error(
            "parallel.tp",
            f"{tp} does not divide the model's {arch.num_query_groups} key/value heads; "
            f"use a tp that divides {arch.num_query_groups}",
        )
    if arch.ffn_hidden_size % tp:
        yield _error("parallel.tp", f"{tp} does not divide the model's intermediate_size ({arch.ffn_hidden_size})")
    if cfg.parallel.sequence_parallel != (tp > 1):
        yield _error(
            "parallel.sequence_parallel",
            f"{cfg.parallel.sequence_parallel}: the trainer runs sequence parallelism exactly when tp > 1 "
            f"(tp is {tp}); set it to {str(tp > 1).lower()}",
        )


def _check_expert_layout(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    par = cfg.parallel
    if not arch.is_moe:
        if par.ep > 1 or par.expert_tp != par.tp:
            yield _error("parallel.ep", f"{arch.architecture} has no experts: leave ep at 1 and etp unset")
        return
    if arch.num_experts % par.ep:
        yield _error("parallel.ep", f"{par.ep} does not divide the model's {arch.num_experts} experts")
    if arch.moe_ffn_hidden_size % par.expert_tp:
        yield _error(
            "parallel.etp",
            f"expert tp {par.expert_tp} does not divide the model's moe_intermediate_size ({arch.moe_ffn_hidden_size})",
        )
    if par.tp > 1 and not par.sequence_parallel:
        yield _error(
            "parallel.sequence_parallel", "Megatron-core needs sequence parallelism for MoE with tp > 1: set it true"
        )
    layout = trainer_layout(par, cfg.cluster, cfg.rollout)
    if layout.world_size > 0 and layout.expert_dp == 0:
        yield _error(
            "parallel.ep",
            f"etp ({par.expert_tp}) x ep ({par.ep}) x pp ({par.pp}) = {par.expert_tp * par.ep * par.pp} "
            f"does not divide the {layout.world_size} trainer ranks",
        )


def _check_pipeline_layout(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    par = cfg.parallel
    if par.vpp is not None and par.pp == 1:
        yield _error("parallel.vpp", "virtual pipeline stages need pp > 1; unset vpp or raise pp")
    split = pipeline_split(arch.num_layers, par)
    if (problem := split.problem()) is not None:
        uneven = par.first_stage_layers is not None or par.last_stage_layers is not None
        yield _error("parallel.first_stage_layers" if uneven else "parallel.pp", problem)


def _check_world_size(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    par, cluster, rollout = cfg.parallel, cfg.cluster, cfg.rollout
    total_gpus = cluster.nodes * cluster.gpus_per_node
    engines_take_all = rollout.num_gpus is None or rollout.num_gpus >= total_gpus
    if rollout.placement == "disaggregated" and cluster.gpus_per_node > 0 and engines_take_all:
        yield _error(
            "rollout.num_gpus",
            f"disaggregated placement needs the engines' GPU count below the {total_gpus} GPUs of the job, "
            f"got {rollout.num_gpus}",
        )
        return
    layout = trainer_layout(par, cluster, rollout)
    model_parallel = par.tp * par.pp * par.cp
    if layout.dp == 0:
        yield _error(
            "parallel",
            f"tp ({par.tp}) x pp ({par.pp}) x cp ({par.cp}) = {model_parallel} does not divide the "
            f"{layout.world_size} trainer ranks",
        )


def _check_sglang_on_cpu(cfg: RunConfig) -> Iterator[Finding]:
    """What SGLang 0.5.23's CPU path (DESIGN section 6) cannot do: each of these needs CUDA there."""
    rollout = cfg.rollout
    if sglang_python() is None:
        yield _error("rollout.engine", f"no SGLang installation found: {INSTALL_HINT}")
    if rollout.max_total_tokens is None:
        yield _error(
            "rollout.max_total_tokens",
            "SGLang on CPU sizes its KV cache from the host's memory (15 GB and more); set it, e.g. to 8192",
        )
    if rollout.quantization is not None:
        yield _error(
            "rollout.quantization",
            f"SGLang {SGLANG_VERSION} serves {rollout.quantization} on CPU only with AMX kernels that no registry wheel carries "
            "(Fp8LinearMethod asserts them); use rollout.engine=reference for FP8 rollouts on CPU",
        )
    if rollout.deterministic_inference:
        yield _error(
            "rollout.deterministic_inference",
            f"SGLang {SGLANG_VERSION} refuses --enable-deterministic-inference with its CPU attention backend (torch_native), and "
            "its batch-invariant ops need CUDA; set it false on CPU (the reference engine is always deterministic)",
        )
    if cfg.algorithm.routing_replay:
        yield _error(
            "algorithm.routing_replay",
            f"SGLang {SGLANG_VERSION} on CPU cannot return routed experts (its capture buffer is registered with CUDA, "
            "srt/state_capturer/base.py); use rollout.engine=reference for routing replay on CPU",
        )


def _check_engine_layout(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    rollout, cluster = cfg.rollout, cfg.cluster
    if rollout.engine == "sglang" and arch.is_moe and not all(arch.moe_layer_pattern):
        dense = [i for i, sparse in enumerate(arch.moe_layer_pattern) if not sparse]
        yield _error(
            "rollout.engine",
            f"the model's layers {dense} are dense (mlp_only_layers / decoder_sparse_step), but SGLang {SGLANG_VERSION} builds "
            "every Qwen3-MoE layer as MoE (srt/models/qwen3_moe.py, stage_facts) and would serve them with "
            "uninitialised experts; use rollout.engine=reference for this model",
        )
    if cfg.sglang_on_cpu:
        yield from _check_sglang_on_cpu(cfg)
    one_process = "the reference engine" if rollout.engine == "reference" else "SGLang on CPU"
    if (rollout.engine == "reference" or cluster.gpus_per_node == 0) and (rollout.tp, rollout.ep, rollout.dp) != (
        1,
        1,
        1,
    ):
        yield _error(
            "rollout.tp",
            f"{one_process} is one process: rollout.tp, rollout.ep and rollout.dp must be 1 "
            f"(got {rollout.tp}, {rollout.ep}, {rollout.dp}); more engines come from cluster.cpu_engines on CPU",
        )
    if rollout.tp % rollout.ep:
        yield _error("rollout.ep", f"engine ep ({rollout.ep}) must divide engine tp ({rollout.tp})")
    if arch.num_experts % rollout.ep:
        yield _error(
            "rollout.ep",
            f"engine ep ({rollout.ep}) must divide the model's {arch.num_experts} experts (SGLang asserts it)",
        )
    if arch.num_attention_heads % rollout.tp:
        yield _error(
            "rollout.tp", f"{rollout.tp} does not divide the model's {arch.num_attention_heads} attention heads"
        )
    if cluster.gpus_per_node == 0:
        return
    engine_gpus = rollout.tp * rollout.dp
    if engine_gpus > cluster.gpus_per_node:
        yield from _check_engine_spanning_nodes(cfg, engine_gpus)
        return
    if cluster.gpus_per_node % engine_gpus:
        yield _error(
            "rollout.tp",
            f"rollout.tp ({rollout.tp}) x rollout.dp ({rollout.dp}) = {engine_gpus} GPUs per engine does not divide "
            f"cluster.gpus_per_node ({cluster.gpus_per_node}), so some engine would span two nodes; pick tp x dp "
            f"dividing {cluster.gpus_per_node}",
        )
        return
    pool = rollout.num_gpus if rollout.placement == "disaggregated" else cluster.nodes * cluster.gpus_per_node
    if pool and pool % engine_gpus:
        yield _error(
            "rollout.tp",
            f"each engine takes tp x dp = {engine_gpus} GPUs, which does not divide the {pool} rollout GPUs",
        )


def _check_engine_spanning_nodes(cfg: RunConfig, engine_gpus: int) -> Iterator[Finding]:
    """An engine larger than a node: SGLang 0.5.23 runs it as one process per node (``--nnodes``), each with
    tp_size / nnodes ranks, so it must take whole nodes and have no data-parallel replicas."""
    rollout, cluster = cfg.rollout, cfg.cluster
    per_node = cluster.gpus_per_node
    if engine_gpus % per_node:
        yield _error(
            "rollout.tp",
            f"each engine takes rollout.tp ({rollout.tp}) x rollout.dp ({rollout.dp}) = {engine_gpus} GPUs, more than "
            f"cluster.gpus_per_node ({per_node}) and not a multiple of it: an engine spanning nodes takes whole "
            f"nodes (SGLang gives each node tp_size / nnodes ranks); pick tp x dp a multiple of {per_node}, or at "
            f"most {per_node} dividing it",
        )
        return
    nodes = engine_gpus // per_node
    if nodes > cluster.nodes:
        yield _error(
            "rollout.tp",
            f"each engine spans {nodes} nodes (tp x dp = {engine_gpus} GPUs, {per_node} per node), more than the "
            f"job's cluster.nodes ({cluster.nodes}); lower rollout.tp or add nodes",
        )
    if rollout.dp > 1:
        yield _error(
            "rollout.dp",
            f"{rollout.dp}: SGLang {SGLANG_VERSION} refuses data-parallel replicas in an engine spanning nodes "
            "(srt/arg_groups/validation_hook.py: 'multi-node data-parallel replicas are not supported'); set "
            "rollout.dp=1 and let rollout.tp span the nodes",
        )


def _check_batch_divisibility(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    train, n = cfg.train, cfg.rollout.n_samples_per_prompt
    if train.prompts_per_step % train.mini_batches_per_step:
        yield _error(
            "train.mini_batches_per_step",
            f"{train.mini_batches_per_step} does not divide train.prompts_per_step ({train.prompts_per_step})",
        )
        return
    dp = trainer_layout(cfg.parallel, cfg.cluster, cfg.rollout).dp
    responses = train.prompts_per_step // train.mini_batches_per_step * n
    if dp and responses % dp:
        yield _error(
            "train.prompts_per_step",
            f"each mini-batch has {responses} responses, which do not split evenly over the {dp} data-parallel "
            "ranks; change prompts_per_step, mini_batches_per_step or rollout.n_samples_per_prompt",
        )
    if n < 2:
        yield _error("rollout.n_samples_per_prompt", "group-relative advantages need at least 2 responses per prompt")


def _check_sequence_lengths(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    rollout = cfg.rollout
    total = rollout.max_prompt_length + rollout.max_response_length
    if total > arch.max_position_embeddings:
        yield _error(
            "rollout.max_response_length",
            f"max_prompt_length + max_response_length = {total} exceeds the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})",
        )
    if cfg.train.max_tokens_per_micro_batch < total:
        yield _error(
            "train.max_tokens_per_micro_batch",
            f"{cfg.train.max_tokens_per_micro_batch} cannot hold one sequence of up to {total} tokens",
        )
    overlong = cfg.algorithm.overlong
    if overlong.enable and overlong.buffer_length > rollout.max_response_length:
        yield _error(
            "algorithm.overlong.buffer_length",
            f"{overlong.buffer_length} exceeds rollout.max_response_length ({rollout.max_response_length})",
        )


def _check_preset(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    algo = cfg.algorithm
    fix = "fix it or set algorithm.preset: custom"
    if algo.preset == "dapo":
        if algo.loss_agg_mode != "token-mean":
            yield _error(
                "algorithm.loss_agg_mode",
                f"DAPO uses the token-level loss 'token-mean', got {algo.loss_agg_mode!r}; {fix}",
            )
        if algo.use_kl_loss:
            yield _error("algorithm.use_kl_loss", f"DAPO has no KL term; {fix}")
        if algo.clip_high <= algo.clip_low:
            yield _error(
                "algorithm.clip_high", f"DAPO's Clip-Higher needs clip_high > clip_low (paper: 0.28 > 0.2); {fix}"
            )
        if not algo.dynamic_sampling.enable:
            yield _error("algorithm.dynamic_sampling.enable", f"DAPO samples dynamically; {fix}")
        if algo.dynamic_sampling.metric != "acc":
            yield _error(
                "algorithm.dynamic_sampling.metric",
                f"DAPO keeps groups with 0 < #correct < G (metric acc), got {algo.dynamic_sampling.metric!r}; {fix}",
            )
        if not (algo.overlong.enable or algo.overlong.filter_truncated):
            yield _warning("algorithm.overlong", "DAPO shapes or filters overlong responses; both are off")
    elif algo.preset == "drgrpo":
        if algo.norm_adv_by_std:
            yield _error("algorithm.norm_adv_by_std", f"Dr.GRPO drops the std normalisation of advantages; {fix}")
        if algo.loss_agg_mode != "seq-mean-token-sum-norm":
            yield _error(
                "algorithm.loss_agg_mode",
                f"Dr.GRPO divides token sums by a constant: use 'seq-mean-token-sum-norm', got {algo.loss_agg_mode!r}; {fix}",
            )
    elif algo.preset == "grpo":
        if not algo.norm_adv_by_std:
            yield _error("algorithm.norm_adv_by_std", f"GRPO normalises advantages by the group std; {fix}")
        if algo.loss_agg_mode != "seq-mean-token-mean":
            yield _error("algorithm.loss_agg_mode", f"GRPO averages token means over sequences; {fix}")


def _check_loss_terms(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    algo = cfg.algorithm
    if algo.use_kl_loss and algo.kl_coef == 0.0:
        yield _warning("algorithm.kl_coef", "use_kl_loss is on with coefficient 0: the KL term does nothing")
    if not algo.use_kl_loss and algo.kl_coef > 0.0:
        yield _warning("algorithm.kl_coef", "ignored because use_kl_loss is false")
    if algo.loss_norm_constant is not None and algo.loss_agg_mode != "seq-mean-token-sum-norm":
        yield _error(
            "algorithm.loss_norm_constant",
            f"only seq-mean-token-sum-norm divides by a constant (loss_agg_mode is {algo.loss_agg_mode!r}); unset it",
        )
    if algo.clip_c is not None and algo.policy_loss != "ppo_clip":
        yield _error("algorithm.clip_c", f"dual clip applies to ppo_clip only, not {algo.policy_loss!r}")
    gen_batch = algo.dynamic_sampling.gen_batch_prompts
    if gen_batch is not None and gen_batch < cfg.train.prompts_per_step:
        yield _error(
            "algorithm.dynamic_sampling.gen_batch_prompts",
            f"{gen_batch} is smaller than train.prompts_per_step ({cfg.train.prompts_per_step}): a generation batch "
            "must hold a whole step (larger over-samples)",
        )
    if gen_batch is not None and not algo.dynamic_sampling.enable:
        yield _error(
            "algorithm.dynamic_sampling.gen_batch_prompts", "over-sampling needs dynamic sampling on (enable: true)"
        )
    if algo.dynamic_sampling.enable and cfg.rollout.n_samples_per_prompt < 2:
        yield _error("algorithm.dynamic_sampling.enable", "needs rollout.n_samples_per_prompt >= 2")
    if algo.routing_replay and not arch.is_moe:
        yield _error("algorithm.routing_replay", f"{arch.architecture} has no experts to replay")


def _check_sampling_temperature(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    rollout = cfg.rollout
    if rollout.top_p != 1.0 or rollout.top_k != -1:
        yield _error(
            "rollout.top_p" if rollout.top_p != 1.0 else "rollout.top_k",
            f"top_p {rollout.top_p}, top_k {rollout.top_k}: the trainer's log-probs (old, current, and the "
            "rollout/train importance ratio) are of the untruncated softmax, so truncated sampling would train on "
            "the wrong distribution; use top_p 1.0 and top_k -1",
        )
    temperature = rollout.temperature
    if not 0.0 < temperature < math.inf:
        yield _error(
            "rollout.temperature",
            f"{temperature}: training needs sampled rollouts and their log-probs, log_softmax(logits / temperature), "
            "so the temperature must be a finite number > 0 (0 is greedy decoding); set rollout.temperature to "
            "e.g. 1.0 (greedy is for validation only: validation.sets.<name>.temperature=0)",
        )


def _check_weight_sync(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    rollout, cluster = cfg.rollout, cfg.cluster
    if rollout.dp > 1:
        yield _error(
            "rollout.dp",
            f"{rollout.dp}: SGLang {SGLANG_VERSION} asserts dp_size == 1 for every weight update "
            "(update_weights_from_tensor, update_weights_from_distributed, init_weights_update_group; "
            "srt/managers/tokenizer_control_mixin.py), so an engine with data-parallel replicas cannot receive the "
            "trainer's weights; set rollout.dp=1 (the rollout GPUs then hold more engines of rollout.tp GPUs each)",
        )
    if rollout.placement != "colocated":
        return
    transport = cfg.weight_sync.resolved(rollout.placement)
    if transport == "tensor":
        yield from _check_colocated_feeds(cfg, arch)
    if cluster.gpus_per_node == 0:
        return
    if transport == "distributed":
        yield _error(
            "weight_sync.transport",
            "'distributed' with colocated engines: each broadcast group would hold a trainer rank and an engine rank "
            "on the same GPU, which NCCL refuses (duplicate GPU in one communicator); use weight_sync.transport=auto "
            "(tensor, each engine rank fed by the trainer rank on its GPU), disk, or rollout.placement=disaggregated",
        )


def _check_tensor_transport_placement(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    """The tensor transport feeds colocated engines only: it hands handles to the feeding rank's device memory."""
    if cfg.rollout.placement == "colocated" or cfg.weight_sync.resolved(cfg.rollout.placement) != "tensor":
        return
    yield _error(
        "weight_sync.transport",
        "'tensor' with rollout.placement=disaggregated: the tensor transport hands each engine rank handles to the "
        "memory of the trainer rank that feeds it (CUDA IPC handles on GPUs, which only an engine on the trainer's "
        "GPUs can open; shared memory on CPU, which does not cross nodes), and disaggregated engines have devices "
        "of their own; use weight_sync.transport=auto (distributed when disaggregated), distributed or disk, or "
        "rollout.placement=colocated",
    )


def _check_colocated_feeds(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    """The tensor transport feeds each engine rank from the trainer rank on its device with the whole model,
    which that rank assembles from its node alone: its TP, expert (EP x expert-TP) and pipeline groups
    must lie within the node (Megatron's rank order tp-cp-ep-dp-pp: TP and expert groups are consecutive
    ranks, pipeline stages the outermost)."""
    parallel, cluster = cfg.parallel, cfg.cluster
    world = trainer_layout(parallel, cluster, cfg.rollout).world_size
    if cluster.gpus_per_node == 0:
        engine_ranks = cfg.rollout.tp if cfg.rollout.engine == "sglang" else 1
        if cluster.cpu_engines * engine_ranks > world:
            yield _error(
                "cluster.cpu_engines",
                f"{cluster.cpu_engines} colocated engines of {engine_ranks} rank(s) for {world} trainer ranks: with "
                "weight_sync.transport=tensor every engine rank is fed by a trainer rank of its own; lower "
                "cluster.cpu_engines or raise cluster.cpu_trainer_ranks",
            )
            return
        if cluster.nodes == 1:
            return
        engines = cluster.cpu_engines
        if world % cluster.nodes or engines % cluster.nodes or (world // cluster.nodes) % (engines // cluster.nodes):
            yield _error(
                "cluster.cpu_engines",
                f"{engines} engines and {world} trainer ranks on {cluster.nodes} nodes: colocated CPU engines sit "
                "beside the trainer ranks that feed them, the same number on every node; make cluster.cpu_engines a "
                "multiple of cluster.nodes and the trainer ranks per node a multiple of the engines per node",
            )
            return
    per_node = cluster.gpus_per_node or world // cluster.nodes
    fix = "or use weight_sync.transport=disk"
    if per_node % parallel.tp:
        yield _error(
            "parallel.tp",
            f"{parallel.tp} does not divide the {per_node} ranks of a node: with weight_sync.transport=tensor each "
            f"rank gathers its TP group's shards within its node; use a divisor of {per_node} {fix}",
        )
    experts = parallel.ep * parallel.expert_tp
    if arch.is_moe and per_node % experts:
        yield _error(
            "parallel.ep",
            f"parallel.ep x parallel.etp = {experts} does not divide the {per_node} ranks of a node: with "
            "weight_sync.transport=tensor each rank gathers every expert from its expert group (consecutive ranks) "
            f"within its node; use ep x etp dividing {per_node} {fix}",
        )
    if parallel.pp > 1 and cluster.nodes > 1:
        yield _error(
            "parallel.pp",
            f"{parallel.pp} pipeline stages on {cluster.nodes} nodes: with weight_sync.transport=tensor each rank "
            "receives the other stages' layers from its pipeline group, whose ranks lie on different nodes (stages "
            f"are Megatron's outermost rank dimension); set parallel.pp=1 {fix}",
        )


def _check_staleness(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    staleness = cfg.train.max_staleness
    if staleness == 0:
        return
    if cfg.rollout.placement == "colocated":
        yield _error(
            "train.max_staleness",
            f"{staleness} with colocated engines: engines and trainer take turns on the same GPUs (the memory "
            "hand-over moves the KV cache out for training), so generation cannot overlap training; use "
            "rollout.placement=disaggregated with engines on GPUs of their own, or train.max_staleness=0",
        )
    if cfg.algorithm.tis_cap is None:
        yield _error(
            "algorithm.tis_cap",
            f"None with train.max_staleness={staleness}: samples come from weights up to {staleness} steps older "
            "than the policy that trains on them, and without the importance correction min(pi_old / pi_rollout, "
            "cap) the loss would treat them as on-policy; set algorithm.tis_cap (2.0 as in the TIS paper)",
        )


def _check_partial_rollouts(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    window = cfg.rollout.partial_rollout_tokens
    if window is None:
        return
    if cfg.algorithm.tis_cap is None:
        yield _error(
            "algorithm.tis_cap",
            f"None with rollout.partial_rollout_tokens={window}: a response cut at the window continues under "
            "newer weights, so its first tokens are older than the policy that trains on them, and without the "
            "importance correction min(pi_old / pi_rollout, cap) the loss would treat them as on-policy; set "
            "algorithm.tis_cap (2.0 as in the TIS paper)",
        )
    if window >= cfg.rollout.max_response_length:
        yield _error(
            "rollout.partial_rollout_tokens",
            f"{window} is not below rollout.max_response_length={cfg.rollout.max_response_length}: no response "
            "would ever be cut; set a smaller window (e.g. a quarter of the maximum) or None",
        )


def _check_episode(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    rollout = cfg.rollout
    if rollout.episode == "single_turn" and rollout.tools:
        yield _error(
            "rollout.tools",
            f"{rollout.tools} with rollout.episode=single_turn: a single-turn response calls no tool; set "
            "rollout.episode (tool_calls for Qwen3's format) or remove the tools",
        )
    if rollout.episode in ("tool_calls", "synthetic_tool_calls") and not rollout.tools:
        yield _error(
            "rollout.tools", f"empty with rollout.episode={rollout.episode}: name the tools the model may call"
        )
    synthetic = cfg.data.synthetic
    if synthetic is not None and synthetic.task == "lookup" and rollout.episode != "synthetic_tool_calls":
        yield _error(
            "rollout.episode",
            f"{rollout.episode} with data.synthetic.task=lookup: the lookup task's answer is found only by calling "
            "its tool; set rollout.episode=synthetic_tool_calls and rollout.tools=[synthetic_lookup]",
        )
    if rollout.episode != "single_turn" and rollout.max_turns == 1:
        yield _warning("rollout.max_turns", "1: the model's first turn is its last, so no tool call ever runs")


def _check_precision(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    train = cfg.train
    if train.precision == "fp8":
        if cfg.cluster.gpus_per_node == 0:
            yield _error("train.precision", "fp8 needs GPUs with Transformer Engine; use fp32 or bf16 on CPU")
        if train.fp8_recipe is None:
            yield _error("train.fp8_recipe", "precision fp8 needs a recipe: delayed, tensorwise, blockwise or mxfp8")
        if train.fp8_recipe == "mxfp8" and cfg.cluster.gpu_arch != "blackwell":
            yield _error(
                "train.fp8_recipe",
                f"mxfp8 needs compute capability >= 10.0 (Blackwell: B200/GB200); cluster.gpu_arch is "
                f"{cfg.cluster.gpu_arch!r} (H100/H200, 9.0), where Transformer Engine cannot run MXFP8 GEMMs; use "
                "train.fp8_recipe=blockwise or tensorwise (or delayed) on Hopper, or set cluster.gpu_arch=blackwell "
                "if the nodes are Blackwell",
            )
    elif train.fp8_recipe is not None:
        yield _error("train.fp8_recipe", f"set only with precision fp8 (precision is {train.precision!r})")
    if train.moe_aux_loss_type != "none" and not arch.is_moe:
        yield _error("train.moe_aux_loss_type", f"{arch.architecture} has no router to balance")
    if train.moe_aux_loss_type == "none" and train.moe_aux_loss_coef > 0.0:
        yield _warning("train.moe_aux_loss_coef", "ignored because moe_aux_loss_type is none")


def _check_sources(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    if cfg.data.synthetic is None and cfg.model.tokenizer is None and cfg.model.path is None:
        yield _error("model.tokenizer", "no tokenizer: set model.tokenizer (or model.path, or data.synthetic)")
    if cfg.data.synthetic is None and not cfg.data.val_files:
        for name, validation_set in cfg.validation.sets.items():
            if not validation_set.files and cfg.validation.interval_of(name) > 0:
                yield _error(
                    f"validation.sets.{name}.files",
                    "empty, and so is data.val_files: give the set its files, or set data.val_files, or "
                    f"validation.sets.{name}.interval=0",
                )
    if cfg.data.synthetic is not None:
        for name, validation_set in cfg.validation.sets.items():
            if validation_set.files:
                yield _error(
                    f"validation.sets.{name}.files",
                    "data.synthetic generates its own validation split: leave the set's files empty",
                )
    for key in ("train_files", "val_files"):
        for path in getattr(cfg.data, key):
            if not Path(path).is_file():
                yield _needed(f"data.{key}", f"no such file: {path!r}")
    for name, validation_set in cfg.validation.sets.items():
        for path in validation_set.files:
            if not Path(path).is_file():
                yield _needed(f"validation.sets.{name}.files", f"no such file: {path!r}")
    model = cfg.model
    if model.path is not None:
        if not has_hf_config(model.path):
            yield _needed("model.path", f"no config.json in {model.path!r}")
        if not has_hf_weights(model.path):
            yield _needed("model.path", f"no weights ({SINGLE_FILE} or {INDEX_FILE}) in {model.path!r}")
        elif has_hf_config(model.path):
            for problem in weight_problems(model.path, arch):
                yield _error("model.path", problem)
    if model.config_fallback is not None and not Path(model.config_fallback).is_file():
        yield _error("model.config_fallback", f"no such file: {model.config_fallback!r}")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).is_dir():
        yield _error("checkpoint.resume", f"{resume!r} is neither 'auto', 'none' nor an existing checkpoint directory")


def _check_remote_reward(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    data, remote = cfg.data, cfg.data.remote_reward
    if data.reward == REMOTE_REWARD and remote is None:
        yield _error(
            "data.remote_reward.url",
            f"required when data.reward is {REMOTE_REWARD!r} (not set): give the reward server's URL, e.g. "
            "data.remote_reward.url=http://rm-host:8000/score",
        )
    elif data.reward != REMOTE_REWARD and remote is not None:
        yield _error(
            "data.remote_reward.url",
            f"{remote.url!r} is set but data.reward is {data.reward!r}, which does not use it: set "
            f"data.reward={REMOTE_REWARD} to score through that server, or remove data.remote_reward",
        )
    elif remote is not None and remote.worst_case_s > data.reward_timeout_s:
        yield _error(
            "data.remote_reward.retries",
            f"{remote.retries} retries do not fit in data.reward_timeout_s={data.reward_timeout_s:g} s, after which "
            f"the reward worker is killed: {remote.retries + 1} tries of up to timeout_s={remote.timeout_s:g} s "
            f"and the waits between them take up to {remote.worst_case_s:g} s; lower data.remote_reward.retries "
            f"or data.remote_reward.timeout_s, or raise data.reward_timeout_s to {math.ceil(remote.worst_case_s)}",
        )


def _check_judge(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    judge, reward, per_node = cfg.judge, cfg.data.reward, cfg.cluster.gpus_per_node
    if reward == JUDGE_REWARD and judge is None:
        yield _error(
            "judge.model",
            f"required when data.reward is {JUDGE_REWARD!r} (no judge section): give the judge model's Hugging Face "
            "directory, e.g. judge.model=/models/Qwen3-8B",
        )
        return
    if judge is None:
        return
    if reward != JUDGE_REWARD:
        yield _error(
            "judge",
            f"a judge ({judge.model!r}) is set but data.reward is {reward!r}, which does not use it: set "
            f"data.reward={JUDGE_REWARD} to score with the judge, or remove the judge section",
        )
    if not Path(judge.model).is_dir():
        yield _needed("judge.model", f"no such directory: {judge.model!r} (the judge's Hugging Face model)")
    engine = judge.engine or cfg.rollout.engine
    if per_node and judge.tp > per_node:
        yield _error(
            "judge.tp",
            f"{judge.tp} GPUs per judge engine exceed a node's {per_node} (cluster.gpus_per_node); judge engines "
            f"do not span nodes: use judge.tp <= {per_node}",
        )
    elif per_node and (judge.num_engines * judge.tp) % per_node:
        gpus = judge.num_engines * judge.tp
        fill = -(-gpus // per_node) * per_node // judge.tp
        yield _error(
            "judge.num_engines",
            f"{judge.num_engines} judge engines x judge.tp {judge.tp} = {gpus} GPUs leave part of a node idle "
            f"(the judge takes whole nodes of {per_node} GPUs beside cluster.nodes): use judge.num_engines={fill}",
        )
    if judge.request_timeout_s > cfg.data.reward_timeout_s:
        yield _error(
            "judge.request_timeout_s",
            f"{judge.request_timeout_s:g} s exceeds data.reward_timeout_s={cfg.data.reward_timeout_s:g} s, after which "
            "the reward worker asking the judge is killed: lower judge.request_timeout_s, or raise "
            f"data.reward_timeout_s to at least {math.ceil(judge.request_timeout_s)}",
        )
    if engine == "sglang" and per_node == 0 and (judge.max_total_tokens or cfg.rollout.max_total_tokens) is None:
        yield _error(
            "judge.max_total_tokens",
            "a CPU SGLang judge engine needs a KV cache size (SGLang sizes it from host RAM): set "
            "judge.max_total_tokens or rollout.max_total_tokens",
        )


def _check_deterministic_inference(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    if cfg.rollout.deterministic_inference and cfg.rollout.engine == "reference":
        yield _warning(
            "rollout.deterministic_inference",
            "does nothing on the reference engine, which is always deterministic (it is SGLang's switch)",
        )


def _check_fp8_rollout(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    rollout = cfg.rollout
    if rollout.quantization != "fp8":
        return
    if cfg.cluster.gpu_arch == "blackwell":
        yield _error(
            "rollout.quantization",
            f"fp8 rollouts send float32 block scales; on Blackwell SGLang {SGLANG_VERSION} re-quantises them to UE8M0 for "
            "DeepGEMM once, after the first load (requant_block_scale_ue8m0_for_deepgemm, then format_ue8m0), so "
            "every later sync's float32 scales would be read as UE8M0; use them on Hopper (cluster.gpu_arch=hopper)",
        )
    for problem in sglang_block_problems(arch, rollout.tp, rollout.ep, rollout.fp8_block):
        yield _error(
            "rollout.fp8_block_size",
            f"{list(rollout.fp8_block_size)}: {problem}, so SGLang {SGLANG_VERSION} refuses to load it; pick a block that "
            "divides the model's projection sizes",
        )
    if rollout.fp8_checkpoint is None:
        return
    config_file = Path(rollout.fp8_checkpoint) / "config.json"
    if not config_file.is_file():
        yield _needed("rollout.fp8_checkpoint", f"no config.json in {rollout.fp8_checkpoint!r}")
        return
    try:
        block = checkpoint_block(json.loads(config_file.read_text()))
    except ValueError as error:
        yield _error("rollout.fp8_checkpoint", str(error))
        return
    if block != rollout.fp8_block:
        found = "no quantization_config" if block is None else f"blocks of {list(block)}"
        yield _error(
            "rollout.fp8_checkpoint",
            f"{rollout.fp8_checkpoint!r} has {found}, not rollout.fp8_block_size {list(rollout.fp8_block_size)}: "
            "convert it with `megatron-rl convert hf-to-fp8` or set rollout.fp8_block_size to its block",
        )
    if not has_hf_weights(rollout.fp8_checkpoint):
        yield _needed(
            "rollout.fp8_checkpoint", f"no weights ({SINGLE_FILE} or {INDEX_FILE}) in {rollout.fp8_checkpoint!r}"
        )


def _check_lora(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    if cfg.lora is None:
        return
    rollout = cfg.rollout
    sglang = SGLangEngineShape(rollout.dp, cfg.cluster.gpus_per_node == 0) if rollout.engine == "sglang" else None
    yield from (_error(field, message) for field, message in lora_errors(cfg.lora, arch, sglang))
    yield from (_warning(field, message) for field, message in lora_warnings(cfg.lora, arch))
    if cfg.weight_sync.transport == "distributed":
        yield _error(
            "weight_sync.transport",
            f"distributed with lora: {LORA_NOT_BY_BROADCAST}; set weight_sync.transport to tensor (engines on the "
            "trainer ranks' nodes), disk (a filesystem every node shares) or auto",
        )


def _check_network(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    cluster = cfg.cluster
    if cfg.job_nodes == 1:
        return  # a one-node run listens on 127.0.0.1 only, whatever network_interface says
    if cluster.network_interface is None:
        judge = f" plus the judge's {cfg.judge_nodes}" if cfg.judge_nodes else ""
        yield _error(
            "cluster.network_interface",
            f"required on more than one node (cluster.nodes {cluster.nodes}{judge}): name the interface the nodes reach each other "
            "on (e.g. ib0 or eth0; `ip -brief addr` on a node lists them); engines, the weight transport and Ray "
            "listen only on its address, never on every interface (0.0.0.0)",
        )
        return
    interfaces = psutil.net_if_addrs()
    if cluster.network_interface not in interfaces:
        yield _needed(
            "cluster.network_interface",
            f"this machine has no interface {cluster.network_interface!r} (it has {', '.join(sorted(interfaces))}); "
            "every node of the job needs it",
        )


def _check_logging(cfg: RunConfig, arch: QwenArchitecture) -> Iterator[Finding]:
    if "wandb" in cfg.logging.sinks and cfg.logging.wandb_project is None:
        yield _error("logging.wandb_project", "required when logging.sinks includes 'wandb'")
    if "wandb" in cfg.logging.sinks and importlib.util.find_spec("wandb") is None:
        yield _error("logging.sinks", "'wandb' needs the wandb package (pip install wandb), or drop the sink")


CHECKS: tuple[Check, ...] = (
    _check_attention_vs_tp,
    _check_expert_layout,
    _check_pipeline_layout,
    _check_world_size,
    _check_engine_layout,
    _check_batch_divisibility,
    _check_sequence_lengths,
    _check_preset,
    _check_loss_terms,
    _check_sampling_temperature,
    _check_weight_sync,
    _check_tensor_transport_placement,
    _check_staleness,
    _check_partial_rollouts,
    _check_episode,
    _check_precision,
    _check_sources,
    _check_remote_reward,
    _check_judge,
    _check_deterministic_inference,
    _check_fp8_rollout,
    _check_lora,
    _check_network,
    _check_logging,
)


_LEVEL_ORDER = {"error": 0, "needed": 1, "warning": 2}


def check_recipe(cfg: RunConfig, arch: QwenArchitecture) -> list[Finding]:
    """Run every cross-field check; errors first, then files needed before training, then warnings."""
    findings = [finding for check in CHECKS for finding in check(cfg, arch)]
    return sorted(findings, key=lambda f: _LEVEL_ORDER[f.level])
