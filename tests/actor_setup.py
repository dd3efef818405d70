"""Shared pieces of the actor tests: a 2-layer Qwen3-MoE checkpoint, a fixed batch, recipe sections.

The batch: 8 sequences of 9..16 tokens (3..5 prompt tokens), random tokens
from a fixed seed, advantages of both signs, old log-probs = the model's
log-probs (computed by transformers) plus noise, so that the PPO ratio is
off 1 and both clip bounds are active on some tokens.

The actor takes a step as the driver sends it, one ``StepData`` shard per data-parallel rank:
:func:`rank_shard` is this rank's shard of a batch, :func:`batch_rows` puts shards' [n, S]
results back at their samples' rows of the batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.policy_actor import PolicyActor
from megatron_rl.actor.step_data import StepData
from megatron_rl.config.hf_config import load_hf_config
from megatron_rl.config.schema import AlgorithmConfig, ParallelConfig, TrainConfig
from megatron_rl.parallel.distributed import ParallelSizes
from tests.tiny_checkpoints import VOCAB

LENGTHS = (16, 9, 12, 14, 10, 15, 11, 13)
PROMPT_LENGTHS = (3, 4, 5, 3, 4, 5, 3, 4)
SEQ_LENGTH = 16


def save_tiny_moe_2layer(path: Path) -> Path:
    """Qwen3-MoE: 2 MoE layers, hidden 32, 4 experts top-2, vocab 100, fp32, random init (seed 3)."""
    # transformers 5 declares no head_dim on Qwen3MoeConfig; it keeps it as an extra attribute, which the model reads
    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(3)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1.0 + 0.2 * torch.randn_like(param) if name.endswith("norm.weight") else 0.15 * torch.randn_like(param)
            )
    model.save_pretrained(path)
    return path


def fixed_batch() -> ActorBatch:
    """The fixed batch without log-probs (see the module docstring)."""
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(SEQ_LENGTH)
    lengths = torch.tensor(LENGTHS)
    valid = positions < lengths.unsqueeze(1)
    response_mask = valid & (positions >= torch.tensor(PROMPT_LENGTHS).unsqueeze(1))
    input_ids = torch.randint(1, VOCAB, (len(LENGTHS), SEQ_LENGTH), generator=generator).masked_fill(~valid, 0)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 0.8, -0.8])
    return ActorBatch(input_ids=input_ids, lengths=lengths, response_mask=response_mask, advantages=advantages)


def transformers_log_probs(
    hf_dir: Path, batch: ActorBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) [B, S] of ``batch`` under softmax(logits / temperature) of the checkpoint.

    fp32 eager transformers, aligned like the actor's.
    """
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(batch.input_ids).logits[:, :-1].float()
    log_softmax = torch.log_softmax(logits / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    zeros = torch.zeros(batch.num_sequences, 1)
    return torch.cat([zeros, log_probs], 1), torch.cat([zeros, entropy], 1)


def batch_with_old_log_probs(hf_dir: Path, temperature: float = 1.0) -> ActorBatch:
    """The fixed batch with old log-probs = transformers' log-probs (at ``temperature``) + N(0, 0.2) noise on responses."""
    batch = fixed_batch()
    log_probs, _ = transformers_log_probs(hf_dir, batch, temperature)
    noise = 0.2 * torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(1))
    return batch.replace(old_log_probs=torch.where(batch.response_mask, log_probs + noise, 0.0))


def step_data(batch: ActorBatch) -> StepData:
    """``batch`` as the driver's one-mini-batch ``StepData`` (``to_actor_batch`` gives its rows back).

    ``batch`` is right-padded with token 0 to its longest row; a row's response starts at its
    first ``response_mask`` token and runs to its length. Rollout log-probs and routed experts
    are kept where ``batch`` has them; missing advantages are zeros.
    """
    lengths = batch.lengths.tolist()
    prompt_lengths = torch.where(batch.response_mask.any(1), batch.response_mask.int().argmax(1), batch.lengths)
    tokens = [slice(0, n) for n in lengths]
    responses = [slice(int(p), n) for p, n in zip(prompt_lengths, lengths, strict=True)]
    routed = [slice(0, n - 1) for n in lengths]  # the engine routes every token but the last

    def cut(values: torch.Tensor, spans: list[slice]) -> torch.Tensor:
        return torch.cat([row[span] for row, span in zip(values, spans, strict=True)])

    rollout, experts = batch.rollout_log_probs, batch.routed_experts
    return StepData(
        token_ids=cut(batch.input_ids, tokens).to(torch.int32),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(batch.lengths, 0)]),
        prompt_lengths=prompt_lengths,
        advantages=batch.advantages if batch.advantages is not None else torch.zeros(batch.num_sequences),
        loss_mask=cut(batch.response_mask, responses),
        rollout_log_probs=None if rollout is None else cut(rollout, responses),
        routed_experts=None if experts is None else cut(experts, routed),
        sample_ids=torch.arange(batch.num_sequences),
        mini_batch_sizes=(batch.num_sequences,),
    )


def rank_shard(batch: ActorBatch, mini_batches: int = 1) -> StepData:
    """This data-parallel rank's shard of ``batch`` in ``mini_batches`` mini-batches (``StepData.shard``).

    Needs ``initialize_parallel``; every rank of a model-parallel group gets the same shard.
    """
    shards = step_data(batch).shard(parallel_state.get_data_parallel_world_size(), mini_batches)
    return shards[parallel_state.get_data_parallel_rank()]


def batch_rows(parts: Iterable[tuple[torch.Tensor, torch.Tensor]], like: ActorBatch) -> torch.Tensor:
    """Shards' ``(sample_ids, [n, S'] values)`` at their samples' rows of a [B, S] tensor shaped like ``like``.

    Rows no part holds stay zero (the actor's log-probs of a sample live on its own DP rank only).
    """
    out = torch.zeros(like.num_sequences, like.seq_length)
    for sample_ids, values in parts:
        out[sample_ids, : values.shape[1]] = values.float()
    return out


def parallel_config(sizes: ParallelSizes) -> ParallelConfig:
    """The recipe section of ``sizes``."""
    return ParallelConfig(
        tp=sizes.tp,
        pp=sizes.pp,
        vpp=sizes.vpp,
        cp=sizes.cp,
        ep=sizes.ep,
        etp=sizes.etp,
        first_stage_layers=sizes.first_stage_layers,
        last_stage_layers=sizes.last_stage_layers,
    )


def train_config(**fields) -> TrainConfig:
    """fp32, one step; Adam eps 1.0 (the update is then close to lr * gradient, so a scale error shows)."""
    defaults: dict[str, Any] = dict(steps=1, prompts_per_step=8, precision="fp32", lr=1.0, adam_eps=1.0, grad_clip=None)
    return TrainConfig(**(defaults | fields))


def algorithm_config(**fields) -> AlgorithmConfig:
    """DAPO-like clipping (0.2 / 0.28), token-mean by default."""
    return AlgorithmConfig(**({"clip_low": 0.2, "clip_high": 0.28} | fields))


def tiny_actor(
    hf_dir: Path,
    sizes: ParallelSizes,
    *,
    train: TrainConfig | None = None,
    algorithm: AlgorithmConfig | None = None,
    temperature: float = 1.0,
    load_weights: bool = True,
    keep_reference: bool | None = None,
) -> PolicyActor:
    """This rank's PolicyActor of the checkpoint ``hf_dir`` at ``sizes`` (C = 16 tokens); needs initialize_parallel.

    ``train`` / ``algorithm`` default to :func:`train_config` / :func:`algorithm_config`;
    ``load_weights=False`` keeps Megatron's random init.
    """
    return PolicyActor(
        load_hf_config(hf_dir),
        parallel_config(sizes),
        train or train_config(),
        algorithm or algorithm_config(),
        norm_constant=16,
        temperature=temperature,
        hf_weights=hf_dir if load_weights else None,
        keep_reference=keep_reference,
    )
