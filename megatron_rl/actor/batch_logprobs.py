"""Per-token log-probs and entropy of a data-parallel rank's own rows, forward only.

Shape legend: n sequences (this DP rank's rows), S tokens.

:func:`local_log_probs` runs this data-parallel rank's rows through the pipeline schedule
(``models.forward.run_pipeline_schedule``) in token-budget micro-batches (packed or padded, see
``micro_batch_forward``) and keeps the [n, S] values (aligned as in ``token_logprobs``) on the
last pipeline stage, the rank whose loss uses them: the trainer's old and reference log-probs
are computed where they are trained on and never leave that rank. It is the path behind
``PolicyActor.log_probs`` and the old and reference log-probs of ``train_step.train_step``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from megatron.core import parallel_state

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.batch_partition import local_micro_batches
from megatron_rl.actor.micro_batch_forward import (
    ForwardOptions,
    ModelInput,
    model_inputs,
    output_log_probs,
    run_model,
    schedule_shape,
)
from megatron_rl.actor.token_logprobs import TokenLogProbs
from megatron_rl.models.forward import run_pipeline_schedule


@torch.no_grad()
def local_log_probs(
    models: list[torch.nn.Module],
    local: ActorBatch,
    options: ForwardOptions,
) -> TokenLogProbs:
    """[n, S] log-probs and entropies of this data-parallel rank's own rows ``local``.

    All ranks call this together, each DP rank with its rows (every rank of a model-parallel
    group the same). The values are on the last pipeline stage, where the loss uses them; other
    stages get zeros. Nothing is communicated but the micro-batch count and shape (MAX over DP).
    """
    plan, micro_batches = local_micro_batches(local, options.max_tokens_per_micro_batch, options.fp8_recipe)
    inputs = model_inputs(micro_batches, options.packing)

    def forward_step(
        data_iterator: Iterator[ModelInput], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[..., TokenLogProbs]]:
        item = next(data_iterator)
        logits = run_model(model, item, options.replay)
        return logits, lambda output, non_loss_data=True: output_log_probs(output, item, options)

    for model in models:
        model.eval()
    micro_batch_size, seq_length = schedule_shape(inputs)
    with options.replaying():
        outputs = run_pipeline_schedule(
            models, forward_step, inputs, micro_batch_size=micro_batch_size, seq_length=seq_length
        )
    result_2nS = local.input_ids.new_zeros((2, local.num_sequences, local.seq_length), dtype=torch.float32)
    if parallel_state.is_pipeline_last_stage():
        for part, output in zip(plan, outputs, strict=True):
            rows = torch.tensor(part, device=result_2nS.device)
            width = min(local.seq_length, output.log_probs.shape[1])
            result_2nS[0, rows, :width] = output.log_probs[: len(part), :width].float()
            result_2nS[1, rows, :width] = output.entropy[: len(part), :width].float()
    return TokenLogProbs(result_2nS[0], result_2nS[1])
