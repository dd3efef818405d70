"""The Megatron policy worker: log-probs, training steps, optimizer, reference policy, routing replay.

Imports ``models``, ``parallel``, ``algorithms`` and ``data``; never Ray or
the rollout engines. :class:`PolicyActor` is the entry point.
"""

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.policy_actor import PolicyActor, parallel_sizes
from megatron_rl.actor.token_logprobs import TokenLogProbs

__all__ = ["PolicyActor", "ActorBatch", "TokenLogProbs", "parallel_sizes"]
