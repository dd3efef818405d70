"""The memory and placement planner behind ``megatron-rl plan``: torch-, Megatron- and Ray-free."""
