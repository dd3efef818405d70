"""``PolicyActor``: one rank's Megatron policy worker (Ray wraps it in ``orchestration``).

Every rank of the trainer holds one actor; all of them are called together, each with its
data-parallel rank's :class:`~megatron_rl.actor.step_data.StepData` shard from the driver
(every rank of a model-parallel group the same shard). Public API:

* :meth:`PolicyActor.log_probs`: the policy's (or the reference's) log-probs and entropies of
  the shard's rows, [n, S] on the last pipeline stage, exactly as the training step computes them;
* :attr:`PolicyActor.step_context`, :meth:`PolicyActor.prepare` and
  :meth:`PolicyActor.batch_log_probs`: what the trainer's step (``train_step.train_step``, on
  this DP rank's own samples) reads and calls;
* :meth:`PolicyActor.export_weights`: Hugging Face (name, tensor) pairs for weight sync (the whole model; with
  LoRA the frozen base, without the adapters);
* :meth:`PolicyActor.export_adapter`: with LoRA (:attr:`PolicyActor.lora`), the adapter under PEFT names;
* :meth:`PolicyActor.offload` / :meth:`PolicyActor.reload`: colocated mode memory hand-over.

Requires :func:`megatron_rl.parallel.distributed.initialize_parallel` with
:func:`parallel_sizes` of the same ``ParallelConfig`` first.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.batch_logprobs import local_log_probs
from megatron_rl.actor.micro_batch_forward import ForwardOptions
from megatron_rl.actor.offload import StateOffloader
from megatron_rl.actor.optimizer import build_optimizer, wrap_ddp
from megatron_rl.actor.packing import select_packing
from megatron_rl.actor.precision import actor_config_overrides, params_dtype
from megatron_rl.actor.reference_policy import ReferencePolicyWeights
from megatron_rl.actor.routing_replay import RoutingReplay
from megatron_rl.actor.step_data import StepData
from megatron_rl.actor.token_logprobs import TokenLogProbs
from megatron_rl.actor.train_step import StepContext
from megatron_rl.config.hf_config import parse_hf_config
from megatron_rl.config.schema import AlgorithmConfig, LoRAConfig, ParallelConfig, TrainConfig
from megatron_rl.models.builder import build_model_chunks
from megatron_rl.models.lora import adapters_disabled, apply_lora
from megatron_rl.models.lora_peft import lora_state_to_peft
from megatron_rl.models.megatron_config import build_transformer_config
from megatron_rl.models.weight_transfer import export_hf_weights, load_hf_weights
from megatron_rl.parallel.device import on_accelerator, select_device, transformer_engine_problem
from megatron_rl.parallel.distributed import ParallelSizes


def parallel_sizes(parallel: ParallelConfig) -> ParallelSizes:
    """The recipe's parallel section as the sizes ``initialize_parallel`` takes."""
    return ParallelSizes(
        tp=parallel.tp,
        pp=parallel.pp,
        vpp=parallel.vpp,
        cp=parallel.cp,
        ep=parallel.ep,
        etp=parallel.etp,
        first_stage_layers=parallel.first_stage_layers,
        last_stage_layers=parallel.last_stage_layers,
    )


class PolicyActor:
    """This rank's model chunks, optimizer, reference weights and routing replay.

    With ``lora`` the model is the frozen base plus LoRA adapters (:func:`~megatron_rl.models.lora.apply_lora`):
    only the adapters have gradients, DDP buffers and optimizer state, and the reference policy is the base with
    the adapters switched off (no copy of any weight).

    Args:
        hf_config: the model's Hugging Face config.json as a dict.
        parallel, train, algorithm: the recipe's sections.
        norm_constant: C of ``seq-mean-token-sum-norm`` in tokens (the run's
            ``loss_norm_constant``); ignored by the other modes.
        temperature: the rollout's sampling temperature T (``rollout.temperature``),
            > 0. Every log-prob and entropy the actor computes (old, current in
            the loss, reference) is of softmax(logits / T), the distribution the
            engine sampled from and reports log-probs of.
        hf_weights: checkpoint directory to load, or None to keep the random init.
        keep_reference: keep the initial weights as the reference policy
            (default: when the recipe uses a KL loss). Ignored with ``lora``: the reference is always there.
        lora: the recipe's ``lora:`` section, or None to train every weight.
        lora_seed: seeds the adapters' initial ``A`` (the same adapter at every parallel layout).

    Raises:
        ValueError: ``temperature`` is not a finite number > 0 (greedy
            decoding samples from no distribution whose log-probs could be trained on).
        RuntimeError: the parallel state is not initialised, or at other sizes than ``parallel``.
    """

    def __init__(
        self,
        hf_config: Mapping[str, Any],
        parallel: ParallelConfig,
        train: TrainConfig,
        algorithm: AlgorithmConfig,
        *,
        norm_constant: float,
        temperature: float,
        hf_weights: str | Path | None = None,
        keep_reference: bool | None = None,
        lora: LoRAConfig | None = None,
        lora_seed: int = 0,
    ) -> None:
        if not 0.0 < temperature < math.inf:
            raise ValueError(f"temperature must be a finite number > 0 to train on sampled rollouts; got {temperature}")
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("call initialize_parallel(parallel_sizes(parallel)) before building a PolicyActor")
        initialized = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if initialized != (parallel.tp, parallel.pp, parallel.cp, parallel.ep):
            raise RuntimeError(
                f"the parallel state was initialised at (tp, pp, cp, ep) = {initialized}, the actor is asked for "
                f"{(parallel.tp, parallel.pp, parallel.cp, parallel.ep)}: initialize_parallel(parallel_sizes(parallel))"
            )
        self.arch = parse_hf_config(hf_config)
        te_problem, dtype = transformer_engine_problem(), params_dtype(train)
        use_te = te_problem is None
        overrides = actor_config_overrides(
            train,
            is_moe=self.arch.is_moe,
            routing_replay=algorithm.routing_replay,
            transformer_engine_problem=te_problem,
            compute_capability=torch.cuda.get_device_capability() if on_accelerator() else None,
            transformer_engine_version=importlib.metadata.version("transformer_engine") if use_te else None,
        )
        self.config = build_transformer_config(
            self.arch, parallel_sizes(parallel), params_dtype=dtype, use_transformer_engine=use_te, overrides=overrides
        )
        self.chunks = build_model_chunks(self.arch, self.config, use_transformer_engine=use_te)
        if hf_weights is not None:
            load_hf_weights(self.chunks, self.arch, hf_weights)
        self.lora = lora
        if lora is not None:
            # before DDP: Megatron's buffers and the optimizer take only the parameters that require gradients
            apply_lora(self.chunks, self.arch, lora, seed=lora_seed)
        self.models = wrap_ddp(self.config, self.chunks)
        self.optimizer = build_optimizer(self.models, train, dtype)
        replay = (
            RoutingReplay(self.chunks, sequence_parallel=self.config.sequence_parallel)
            if algorithm.routing_replay
            else None
        )
        packing = select_packing(
            pack_sequences=train.pack_sequences,
            cuda=on_accelerator(),
            transformer_engine_spec=use_te,
            tp=self.config.tensor_model_parallel_size,
            cp=self.config.context_parallel_size,
            sequence_parallel=self.config.sequence_parallel,
            fp8_recipe=self.config.fp8_recipe if self.config.fp8 else None,
        )
        self._forward = ForwardOptions(
            vocab_size=self.arch.vocab_size,
            temperature=temperature,
            max_tokens_per_micro_batch=train.max_tokens_per_micro_batch,
            packing=packing,
            replay=replay,
            chunk_tokens=train.logprob_chunk_tokens,
            fp8_recipe=self.config.fp8_recipe if self.config.fp8 else None,
        )
        # The reference routes with its own routers: the engine's experts are the policy's choice.
        self._reference_forward = dataclasses.replace(self._forward, replay=None)
        self.step_context = StepContext(self.models, self.optimizer, train, algorithm, norm_constant, self._forward)
        keep = lora is None and (algorithm.use_kl_loss if keep_reference is None else keep_reference)
        reference_device = select_device() if algorithm.reference_placement == "device" else "cpu"
        self._reference = ReferencePolicyWeights(self.models, device=reference_device) if keep else None
        on_device = algorithm.reference_placement == "device"
        extra = self._reference.tensors if self._reference is not None and on_device else ()
        self._offloader = StateOffloader(self.models, self.optimizer.optimizer, extra)
        self._device = select_device()

    def log_probs(self, shard: StepData, *, reference: bool = False) -> TokenLogProbs:
        """Log-probs and entropies of this DP rank's samples at the sampling temperature, as the step has them.

        [n, S] for the shard's n samples in its order (``StepData.to_actor_batch`` rows), on the
        last pipeline stage (zeros on the others). ``reference``: the reference policy's, which
        routes with its own routers (no routing replay). All ranks call this together, as the
        training step.

        Raises:
            RuntimeError: ``reference`` but the actor keeps no reference weights (``keep_reference``).
            ValueError: routing replay is on and the shard has no routed experts.
        """
        return self.batch_log_probs(self.prepare(shard), reference=reference)

    def batch_log_probs(self, local: ActorBatch, *, reference: bool) -> TokenLogProbs:
        """:meth:`log_probs` of rows already prepared (:meth:`prepare`): the step pads and moves its shard once."""
        if not reference:
            return local_log_probs(self.models, local, self._forward)
        if self.lora is not None:
            with adapters_disabled(self.chunks):
                return local_log_probs(self.models, local, self._reference_forward)
        if self._reference is None:
            raise RuntimeError("this actor keeps no reference weights; build it with keep_reference=True")
        with self._reference.swapped_in():
            return local_log_probs(self.models, local, self._reference_forward)

    def prepare(self, shard: StepData) -> ActorBatch:
        """``shard``'s rows on this rank's device, checked for what the recipe needs before any collective."""
        local = shard.to_actor_batch()
        if self._forward.replay is not None:
            self._forward.replay.check_batch(local)
        return local.to(self._device)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full tensor) pairs of this rank's chunks; all ranks of a TP group iterate together."""
        return export_hf_weights(self.chunks, self.arch)

    def export_adapter(self) -> dict[str, torch.Tensor]:
        """The whole LoRA adapter under PEFT names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``),
        fp32 on CPU, on every rank; every rank calls it together.

        Raises:
            RuntimeError: the actor has no adapters (built without ``lora``).
        """
        if self.lora is None:
            raise RuntimeError("this actor trains the whole model and has no LoRA adapter; build it with lora=...")
        return lora_state_to_peft(self.chunks)

    def offload(self, *, keep_params: bool = False) -> None:
        """Move parameters, gradients and optimizer state to host memory (colocated rollout phase).

        ``keep_params``: move only gradients and optimizer state (the parameters stay for a weight sync).
        """
        self._offloader.offload(keep_params=keep_params)

    def reload(self) -> None:
        """Bring the offloaded state back, bit-identical."""
        self._offloader.reload()
