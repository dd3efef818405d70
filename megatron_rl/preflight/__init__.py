"""`megatron-rl preflight`: every GPU path a recipe uses, run at its own layout on the allocation, step by step."""
