"""The Megatron policy worker: log-probs, training steps, optimizer, reference policy, routing replay.

Imports ``models``, ``parallel``, ``algorithms`` and ``data``; never Ray or the rollout engines.
:class:`~megatron_rl.actor.policy_actor.PolicyActor` is the entry point. The package re-exports nothing, so the
driver can import :mod:`megatron_rl.actor.step_data` without megatron-core.
"""
