"""The rollout manager: prompts into scored groups for a training step.

Never imports Megatron, ``megatron_rl.models``/``actor``/``weight_sync`` or Ray. ``manager``
turns prompts into scored groups for a training step, through ``engine_pool`` (requests to the
engines of :mod:`megatron_rl.engines`), ``submissions`` (each window's requests), ``step_selection``
(which groups a step keeps) and ``group_assembler`` (scored, shaped training groups).
"""
