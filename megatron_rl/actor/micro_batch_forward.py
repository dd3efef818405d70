"""One micro-batch through the actor's model, the pieces of Megatron's ``forward_step`` that every pass shares.

The training step (``train_step``) and the forward-only log-prob pass (``batch_logprobs``) each
hand Megatron's schedule a forward step built from these, under the actor's one
:class:`ForwardOptions` bundle (vocabulary, temperature, token budget, layout, routing replay,
log-prob chunking): :func:`model_inputs` turns the micro-batches into what the model gets,
:func:`run_model` runs one chunk on one of them (setting the routers' replay targets, when
replaying, right before the chunk's forward and handing them to recomputation right after it),
and :func:`output_log_probs` turns the last stage's vocab-parallel logits into [B, S] token
log-probs and entropies of softmax(logits / temperature). This is the only path from logits to
log-probs in the actor (old, current and reference log-probs, entropy), so all of them see the
temperature.

Two input layouts, chosen once by :func:`~megatron_rl.actor.packing.select_packing`:

* padded (``options.packing=None``): the micro-batch's ``[B, S]`` ids, positions
  0..S-1 for every row, causal attention (right padding never influences the
  positions before it); all micro-batches share one ``[B, S]`` shape; with
  context parallelism each CP rank runs its load-balanced ``[B, S / cp]`` share
  (``parallel.context_parallel``) and the log-probs are gathered into whole rows;
* packed (a :class:`~megatron_rl.actor.packing.PackingRule`): each
  micro-batch becomes one ``[1, T]`` THD stream with ``PackedSeqParams``
  (Transformer Engine attention only), T the same for all micro-batches of
  the call; with context parallelism each CP rank runs its chunks of every
  segment; the log-probs are gathered and unpacked back to ``[B, S]``.

Either way :func:`output_log_probs` gives the same [B, S] tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.packing import (
    PackedLayout,
    PackingRule,
    pack_tokens,
    packed_seq_params,
    plan_micro_batch_packing,
)
from megatron_rl.actor.routing_replay import RoutingReplay
from megatron_rl.actor.token_logprobs import TokenLogProbs, packed_token_log_probs, token_log_probs
from megatron_rl.parallel.context_parallel import split_sequence


@dataclass(frozen=True)
class ForwardOptions:
    """How the actor runs its model over micro-batches, forward-only or training; built once per actor.

    Attributes:
        vocab_size: the model's vocabulary (log-probs over it, not over TP padding).
        temperature: the rollout's sampling temperature T (> 0): log-probs and entropies are
            those of softmax(logits / T).
        max_tokens_per_micro_batch: the token budget of a micro-batch.
        packing: pack with this rule (GPU with Transformer Engine), or None for the padded layout.
        replay: routing replay, or None for the model's own routing (the reference policy).
        chunk_tokens: log-probs over at most that many tokens at once (``train.logprob_chunk_tokens``).
        fp8_recipe: None without FP8; sets the padded length's alignment
            (``packing.padded_sequence_multiple``).
    """

    vocab_size: int
    temperature: float
    max_tokens_per_micro_batch: int
    packing: PackingRule | None = None
    replay: RoutingReplay | None = None
    chunk_tokens: int = 0
    fp8_recipe: str | None = None

    def replaying(self) -> contextlib.AbstractContextManager[None]:
        """What one schedule call runs under: routing replay's context, or nothing without replay."""
        return self.replay.replaying() if self.replay is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class ModelInput:
    """What the model gets for one micro-batch: ids and positions [B, S] or [1, T] (this CP rank's share under
    context parallelism), THD parameters if packed; ``whole_ids``: the whole rows or stream the log-probs are of."""

    micro_batch: ActorBatch
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    whole_ids: torch.Tensor
    layout: PackedLayout | None = None
    packed_seq_params: PackedSeqParams | None = None


def model_inputs(micro_batches: Sequence[ActorBatch], packing: PackingRule | None) -> list[ModelInput]:
    """The model's input for each of ``micro_batches`` (one ``[B, S]`` shape, cut under the token budget)."""
    first = micro_batches[0].input_ids
    cp_group = parallel_state.get_context_parallel_group()
    context_parallel = cp_group.size() > 1
    if packing is None:
        positions = torch.arange(first.shape[1], device=first.device).expand(first.shape[0], -1)
        if context_parallel:
            return [
                ModelInput(
                    mb, split_sequence(mb.input_ids, 1, cp_group), split_sequence(positions, 1, cp_group), mb.input_ids
                )
                for mb in micro_batches
            ]
        return [ModelInput(mb, mb.input_ids, positions, mb.input_ids) for mb in micro_batches]
    layouts = plan_micro_batch_packing([mb.lengths.tolist() for mb in micro_batches], first.shape[1], packing)
    inputs = []
    for mb, layout in zip(micro_batches, layouts, strict=True):
        whole, positions = pack_tokens(mb.input_ids, layout), layout.position_ids(first.device)
        stream = whole
        if context_parallel:
            stream = split_sequence(whole, 1, cp_group, segments=layout.cu_seqlens)
            positions = split_sequence(positions, 1, cp_group, segments=layout.cu_seqlens)
        params = packed_seq_params(layout, first.device, context_parallel=context_parallel)
        inputs.append(ModelInput(mb, stream, positions, whole, layout, params))
    return inputs


def schedule_shape(inputs: Sequence[ModelInput]) -> tuple[int, int]:
    """``(micro_batch_size, seq_length)`` for Megatron's schedule call over ``inputs``."""
    batch_size, local_length = inputs[0].input_ids.shape
    # Megatron sizes pipeline messages from whole rows; it divides by cp.
    return batch_size, local_length * parallel_state.get_context_parallel_group().size()


def run_model(model: torch.nn.Module, item: ModelInput, replay: RoutingReplay | None) -> torch.Tensor:
    """One model chunk's forward on ``item`` (its output: logits on the last stage), with replay's routing."""
    if replay is not None:
        replay.set_micro_batch(item.micro_batch, model, item.layout)
    logits: torch.Tensor = model(item.input_ids, item.position_ids, None, packed_seq_params=item.packed_seq_params)
    if replay is not None:
        replay.forward_done(model)
    return logits


def output_log_probs(output: torch.Tensor, item: ModelInput, options: ForwardOptions) -> TokenLogProbs:
    """[B, S] token log-probs and entropies of ``item``'s rows from the last stage's vocab-parallel ``output``."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()
    if item.layout is None:
        return token_log_probs(
            output,
            item.whole_ids,
            options.vocab_size,
            tp_group,
            temperature=options.temperature,
            chunk_tokens=options.chunk_tokens,
            cp_group=cp_group,
        )
    return packed_token_log_probs(
        output,
        item.whole_ids,
        item.layout,
        options.vocab_size,
        tp_group,
        temperature=options.temperature,
        chunk_tokens=options.chunk_tokens,
        cp_group=cp_group,
    )
