"""megatron-rl: Megatron-native RL post-training (DAPO, Dr.GRPO, GRPO) for large mixture-of-experts models."""

__version__ = "0.1.0"
