"""Pure tensor math of the RL algorithms (GRPO, Dr.GRPO, DAPO, GSPO, TIS).

This package imports torch at most: no Megatron, Ray or transformers, so every
function here runs, and is tested, on any CPU. The semantics are those of
DESIGN.md section 3.

Shape legend used throughout: B responses (in this shard), T response tokens
(padded), V vocabulary, G groups. Names carry the suffix (``loss_BT``).
A mask is [B, T] with non-zero marking valid response tokens.

Conventions:

* Losses return this shard's share of the optimizer-step loss; the step-wide
  token and sequence counts (``count_tokens_and_seqs``, summed over
  micro-batches and all-reduced over data-parallel ranks) make the gradient
  independent of how the step is split.
* Metrics are detached 0-dim float32 tensors, means over this shard's valid
  tokens, so callers can all-reduce them (weighted by local token counts).
* Groups of responses are identified by id, never by position.
"""

from megatron_rl.algorithms.advantages import expand_to_tokens, grpo_advantages
from megatron_rl.algorithms.aggregation import LOSS_AGG_MODES, LossAggMode, aggregate_loss, count_tokens_and_seqs
from megatron_rl.algorithms.diagnostics import length_bias_metrics
from megatron_rl.algorithms.entropy import entropy_from_logits
from megatron_rl.algorithms.filtering import groups_with_signal
from megatron_rl.algorithms.importance import importance_correction
from megatron_rl.algorithms.kl import KL_KINDS, KLKind, kl_estimate
from megatron_rl.algorithms.policy_loss import gspo_loss, ppo_clip_loss
from megatron_rl.algorithms.registry import (
    AdvantageEstimator,
    PolicyLoss,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage_estimator,
    register_policy_loss,
)
from megatron_rl.algorithms.sample_metrics import majority_at_k, metrics_at_k, pass_at_k
from megatron_rl.algorithms.shaping import overlong_penalty

__all__ = [
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "AdvantageEstimator",
    "KLKind",
    "LossAggMode",
    "PolicyLoss",
    "aggregate_loss",
    "count_tokens_and_seqs",
    "entropy_from_logits",
    "expand_to_tokens",
    "get_advantage_estimator",
    "get_policy_loss",
    "groups_with_signal",
    "grpo_advantages",
    "gspo_loss",
    "importance_correction",
    "kl_estimate",
    "length_bias_metrics",
    "majority_at_k",
    "metrics_at_k",
    "overlong_penalty",
    "pass_at_k",
    "ppo_clip_loss",
    "register_advantage_estimator",
    "register_policy_loss",
]
